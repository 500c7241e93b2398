"""What `baton serve` checks before it starts a process, and the model made ready once for all.

The checks take milliseconds and no torch, like the port check beside them: a setting a worker
would refuse, a --model that names nothing Baton loads (or a Hub model missing from the cache with
the network off) or a --device this machine lacks is one line saying what to do, before anything
loads, not a traceback from every worker seconds later.

The model: on the first start with a model, one child process resolves it (downloads a Hub model
into the HF cache, fetches and converts the embedded GGUF, reads the config and tokenizer) with its
progress shown, so the workers and
the router find it ready instead of queueing behind one another on the conversion lock. A stamp
in the cache records it: later starts find the stamp and pay no extra process.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from baton import __version__, environment
from baton.models import hub
from baton.models import source as model_source
from baton.models.cache import cache_root
from baton.models.source import EMBEDDED, PRESETS
from baton.router.config import build_parser as router_parser
from baton.router.config import router_config_from_args
from baton.serving.worker.worker_config import worker_config_from_args

DEVICE = re.compile(r"(cpu|cuda|npu)(:\d+)?")


# -- the checks: each returns what is wrong, in one line, or None ----------------------------------
def problem(args: argparse.Namespace, roles: list[str], devices: list[str], router_argv: list[str]) -> str | None:
    """The first thing that would stop the stack, as `baton serve` would be told it."""
    found = config_problem(args, roles, router_argv) or model_problem(args.model, args.tokenizer, args.revision)
    for device in dict.fromkeys(devices):
        found = found or device_problem(device, args.npu_emulation)
    return found


def config_problem(args: argparse.Namespace, roles: list[str], router_argv: list[str]) -> str | None:
    """What the workers' and the router's own config validation would refuse (they would each
    exit with it after loading their libraries)."""
    try:
        for role in roles:
            worker_config_from_args(args, role)
        router_config_from_args(router_parser().parse_args(router_argv))
    except ValueError as exc:
        return str(exc)
    except OSError as exc:                  # a file named by a flag (the KV secret): missing, unreadable
        named = [f"--{k.replace('_', '-')} " for k, v in vars(args).items() if v == exc.filename]
        return f"{named[0] if named else ''}{exc.filename}: {exc.strerror or exc}"
    return None


def model_problem(model: str, tokenizer: str | None = None, revision: str | None = None) -> str | None:
    """What `resolve_model` would refuse without loading anything (tests/test_startup_errors.py
    keeps the two in step)."""
    if tokenizer and not Path(tokenizer).expanduser().is_dir():
        return f"--tokenizer {tokenizer}: no such directory (give a directory with tokenizer.json)"
    if hub.is_hub_name(model):
        return hub.offline_problem(model, revision)
    if revision:
        return f"--revision {revision}: only a Hub model (ORG/NAME) has revisions, not --model {model}"
    if model == EMBEDDED or model in PRESETS:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        return None if (path / "config.json").is_file() else \
            f"--model {model}: no config.json in that directory (an HF checkpoint has config.json and *.safetensors)"
    if path.suffix == ".gguf":
        return None if path.is_file() else f"--model {model}: no such file"
    return _unknown_model(model)


def _unknown_model(model: str) -> str:
    presets = ", ".join(name for name in PRESETS if not name.startswith("tiny-"))
    return (f"--model {model}: no such preset, directory or .gguf file; give {EMBEDDED} (the default), an HF "
            f"checkpoint directory, a .gguf file, a Hub name (ORG/NAME), or a preset ({presets})")


def device_problem(device: str, npu_emulation: bool = False) -> str | None:
    """A device this machine certainly lacks (a check that can't tell says nothing: the worker then
    decides, with torch)."""
    if not DEVICE.fullmatch(device):
        return f"--device {device}: use cpu, cuda:N or npu:N"
    kind, _, index = device.partition(":")
    if kind == "cuda":
        n = cuda_devices()
        if n == 0:
            return f"--device {device}: this machine has no NVIDIA GPU (or CUDA_VISIBLE_DEVICES hides them); use --device cpu"
        if n is not None and int(index or 0) >= n:
            return f"--device {device}: this machine has {n} NVIDIA GPU(s), cuda:0 to cuda:{n - 1}"
    if kind == "npu" and not npu_emulation and not _ascend_present():
        return f"--device {device}: this machine has no Ascend NPU (no /dev/davinci*, no torch_npu); use --device cpu"
    return None


def cuda_devices() -> int | None:
    """The GPUs CUDA would number, told from the driver's files (no torch); None where they can't
    tell. MIG and UUID entries of CUDA_VISIBLE_DEVICES are counted, not checked."""
    if Path("/dev/dxg").exists() or Path("/dev/kfd").exists():      # WSL's GPUs; ROCm's (torch calls them cuda)
        return None
    gpus = Path("/proc/driver/nvidia/gpus")
    n = len(list(gpus.iterdir())) if gpus.is_dir() else len(list(Path("/dev").glob("nvidia[0-9]*")))
    visible = environment.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return n
    count = 0
    for item in (v.strip() for v in visible.split(",")):
        if not (item.startswith(("GPU-", "MIG-")) or (item.isdigit() and int(item) < n)):
            break                               # CUDA stops at the first entry it can't use
        count += 1
    return min(count, n) if n else 0


def _ascend_present() -> bool:
    return any(Path("/dev").glob("davinci[0-9]*")) or importlib.util.find_spec("torch_npu") is not None


# -- the model, made ready once -------------------------------------------------------------------
def prepare_model(args: argparse.Namespace, env: dict, stopping: threading.Event) -> int:
    """0 once the model is ready for every process; else the exit code of the child that tried
    (it printed why)."""
    stamp = stamp_path(args)
    if is_ready(stamp):
        return 0
    print(f"[baton] preparing {args.model} for the workers and the router (once per machine and model) ...",
          file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "baton.preflight", str(stamp), args.model, args.cache_dir or "",
           args.tokenizer or "", args.revision or "", args.log_level, args.log_format]
    child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
    while child.poll() is None:
        if stopping.wait(0.2):
            child.terminate()
            child.wait()
            return 0
    return child.returncode


def stamp_path(args: argparse.Namespace) -> Path:
    """The stamp of this model as this installation resolves it: a new Baton, venv or model file
    (or a change to the code that resolves models) makes a new one."""
    here = Path(model_source.__file__).parent
    parts = [args.model, args.tokenizer or "", args.revision or "", sys.prefix, __version__,
             *(_signature(here / name) for name in ("source.py", "gguf_import.py"))]
    path = Path(args.model).expanduser()
    parts.append(_signature(path / "config.json" if path.is_dir() else path))
    key = hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:16]
    return cache_root(args.cache_dir) / "ready" / f"{key}.json"


def _signature(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}"


def is_ready(stamp: Path) -> bool:
    """Stamped, and what was made is still there (a cleared cache is made again)."""
    try:
        made = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return all(Path(p).is_dir() for p in made.values() if p)


def _prepare_here(stamp: Path, model: str, cache_dir: str | None, tokenizer: str | None,
                  revision: str | None) -> None:
    source = model_source.resolve_model(model, cache_dir, tokenizer, revision)
    made = {"weights": source.weights_path, "tokenizer": source.tokenizer_dir()}
    stamp.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(made))
    os.replace(tmp, stamp)                  # atomic: a stamp is whole or absent


def main(argv: list[str]) -> None:
    """The child `prepare_model` starts: `python -m baton.preflight STAMP MODEL CACHE_DIR TOKENIZER
    REVISION LOG_LEVEL LOG_FORMAT`."""
    from baton.serving.logs import setup_logging
    stamp, model, cache_dir, tokenizer, revision, level, fmt = argv
    setup_logging(level, fmt)
    try:
        _prepare_here(Path(stamp), model, cache_dir or None, tokenizer or None, revision or None)
    except ValueError as exc:
        print(f"baton serve: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:               # Ctrl-C reaches the whole stack; the launcher says goodbye
        sys.exit(130)


if __name__ == "__main__":
    main(sys.argv[1:])
