"""The backend registry: what the router, the worker flags and the services learn from it,
without importing torch or any backend."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from baton.kvtransfer import registry
from baton.serving.worker.worker_config import WorkerConfig, build_parser, worker_config_from_args

REPO = Path(__file__).resolve().parents[2]


def test_the_router_picks_the_best_backend_both_workers_speak():
    assert registry.pick(["nixl", "grpc"], ["nixl", "direct", "grpc"], same_accelerator=False) == "nixl"
    assert registry.pick(["direct", "grpc"], ["direct", "grpc"], same_accelerator=False) == "direct"
    assert registry.pick(["nixl", "grpc"], ["direct", "grpc"], same_accelerator=False) == "grpc"
    assert registry.pick(["grpc"], ["grpc"], same_accelerator=True) == "grpc"
    assert registry.pick(["made-up"], ["made-up"], same_accelerator=False) == ""


def test_two_workers_on_one_accelerator_skip_backends_that_cannot_pair_there():
    assert not registry.spec("direct").same_accelerator            # two ranks of one NCCL device
    assert registry.pick(["direct", "grpc"], ["direct", "grpc"], same_accelerator=True) == "grpc"
    assert registry.pick(["nixl", "direct", "grpc"], ["nixl", "direct", "grpc"], same_accelerator=True) == "nixl"


def test_a_worker_speaks_its_backend_and_grpc_and_serves_their_services():
    assert registry.spoken("grpc") == ["grpc"]
    assert registry.spoken("direct") == ["direct", "grpc"]
    assert registry.services("direct") == ["baton.v1.KVDirect", "baton.v1.KVTransfer"]
    auto = registry.spoken("auto")
    assert auto[-1] == "grpc" and set(auto) - {"grpc"} == {s.name for s in registry.SPECS.values()
                                                            if s.auto and s.available()}
    with pytest.raises(ValueError, match="unknown KV backend 'carrier-pigeon': use one of grpc"):
        registry.spoken("carrier-pigeon")


def test_backend_flags_come_from_their_spec_and_reach_the_backend_as_options():
    args = build_parser("decode").parse_args(["--kv-backend", "direct", "--kv-nccl", "torch"])
    cfg = worker_config_from_args(args, "decode")
    assert cfg.kv_options == {"kv_buffer_mib": registry.BUFFER_MIB, "kv_nccl": "torch", "kv_fault_stall_s": 0.0}
    assert set(cfg.kv_options) == {f.dest for f in registry.all_flags()}


def test_the_kv_buffer_is_the_flag_bounded_by_half_the_free_device_memory_with_a_floor():
    cfg = worker_config_from_args(build_parser("prefill").parse_args(["--kv-buffer-mib", "512"]), "prefill")
    assert registry.buffer_bytes(cfg.kv_options, None) == 512 << 20            # the CPU: the flag
    assert registry.buffer_bytes(cfg.kv_options, 600 << 20) == 300 << 20       # half of what the cache left
    assert registry.buffer_bytes(cfg.kv_options, 100 << 20) == registry.BUFFER_FLOOR_BYTES
    with pytest.raises(ValueError, match="--kv-buffer-mib must be >= 1, got 0"):
        worker_config_from_args(build_parser("prefill").parse_args(["--kv-buffer-mib", "0"]), "prefill")


def test_a_backend_gets_every_flag_at_its_default_where_the_caller_gave_none():
    ctx = registry.SenderContext("d:1", None, None, options={"kv_nccl": "torch"})
    assert ctx.options == {"kv_buffer_mib": registry.BUFFER_MIB, "kv_nccl": "torch", "kv_fault_stall_s": 0.0}
    assert registry.ReceiverContext(None, None, None, "d:1").options == {
        "kv_buffer_mib": registry.BUFFER_MIB, "kv_nccl": "direct", "kv_fault_stall_s": 0.0}


def test_a_backend_flag_out_of_range_is_refused_by_its_name():
    with pytest.raises(ValueError, match="--kv-fault-stall-s must be >= 0, got -1"):
        WorkerConfig(role="decode", kv_options={"kv_fault_stall_s": -1.0}).validate()


def test_a_backend_whose_package_is_missing_is_refused_with_how_to_install_it(monkeypatch):
    monkeypatch.setattr(registry.BackendSpec, "available", lambda self: not self.requires)
    with pytest.raises(ValueError, match=r"--kv-backend nixl needs .* pip install 'baton\[nixl\]'"):
        WorkerConfig(role="decode", kv_backend="nixl").validate()


def test_the_registry_imports_neither_torch_nor_grpc_nor_a_backend():
    code = ("import sys; from baton.kvtransfer import registry; registry.pick(['grpc'], ['grpc'], False); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'nixl', 'nixl_cu13') "
            "or 'backend' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_backend_names_live_in_the_registry_not_in_the_router_or_the_services():
    names = "|".join(registry.NAMES)
    pattern = re.compile(rf"""["']({names})["']""")
    found = [f"{path.relative_to(REPO)}:{i}: {line.strip()}"
             for folder in ("router", "serving", "prefill_service", "decode_service", "baton")
             for path in sorted((REPO / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_every_backend_ships_in_the_wheel():
    import tomllib
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = [s.module for s in registry.SPECS.values() if s.module not in packages]
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
