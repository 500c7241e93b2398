"""Tensor parallelism across the devices of one host: one process per rank, in lockstep.

Rank 0 lives in the engine's process and owns the scheduler; ranks 1..n-1 are spawned
processes, each holding its shard of the weights and of every KV head group. Every step,
rank 0 sends the step's host inputs (`StepInputs`: a few small numpy arrays) to each rank
over a pipe, and all ranks run the same forward: the row-parallel layers all-reduce and the
LM head all-gathers through torch.distributed (NCCL on CUDA, HCCL on Ascend, gloo on the
CPU). Only rank 0 samples, and broadcasts the tokens on the device: a step queued before the
last one's tokens are back (asynchronous scheduling) takes its pending inputs from them on
every rank. Start-up (KV sizing, kernel warm-up, graph capture) runs the
same code on every rank, so the collectives inside it line up.

    EngineConfig(model=..., device="cuda:0", tp_size=2)                    # ranks on cuda:0, cuda:1
    EngineConfig(..., tp_devices="cuda:2,cuda:3", tp_port=29600)           # or name them

The rendezvous is TCP on 127.0.0.1:`tp_port` (0: a free port). Disaggregated KV transfer
sends one rank's payload; prefill and decode roles therefore run with tp_size 1 for now.
Context parallelism (engine/runner/context_parallel.py) runs on the same ranks, with full weights.
"""
from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import socket
import sys
import threading
import traceback

import torch.distributed as dist

from baton.engine.config import PlatformOptions
from baton.engine.platforms import get_platform

STARTUP_TIMEOUT_S = 600          # loading, warm-up and graph capture on every rank
STEP_TIMEOUT_S = 300             # a collective that waits longer than this means a rank died


def rank_devices(device: str, tp_size: int, tp_devices: str | None) -> list[str]:
    """The device of each rank: named explicitly, or counted up from `device`."""
    if tp_devices:
        names = [d.strip() for d in tp_devices.split(",") if d.strip()]
        if len(names) != tp_size:
            raise ValueError(f"tp_devices names {len(names)} devices for tp_size {tp_size}")
        return names
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return ["cpu"] * tp_size
    start = int(index or 0)
    return [f"{kind}:{start + r}" for r in range(tp_size)]


def check_devices(devices: list[str], available: int | None = None) -> None:
    """Refuse ranks on accelerators this host does not have (`available`: how many it has)."""
    kind = devices[0].partition(":")[0]
    if kind == "cpu":
        return
    if available is None:
        import torch
        module = getattr(torch, kind, None)           # (torch.npu appears once torch_npu is imported)
        if module is None or not hasattr(module, "device_count"):
            return                                    # the rank's platform says so when it starts
        available = module.device_count()
    wanted = [int(d.partition(":")[2] or 0) for d in devices]
    if max(wanted) >= available:
        raise ValueError(f"{len(devices)} ranks on {', '.join(devices)}, but this host has {available} {kind} "
                         "devices: lower --tensor-parallel-size / --context-parallel-size or name other devices")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int, device: str, options: PlatformOptions) -> str:
    """Join the ranks' process group on the collective library of `device`'s platform (which
    also loads the device runtime, e.g. torch_npu's HCCL backend); returns its name."""
    platform = get_platform(device, options)
    platform.bind_thread()
    dist.init_process_group(platform.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
    return platform.dist_backend


class TensorParallel:
    """Rank 0's handle on the other ranks: started before rank 0 builds its own runner.
    `runner_cls` is what every other rank builds (ModelRunner; passed in, so this module
    needs nothing of the runner's)."""

    def __init__(self, config, runner_cls):
        self.size = config.num_ranks                   # tensor- or context-parallel ranks
        self.devices = rank_devices(config.device, self.size, config.tp_devices)
        check_devices(self.devices)
        port = config.tp_port or free_port()
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for rank in range(1, self.size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(runner_cls, config, rank, port, self.devices[rank], theirs),
                            name=f"baton-tp-rank{rank}", daemon=True)
            p.start()
            self.pipes.append(mine)
            self.procs.append(p)
        kind = "context" if config.context_parallel_size > 1 else "tensor"
        print(f"[baton] {kind} parallel: {self.size} ranks on {', '.join(self.devices)} "
              f"(rendezvous 127.0.0.1:{port})", file=sys.stderr)
        init_group(0, self.size, port, self.devices[0], config.platform_options())
        self.group = dist.group.WORLD

    def wait_ready(self) -> None:
        """Each rank says it built its runner (or why it could not)."""
        for rank, pipe in enumerate(self.pipes, 1):
            if not pipe.poll(STARTUP_TIMEOUT_S):
                raise RuntimeError(f"tensor-parallel rank {rank} did not start within {STARTUP_TIMEOUT_S}s")
            status = pipe.recv()
            if status != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{status}")

    def send(self, inputs) -> None:
        for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs, strict=True), 1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {proc.exitcode})")
            pipe.send(inputs)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        destroy_group()


def destroy_group(timeout: float = 30.0) -> None:
    """Tear down the ranks' process group; a teardown that hangs (a rank gone mid-collective)
    is left behind after `timeout` rather than hanging the engine's shutdown."""
    if not dist.is_initialized():
        return
    gc.collect()                      # graphs and work handles referencing the communicator
    t = threading.Thread(target=dist.destroy_process_group, name="baton-tp-teardown", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        print(f"[baton] tensor parallel: process group teardown still blocked after {timeout:.0f}s; "
              "leaving it to process exit", file=sys.stderr)


def _rank_main(runner_cls, config, rank: int, port: int, device: str, pipe) -> None:
    """A rank other than 0: build the same runner on its device, then run what rank 0 sends."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        init_group(rank, config.num_ranks, port, device, config.platform_options())
        runner = runner_cls(config, tp_rank=rank, tp_group=dist.group.WORLD, device=device)
    except BaseException:
        pipe.send(traceback.format_exc())
        raise
    pipe.send("ready")
    tokens = None                     # the last step's sampled tokens (rank 0's, received): the next step's pending ones
    while True:
        try:
            inputs = pipe.recv()
        except EOFError:              # rank 0 went away
            break
        if inputs is None:
            break
        tokens = runner.run(inputs, tokens)
    runner.graphs = None
    destroy_group()
