"""What every benchmark JSON carries besides its results: the command line, git commit,
host, library and driver versions, devices, model shape, dtype and device ceilings."""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shlex
import socket
import subprocess
from pathlib import Path

SCHEMA = "baton.bench/v1"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = Path("bench-results")


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def default_output(benchmark: str, smoke: bool) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return DEFAULT_DIR / f"{benchmark}{'-smoke' if smoke else ''}-{stamp}.json"


def git_info() -> dict:
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None
    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def versions() -> dict:
    import grpc
    import torch
    import transformers
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "grpcio": grpc.__version__,
           "cuda": torch.version.cuda, "driver": _nvidia_driver()}
    try:
        import torch_npu
        out["torch_npu"] = torch_npu.__version__
    except ImportError:
        pass
    return out


def _nvidia_driver() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = r.stdout.split()
    return lines[0] if r.returncode == 0 and lines else None


def device_info(devices: list[str]) -> dict:
    """Names of the devices a run used (in order, de-duplicated) and how many there are."""
    import torch
    used = list(dict.fromkeys(devices))
    names = [_device_name(torch, d) for d in used]
    info = {"type": torch.device(used[0]).type if used else "cpu", "count": len(used), "devices": used,
            "names": names, "name": names[0] if names else None}
    if info["type"] == "cpu":
        info["cpu_count"] = os.cpu_count()
        info["torch_threads"] = torch.get_num_threads()
    return info


def _device_name(torch, spec: str) -> str:
    dev = torch.device(spec)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "npu":
        import torch_npu  # noqa: F401
        return torch.npu.get_device_name(dev)
    return _cpu_model()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def new_record(benchmark: str, argv: list[str], smoke: bool, config: dict) -> dict:
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "smoke": smoke,
        "command": ["baton", "bench", *argv],
        "command_line": shlex.join(["baton", "bench", *argv]),
        "started_at": now_iso(),
        "finished_at": None,
        "git": git_info(),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "versions": versions(),
        "config": config,
        "model": None,
        "dtype": None,
        "device": None,
        "ceilings": None,
        "results": None,
    }


def write(record: dict, path: Path) -> Path:
    record["finished_at"] = now_iso()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(record), indent=2, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def _jsonable(x):
    """inf/nan are not JSON: write them as the strings "inf" / "nan" (rates may be infinite)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "to_json"):                # the harness's records (an SLO pair, a shape)
        return _jsonable(x.to_json())
    return x
