"""A tiny real checkpoint and the two places a Hub name can be served from without the Hub: an HF
cache laid out on disk as huggingface_hub lays it out, and a loopback HTTP server answering the
Hub's API for it (HF_ENDPOINT points there). Also `baton serve` run as a user runs it."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cluster import REPO

REPO_ID = "baton-test/tiny-llama"


def tiny_checkpoint(folder: Path, arch: str = "llama", **config) -> Path:
    """A random-weight checkpoint with its own small tokenizer: a tiny GGUF (tests/tiny_gguf.py)
    converted by Baton's importer; `config` fields overwrite config.json's."""
    from tiny_gguf import write_tiny_gguf

    from baton.models.gguf_import import convert
    gguf = write_tiny_gguf(folder.parent / f"{folder.name}.gguf", arch)
    convert(gguf, folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}, indent=2))
    return folder


def commit_of(folder: Path) -> str:
    """A 40-hex commit id for a folder's content (what the Hub gives a revision)."""
    h = hashlib.sha1()
    for f in sorted(folder.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def lay_out_cache(hub_cache: Path, repo_id: str, refs: dict[str, Path]) -> dict[str, str]:
    """`refs` (branch or tag -> checkpoint folder) written into an HF hub cache as huggingface_hub
    writes one: blobs by hash, snapshots/<commit>/ linking to them, refs/<name> holding the commit."""
    root = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commits = {}
    for ref, folder in refs.items():
        commit = commits[ref] = commit_of(folder)
        snapshot = root / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return commits


class StandInHub:
    """The Hub's HTTP API for one repository, on loopback: revision info, the file tree, and
    /resolve/ downloads (HEAD and GET), as huggingface_hub calls them. Records what it was asked
    and the Authorization header each request carried."""

    def __init__(self, repo_id: str, refs: dict[str, Path]):
        self.repo_id = repo_id
        self.refs = {ref: commit_of(folder) for ref, folder in refs.items()}
        self.files = {commit_of(folder): folder for folder in refs.values()}
        self.seen: list[tuple[str, str, str]] = []        # (method, path, authorization)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _commit(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.files else None)

    def _answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = req.path.split("?", 1)[0]
        self.seen.append((req.command, path, req.headers.get("Authorization", "")))
        repo = re.escape(self.repo_id)
        api = re.fullmatch(rf"/api/models/{repo}/(revision|tree)/([^/]+)", path)
        resolve = re.fullmatch(rf"/{repo}/resolve/([^/]+)/(.+)", path)
        if not (api or resolve):
            return self._send(req, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        commit = self._commit((api or resolve).group(2 if api else 1))
        if commit is None:
            return self._send(req, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, body)
        folder = self.files[commit]
        if api and api.group(1) == "revision":
            info = {"id": self.repo_id, "sha": commit, "siblings": [{"rfilename": f.name} for f in folder.iterdir()]}
            return self._send(req, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if api:
            tree = [{"type": "file", "path": f.name, "size": f.stat().st_size,
                     "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for f in folder.iterdir()]
            return self._send(req, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        f = folder / resolve.group(2)
        if not f.is_file():
            return self._send(req, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
        data = f.read_bytes()
        self._send(req, 200, data, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, body)

    @staticmethod
    def _send(req, status: int, data: bytes, headers: dict, body: bool) -> None:
        req.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            req.send_header(k, v)
        req.end_headers()
        if body:
            req.wfile.write(data)


class Serve:
    """`baton serve ARGS` in a subprocess, as a user types it: ready once it prints its address."""

    def __init__(self, args: list[str], env: dict, log: Path, timeout: float = 240):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "baton", "serve", *args], cwd=REPO,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while "baton is serving on" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"baton serve did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)        # Ctrl-C: the launcher stops the whole stack
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
