"""Models by Hugging Face Hub name, as a vLLM user types them (`baton serve ORG/NAME`), through
huggingface_hub: served from an HF cache laid out by the test with the network off
(HF_HUB_OFFLINE=1), and downloaded from a loopback server standing in for the Hub (HF_ENDPOINT),
at a --revision, with HF_TOKEN sent. No Hub is reachable from where Baton is built: HF_ENDPOINT
always points at loopback here."""
from __future__ import annotations

import json
import shutil
import urllib.request

import grpc
import pytest
from tiny_hub import REPO_ID, Serve, StandInHub, commit_of, lay_out_cache, tiny_checkpoint

from baton.serving.processes import free_port
from baton.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.timeout(600)
UNREACHABLE = "http://127.0.0.1:9"              # the discard port: nothing answers there


@pytest.fixture(scope="module")
def revisions(tmp_path_factory):
    """main and v1 of one repository: v1 differs in its context length, which GetModelInfo tells."""
    root = tmp_path_factory.mktemp("checkpoints")
    main = tiny_checkpoint(root / "main", max_position_embeddings=512)
    v1 = root / "v1"
    shutil.copytree(main, v1)
    config = json.loads((v1 / "config.json").read_text())
    (v1 / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}, indent=2))
    return {"main": main, "v1": v1}


def serve(model_args: list[str], env: dict, tmp_path) -> tuple[Serve, int, int]:
    port, http = free_port(), free_port()
    s = Serve([*model_args, "--colocated", "--port", str(port), "--http-port", str(http), "--cache-dir",
               str(tmp_path / "baton-cache"), "--num-kv-blocks", "64"],
              {"HF_HUB_CACHE": str(tmp_path / "hf-cache"), **env}, tmp_path / "serve.log")
    return s, port, http


def ask(port: int) -> tuple[router_pb2.ModelInfo, list[int]]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        router = router_pb2_grpc.RouterStub(channel)
        info = router.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=30)
        req = router_pb2.GenerateRequest(text="hello there", sampling=router_pb2.SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True))
        tokens = [t for chunk in router.Generate(req, timeout=120) for t in chunk.token_ids]
    return info, tokens


def test_a_hub_name_is_served_from_the_hf_cache_with_the_network_off(revisions, tmp_path):
    lay_out_cache(tmp_path / "hf-cache", REPO_ID, {"main": revisions["main"]})
    config = tmp_path / "baton.yaml"             # a vLLM-style config file: names served, a batch limit
    config.write_text(f"served-model-name: [{REPO_ID}, tiny]\nmax-num-seqs: 2\n")
    s, port, http = serve([REPO_ID, "--config", str(config)], {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": UNREACHABLE},
                          tmp_path)
    try:
        info, tokens = ask(port)
        assert info.name == REPO_ID and info.max_model_len == 512 and len(tokens) == 4
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.load(r)["data"]] == [REPO_ID, "tiny"]     # the Hub name, as vLLM's id
    finally:
        s.stop()
    assert not (tmp_path / "baton-cache" / "models").exists()       # served from the HF cache, not copied


def test_a_hub_name_is_fetched_from_the_hub_at_its_revision_with_the_token(revisions, tmp_path):
    hub = StandInHub(REPO_ID, revisions)
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_stand_in_token", "HF_HUB_OFFLINE": "0"}
    try:
        s, port, _ = serve(["--model", REPO_ID, "--revision", "v1"], env, tmp_path)
        try:
            info, tokens = ask(port)
        finally:
            s.stop()
    finally:
        hub.close()
    assert info.name == REPO_ID and info.max_model_len == 256 and len(tokens) == 4     # v1's, not main's
    v1 = commit_of(revisions["v1"])
    snapshot = tmp_path / "hf-cache" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / v1
    assert (snapshot / "model.safetensors").is_file() and (snapshot / "tokenizer.json").is_file()
    fetched = {path for method, path, _ in hub.seen if method == "GET" and "/resolve/" in path}
    assert f"/{REPO_ID}/resolve/{v1}/model.safetensors" in fetched
    assert {auth for _, path, auth in hub.seen if REPO_ID in path} == {"Bearer hf_stand_in_token"}   # HF_TOKEN
    # once in the cache, the same command serves with the network off
    s, port, _ = serve(["--model", REPO_ID, "--revision", "v1"], {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": UNREACHABLE},
                       tmp_path)
    try:
        assert ask(port)[0].max_model_len == 256
    finally:
        s.stop()


def test_a_revision_the_hub_lacks_is_one_clear_error(revisions, tmp_path):
    import os
    import subprocess
    import sys

    from cluster import REPO
    hub = StandInHub(REPO_ID, revisions)
    try:
        out = subprocess.run([sys.executable, "-m", "baton", "serve", REPO_ID, "--revision", "no-such-tag", "--port",
                              str(free_port()), "--http-port", "0", "--cache-dir", str(tmp_path / "baton-cache")],
                             cwd=REPO, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
                                  "HF_HUB_OFFLINE": "0"})
    finally:
        hub.close()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"baton serve: --revision no-such-tag: no such branch, tag or commit of {REPO_ID}" in out.stderr
