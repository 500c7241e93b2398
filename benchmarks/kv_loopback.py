"""Loopback throughput of the grpc KV backend, next to a plain TCP socket copy of the same bytes.

Sender and receiver run in separate processes (multiprocessing, spawn); each send is timed
from the open to the DONE ack, i.e. until the receiver's on_complete holds every byte.

    python -m baton.benchmarks.kv_loopback                       # 8, 64 and 256 MiB
    python -m baton.benchmarks.kv_loopback --sizes-mib 64 --chunk-mib 4 --window-mib 16 --json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import zlib

from baton.benchmarks import environment as bench_env
from baton.engine.kv_handoff import KVPiece
from baton.engine.platforms import get_platform
from baton.kvtransfer.grpc_options import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW_BYTES

MIB = 1 << 20
READY_TIMEOUT_S = 60.0
BENCH_LAYOUT = dict(model="bench", architecture="bench", dtype="uint8", block_size=1, num_layers=1,
                    num_kv_heads=1, head_dim=1)


# -- the grpc backend ------------------------------------------------------------------------------
def _grpc_receiver(conn, total_bytes: int, repeats: int) -> None:
    asyncio.run(_grpc_receive(conn, total_bytes, repeats))


async def _grpc_receive(conn, total_bytes: int, repeats: int) -> None:
    import grpc

    from baton.kvtransfer.grpc_backend import KVTransferServicer
    from baton.kvtransfer.grpc_options import server_options
    from baton.kvtransfer.layout import KVLayout
    from baton.kvtransfer.receiver import PendingTransfers

    pending = PendingTransfers(max_staged_bytes=max(total_bytes, 1))
    done = asyncio.Event()
    payloads: list = []                  # checked after the timed sends, off their clock

    def on_complete(tid, payload, first_token, extra):
        payloads.append(payload)
        if len(payloads) == repeats:
            done.set()

    def on_fail(tid, reason):
        payloads.append(b"failed: " + reason.encode())
        done.set()

    server = grpc.aio.server(options=server_options())
    KVTransferServicer(pending, KVLayout(**BENCH_LAYOUT)).add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    for i in range(repeats):
        pending.expect(f"bench-{i}", total_bytes, 600.0, on_complete, on_fail)
    conn.send(port)
    cpu = time.process_time()
    await asyncio.wait_for(done.wait(), 600.0)
    cpu = time.process_time() - cpu
    conn.send({"crcs": [zlib.crc32(p) for p in payloads], "cpu_s": cpu})
    await server.stop(1.0)


def _grpc_sender(conn, port: int, total_bytes: int, chunk_bytes: int, window_bytes: int, repeats: int) -> None:
    conn.send(asyncio.run(_grpc_send(port, total_bytes, chunk_bytes, window_bytes, repeats)))


async def _grpc_send(port: int, total_bytes: int, chunk_bytes: int, window_bytes: int, repeats: int) -> dict:
    from baton.kvtransfer.grpc_backend import GrpcKVSender
    from baton.kvtransfer.layout import KVLayout

    payload = os.urandom(total_bytes)
    sender = GrpcKVSender(f"127.0.0.1:{port}", chunk_bytes=chunk_bytes, window_bytes=window_bytes)
    await sender.handshake(KVLayout(**BENCH_LAYOUT))
    seconds, in_flight = [], 0
    cpu = time.process_time()
    for i in range(repeats):
        stats = await sender.send(f"bench-{i}", payload, first_token=0, timeout=600.0)
        seconds.append(stats.seconds)
        in_flight = max(in_flight, stats.max_in_flight_bytes)
    cpu = time.process_time() - cpu
    await sender.close()
    return {"seconds": seconds, "crc": zlib.crc32(payload), "max_in_flight_bytes": in_flight, "cpu_s": cpu}


# -- the baseline: one TCP socket, sendall / recv_into -------------------------------------------
def _tcp_receiver(conn, total_bytes: int, repeats: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        peer, _ = listener.accept()
        cpu = time.process_time()
        with peer:
            buffer = bytearray(total_bytes)
            view = memoryview(buffer)
            for _ in range(repeats):
                got = 0
                while got < total_bytes:
                    n = peer.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError("sender closed early")
                    got += n
                peer.sendall(b"k")
    conn.send({"crcs": [zlib.crc32(buffer)] * repeats, "cpu_s": time.process_time() - cpu})


def _tcp_sender(conn, port: int, total_bytes: int, repeats: int) -> None:
    payload = os.urandom(total_bytes)
    seconds = []
    cpu = time.process_time()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(repeats):
            t0 = time.perf_counter()
            sock.sendall(payload)
            if sock.recv(1) != b"k":
                raise ConnectionError("receiver closed early")
            seconds.append(time.perf_counter() - t0)
    conn.send({"seconds": seconds, "crc": zlib.crc32(payload), "max_in_flight_bytes": 0,
               "cpu_s": time.process_time() - cpu})


# -- driver ------------------------------------------------------------------------------------------
def _run_pair(receiver, receiver_args: tuple, sender, sender_args: tuple) -> tuple[dict, dict]:
    """Start receiver, hand its port to the sender, collect both results (spawned processes)."""
    ctx = mp.get_context("spawn")
    r_parent, r_child = ctx.Pipe()
    s_parent, s_child = ctx.Pipe()
    rp = ctx.Process(target=receiver, args=(r_child, *receiver_args), daemon=True)
    rp.start()
    sp = None
    try:
        if not r_parent.poll(READY_TIMEOUT_S):
            raise TimeoutError("the receiver process did not start listening")
        port = r_parent.recv()
        sp = ctx.Process(target=sender, args=(s_child, port, *sender_args), daemon=True)
        sp.start()
        sent = _result_of(sp, s_parent, 600.0, "sender", rp)
        return sent, _result_of(rp, r_parent, 60.0, "receiver")
    finally:
        for p in (sp, rp):
            if p is not None:
                p.join(10.0)
                if p.is_alive():
                    p.kill()


def _result_of(proc, conn, timeout: float, role: str, peer=None):
    """What `proc` sends back; fails at once, saying how, if it (or its peer) dies first."""
    until = time.monotonic() + timeout
    while not conn.poll(0.5):
        for p, name in ((proc, role), (peer, "receiver")):
            if p is not None and not p.is_alive() and not conn.poll(0):
                raise RuntimeError(f"the {name} process died (exit code {p.exitcode}) before the {role} reported; "
                                   "its stack, if it crashed, is above")
        if time.monotonic() > until:
            raise TimeoutError(f"the {role} process did not report within {timeout:g}s "
                               "(BATON_BENCH_STACKS_S=N prints every process's stacks after N seconds)")
    return conn.recv()


def _summary(total_bytes: int, sent: dict, received: dict) -> dict:
    if any(c != sent["crc"] for c in received["crcs"]):
        raise RuntimeError("the received bytes differ from the sent bytes")
    best, median = min(sent["seconds"]), statistics.median(sent["seconds"])
    return {"seconds": list(sent["seconds"]), "gbps": total_bytes / median / 1e9, "best_gbps": total_bytes / best / 1e9,
            "latency_ms": median * 1e3, "best_latency_ms": best * 1e3,
            "max_in_flight_bytes": sent["max_in_flight_bytes"],
            # CPU seconds per GB moved, each side: what the copy costs besides wall time
            "sender_cpu_s_per_gb": sent["cpu_s"] / (total_bytes * len(sent["seconds"]) / 1e9),
            "receiver_cpu_s_per_gb": received["cpu_s"] / (total_bytes * len(sent["seconds"]) / 1e9)}


def measure_tcp_loopback(total_bytes: int, repeats: int = 3) -> dict:
    sent, received = _run_pair(_tcp_receiver, (total_bytes, repeats), _tcp_sender, (total_bytes, repeats))
    return _summary(total_bytes, sent, received)


def measure_grpc_loopback(total_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                          window_bytes: int = DEFAULT_WINDOW_BYTES, repeats: int = 3,
                          baseline: bool = True) -> dict:
    """GB/s and latency of pushing `total_bytes` over the grpc backend between two processes on
    127.0.0.1 (median of `repeats` sends on one warm connection), and, with `baseline`, of a plain
    TCP socket copy of the same bytes, with the ratio grpc / tcp."""
    sent, received = _run_pair(_grpc_receiver, (total_bytes, repeats), _grpc_sender,
                               (total_bytes, chunk_bytes, window_bytes, repeats))
    result = {"total_bytes": total_bytes, "chunk_bytes": chunk_bytes, "window_bytes": window_bytes,
              "repeats": repeats, **_summary(total_bytes, sent, received)}
    if baseline:
        tcp = measure_tcp_loopback(total_bytes, repeats)
        result["tcp_gbps"] = tcp["gbps"]
        result["tcp_latency_ms"] = tcp["latency_ms"]
        result["ratio_vs_tcp"] = result["gbps"] / tcp["gbps"]
    return result


# -- the direct backend -----------------------------------------------------------------------------
PIPELINE_BYTES = 8 << 30        # staging the pipelined measure may take on the receiving device
ROUNDS = 3                      # pipelined and streamed measures: best / median of this many
SUSTAINED_FACTOR = 4            # the sustained measure: this many windows' worth of transfers


def measure_direct(total_bytes: int, src_device: str, dst_device: str, repeats: int = 3,
                   overlap: bool = True, prefill_flops: float = 0.0, chunks: int = 1, backend: str = "direct",
                   layout: dict | None = None, in_place: bool = False) -> dict:
    """A device backend (`backend`: direct, nixl; both ends built by the registry) from a sender
    process on `src_device` to a receiver process on `dst_device` (KVTransfer + the backend's
    services on 127.0.0.1), as a prefill and a decode worker run it.
    A transfer has landed when the receiver's registry hands its bytes over (on_complete);
    both processes read the host's monotonic clock. The first transfer's bytes are checked.
      - `seconds`: a lone transfer, open -> landed (its open round trip included);
      - `from_ready`: a lone transfer opened ahead, as the prefill worker opens one when the
        prefill starts: the KV is ready -> landed (what is left after the prefill);
      - `pipelined`: a burst of several transfers at once on the pair: first open -> last
        landed, bytes per second;
      - `sustained`: the pair's bandwidth under steady load, SUSTAINED_FACTOR bursts' worth of
        transfers through a window of that many in flight (each opens when a slot frees, as
        prefills finishing one after another would): first open -> last landed, bytes per
        second -- the burst's start-up (an OPEN round trip, a PIECE's travel) paid once;
      - on an accelerator with `overlap`, `overlap`: a transfer beside unrelated compute, and,
        given `prefill_flops` (the prefill that makes this KV), `streamed`: that prefill as
        `chunks` chunks of bf16 matmuls, each chunk's piece announced once its compute is
        done (as the prefill worker does after each step), the next chunk computing meanwhile;
        `exposed_s` = landed - the end of the last chunk's compute.
    `layout` (KVLayout fields; the payload is whole blocks of it), with `in_place`: the receiver
    holds a paged KV cache of that layout and admission names each transfer's blocks, so a
    backend that writes in place (nixl) lands the KV straight in the cache, as in a decode
    worker (transfers in flight together get distinct blocks)."""
    import torch
    accel = torch.device(src_device).type != "cpu"
    depth = max(2, min(8, PIPELINE_BYTES // max(total_bytes, 1)))
    plan = {"repeats": repeats, "depth": depth, "overlap": overlap and accel,
            "prefill_flops": prefill_flops if overlap else 0.0, "chunks": chunks}
    tids = _direct_tids(plan)
    sent, got = _run_pair(_direct_receiver, (dst_device, total_bytes, tids, total_bytes * depth, backend, layout,
                                             depth if in_place else 0),
                          _direct_sender, (src_device, total_bytes, plan, backend, layout))
    if got["failed"]:
        raise RuntimeError(f"{backend} transfers failed: {got['failed']}")
    if not got["bytes_equal"]:
        raise RuntimeError("the received bytes differ from the sent bytes")
    landed = got["landed"]
    seconds = [landed[f"cold-{i}"] - sent["opened"][f"cold-{i}"] for i in range(repeats)]
    from_ready = [landed[f"ahead-{i}"] - sent["ready"][f"ahead-{i}"] for i in range(repeats)]
    took = min(max(landed[f"pipe-{r}-{i}"] for i in range(depth)) - sent["pipe_start"][r] for r in range(ROUNDS))
    n = depth * SUSTAINED_FACTOR
    steady = min(max(landed[f"sus-{r}-{i}"] for i in range(n)) - sent["sustained_start"][r] for r in range(ROUNDS))
    result = {"seconds": seconds, "median_s": statistics.median(seconds), "best_s": min(seconds),
              "from_ready": {"seconds": from_ready, "median_s": statistics.median(from_ready)},
              "done_seconds": sent["done_seconds"],
              "pipelined": {"transfers_in_flight": depth, "seconds": took, "bytes_per_s": depth * total_bytes / took},
              "sustained": {"transfers": n, "window": depth, "seconds": steady, "bytes_per_s": n * total_bytes / steady},
              "collective": sent.get("collective"), "communicator": sent.get("communicator"), "src": src_device,
              "dst": dst_device, "processes": 2, "landed_in_place": got["in_place"]}
    if "overlap" in sent:
        result["overlap"] = sent["overlap"]
    st = sent.get("streamed")
    if st:
        exposed = [max(0.0, landed[f"streamed-{r}"] - at) for r, at in enumerate(st.pop("computed_at"))]
        st["exposed_s"] = statistics.median(exposed)
        st["transfer_alone_s"] = result["median_s"]
        st["hidden_fraction"] = max(0.0, min(1.0, 1 - st["exposed_s"] / result["median_s"]))
        result["streamed"] = st
    return result


def _direct_tids(plan: dict) -> list[str]:
    """Every transfer the measurement makes, in order (the receiver expects them all)."""
    tids = ["warm-up"] + [f"cold-{i}" for i in range(plan["repeats"])] + \
        [f"ahead-{i}" for i in range(plan["repeats"])] + \
        [f"pipe-{r}-{i}" for r in range(ROUNDS) for i in range(plan["depth"])] + \
        [f"sus-{r}-{i}" for r in range(ROUNDS) for i in range(plan["depth"] * SUSTAINED_FACTOR)]
    if plan["overlap"]:
        tids.append("overlap")
    if plan["prefill_flops"] > 0:
        tids += [f"streamed-{r}" for r in range(ROUNDS)]
    return tids


def _pattern(nbytes: int, device):
    """Bytes both processes can make alike, so the receiver checks what landed: a hashed
    counter whose period (32,744 bytes) lines up with no block or piece boundary."""
    import torch
    period = 4093 * 8
    base = ((torch.arange(period, dtype=torch.int64, device=device) * 2654435761) >> 11).to(torch.uint8)
    return base.repeat(-(-nbytes // period))[:nbytes]


@contextlib.asynccontextmanager
async def _decode_side(dst_device: str, max_staged_bytes: int, backend: str = "direct", layout: dict | None = None,
                       kv_cache=None):
    """KVTransfer (the handshake) and `backend`'s services on `dst_device`, on 127.0.0.1;
    yields (pending, port, receiver)."""
    import grpc

    from baton.kvtransfer import registry
    from baton.kvtransfer.receiver import PendingTransfers

    pending = PendingTransfers(max_staged_bytes=max_staged_bytes)
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    receivers = registry.make_receivers(backend, registry.ReceiverContext(
        pending, _direct_layout(backend, layout), get_platform(dst_device), f"127.0.0.1:{port}", "127.0.0.1",
        kv_cache=kv_cache))
    for r in receivers:
        r.add_to_server(server)
    await server.start()
    try:
        yield pending, port, receivers[-1]
    finally:
        await server.stop(10)            # calls under way (the last DONE going out) finish first
        for r in receivers:
            await r.close()


def _direct_layout(backend: str = "direct", layout: dict | None = None):
    from baton.kvtransfer import registry
    from baton.kvtransfer.layout import KVLayout
    return KVLayout(**(layout or BENCH_LAYOUT), backends=registry.spoken(backend))


def _sender(backend: str, channel, port: int, device: str):
    from baton.kvtransfer import registry
    return registry.make_sender(backend, registry.SenderContext(f"127.0.0.1:{port}", channel, get_platform(device)))


@contextlib.asynccontextmanager
async def direct_loopback(src_device: str, dst_device: str, max_staged_bytes: int = 1 << 30):
    """A decode side on `dst_device` and a handshaken sender from `src_device`, both in this
    process (tests); yields (pending, sender, receiver)."""
    import grpc

    from baton.kvtransfer.direct_backend import DirectKVSender

    async with _decode_side(dst_device, max_staged_bytes) as (pending, port, receiver):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        sender = DirectKVSender(channel, f"127.0.0.1:{port}", get_platform(src_device))
        try:
            await sender.handshake(_direct_layout())
            yield pending, sender, receiver
        finally:
            await sender.close()
            await channel.close()


def _direct_receiver(conn, device: str, total_bytes: int, tids: list[str], max_staged: int,
                     backend: str = "direct", layout: dict | None = None, slots: int = 0) -> None:
    _report_if_stuck()
    _bind(device)
    asyncio.run(_direct_receive(conn, device, total_bytes, tids, max_staged, backend, layout, slots))


async def _direct_receive(conn, device: str, total_bytes: int, tids: list[str], max_staged: int,
                          backend: str, layout: dict | None = None, slots: int = 0) -> None:
    import torch

    from baton.engine.kv_handoff import InPlace
    from baton.engine.runner.kv_blocks import pack_blocks_on_device
    landed: dict[str, float] = {}
    failed: dict[str, str] = {}
    checked: list[bool] = []
    in_place: list[str] = []
    settled = asyncio.Event()
    kv, pages = None, {}
    if slots:                          # a paged cache with `slots` transfers' blocks; transfer i gets slot i % slots
        lay = _direct_layout(backend, layout)
        n = total_bytes // lay.block_nbytes
        kv = torch.empty((lay.num_layers, 2, n * slots, lay.block_size, lay.num_kv_heads, lay.head_dim),
                         dtype=getattr(torch, lay.dtype), device=device)
        pages = {tid: list(range((i % slots) * n, (i % slots + 1) * n)) for i, tid in enumerate(tids)}

    def on_complete(tid, payload, first_token, extra):
        landed[tid] = time.monotonic()
        if isinstance(payload, InPlace):
            in_place.append(tid)
        if tid == tids[0]:               # off the clock: the warm-up is not timed
            if isinstance(payload, InPlace):
                data = pack_blocks_on_device(kv, list(payload.block_ids))
            else:
                data = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(payload, dtype=torch.uint8)
            checked.append(torch.equal(data, _pattern(total_bytes, data.device)))
        if len(landed) + len(failed) == len(tids):
            settled.set()

    def on_fail(tid, why):
        failed[tid] = why
        settled.set()

    async with _decode_side(device, max_staged, backend, layout, kv) as (pending, port, receiver):
        for tid in tids:
            pending.expect(tid, total_bytes, 600.0, on_complete, on_fail, pages=pages.get(tid, ()),
                           on_release=(lambda _: None) if kv is not None else None)
        conn.send(port)
        await asyncio.wait_for(settled.wait(), 600.0)
        for _ in range(600):                 # the last DONE goes out; the sender closes the pair
            if not getattr(receiver, "pairs", None):
                break
            await asyncio.sleep(0.05)
    conn.send({"landed": landed, "failed": failed, "bytes_equal": all(checked) and bool(checked),
               "in_place": len(in_place)})


def _direct_sender(conn, port: int, device: str, total_bytes: int, plan: dict, backend: str = "direct",
                   layout: dict | None = None) -> None:
    _report_if_stuck()
    _bind(device)
    conn.send(asyncio.run(_direct_send(port, device, total_bytes, plan, backend, layout)))


def _report_if_stuck() -> None:
    """A benchmark process that crashes prints its Python stack; one still running after
    BATON_BENCH_STACKS_S seconds prints every thread's (and again each as many seconds): where
    a stuck transfer waits."""
    faulthandler.enable(file=sys.stderr)
    after = bench_env.stacks_after_s()
    if after > 0:
        faulthandler.dump_traceback_later(after, repeat=True, file=sys.stderr)


def _bind(device: str) -> None:
    """Work on `device` only (no context on the other device of the pair)."""
    get_platform(device).bind_thread()


async def _direct_send(port: int, device: str, total_bytes: int, plan: dict, backend: str,
                       layout: dict | None = None) -> dict:
    import grpc
    import torch

    from baton.kvtransfer.backend import TransferDescriptor

    src = torch.device(device)
    payload = _pattern(total_bytes, src)
    opened, ready, done_seconds, pipe_start, sustained_start = {}, {}, [], [], []
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    sender = _sender(backend, channel, port, device)

    def descriptor(tid: str) -> TransferDescriptor:
        return TransferDescriptor(tid, nbytes=total_bytes)

    async def one(tid: str) -> float:
        """A lone transfer: open, the whole payload, finish; open -> DONE on this side."""
        opened[tid] = time.monotonic()
        await sender.send(descriptor(tid), payload, 1, timeout=120)
        return time.monotonic() - opened[tid]

    async def ahead(tid: str) -> None:
        out = await sender.open(descriptor(tid), timeout=120)
        ready[tid] = time.monotonic()
        await out.piece(KVPiece("", 0, out.num_blocks, payload, None, 1))
        await out.done()

    try:
        await sender.handshake(_direct_layout(backend, layout))
        await one("warm-up")                      # the pair's communicator connects here
        done_seconds = [await one(f"cold-{i}") for i in range(plan["repeats"])]
        for i in range(plan["repeats"]):
            await ahead(f"ahead-{i}")
        for r in range(ROUNDS):
            pipe_start.append(time.monotonic())
            await asyncio.gather(*(sender.send(descriptor(f"pipe-{r}-{i}"), payload, 1, timeout=120)
                                   for i in range(plan["depth"])))
        async def windowed(tid: str, window: asyncio.Semaphore) -> None:
            async with window:
                await sender.send(descriptor(tid), payload, 1, timeout=120)
        for r in range(ROUNDS):
            window = asyncio.Semaphore(plan["depth"])
            sustained_start.append(time.monotonic())
            await asyncio.gather(*(windowed(f"sus-{r}-{i}", window)
                                   for i in range(plan["depth"] * SUSTAINED_FACTOR)))
        result = {"opened": opened, "ready": ready, "done_seconds": done_seconds, "pipe_start": pipe_start,
                  "sustained_start": sustained_start,
                  "collective": getattr(sender, "collective", None),
                  "communicator": sender.pair.comm.name if getattr(sender, "pair", None) else None}
        if plan["overlap"]:
            result["overlap"] = await _overlap(one, src, statistics.median(done_seconds))
        if plan["prefill_flops"] > 0:
            result["streamed"] = await _streamed(sender, payload, src, plan["prefill_flops"], plan["chunks"])
        return result
    finally:
        await sender.close()
        await channel.close()


def _matmul_timer(device):
    """(a, compute) where compute(n) launches n bf16 matmuls a @ a on `device` and times them
    to completion; a is 8192^2 on accelerators, 256^2 on the CPU."""
    import torch
    platform = get_platform(str(device))
    size = 256 if device.type == "cpu" else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)

    def compute(n: int) -> float:
        platform.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            torch.mm(a, a)
        platform.synchronize()
        return time.perf_counter() - t0
    compute(2)
    return a, compute


async def _overlap(one, device, transfer_s: float) -> dict:
    """Compute (bf16 matmuls sized to last about as long as one transfer) alone, then with one
    transfer under way (open -> DONE, like `transfer_s`): the fraction of the transfer's time
    that vanished under the compute."""
    _, compute = _matmul_timer(device)
    per_mm = compute(10) / 10
    n = max(1, round(transfer_s / per_mm))
    alone = compute(n)
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    work = loop.run_in_executor(None, compute, n)
    await one("overlap")
    await work
    both = time.perf_counter() - t0
    hidden = (alone + transfer_s - both) / transfer_s
    return {"compute_alone_s": alone, "transfer_alone_s": transfer_s, "both_s": both,
            "hidden_fraction": max(0.0, min(1.0, hidden)), "compute": f"{n} bf16 8192^3 matmuls on {device}"}


async def _streamed(sender, payload, device, prefill_flops: float, chunks: int) -> dict:
    """A stand-in prefill (matmuls of `prefill_flops`, in `chunks` steps) with the transfer
    streamed as the prefill worker streams it: opened as the compute starts; after each chunk
    has finished (seen by a thread waiting on its event, as the engine's step ends) its piece
    goes to the sending task while the next chunk computes; the first token with the last.
    Returns when each round's last compute ended (`computed_at`); the caller adds when it landed."""
    import torch

    from baton.kvtransfer.backend import TransferDescriptor
    platform = sender.platform
    accel = platform.runtime
    a, compute = _matmul_timer(device)
    per_mm = compute(10) / 10
    per_chunk = max(1, round(prefill_flops / chunks / (2 * a.shape[0] ** 3)))
    alone = min(compute(per_chunk * chunks) for _ in range(2))
    total, bb = payload.numel(), sender.block_bytes
    bounds = [total // bb * i // chunks for i in range(chunks + 1)]       # in blocks
    loop = asyncio.get_running_loop()
    computed_at, prefill = [], []
    for r in range(ROUNDS):
        if accel is not None:
            accel.synchronize(device)
        t0 = time.monotonic()
        opening = asyncio.ensure_future(sender.open(TransferDescriptor(f"streamed-{r}", nbytes=total), timeout=120))
        pieces: asyncio.Queue = asyncio.Queue()
        streaming = asyncio.ensure_future(_send_pieces(opening, pieces))
        for i in range(chunks):
            for _ in range(per_chunk):
                torch.mm(a, a)
            at = await loop.run_in_executor(None, _wait_event, platform.record_event())
            pieces.put_nowait((payload[bounds[i] * bb:bounds[i + 1] * bb], bounds[i + 1] - bounds[i],
                               1 if i == chunks - 1 else None))
        out = await streaming
        await out.done()
        computed_at.append(at)
        prefill.append(at - t0)
    return {"chunks": chunks, "prefill_alone_s": alone, "prefill_while_streaming_s": statistics.median(prefill),
            "prefill_flops": prefill_flops, "computed_at": computed_at,
            "compute": f"{chunks} x {per_chunk} bf16 {a.shape[0]}^3 matmuls on {device} ({per_mm * 1e3:.2f} ms each)"}


async def _send_pieces(opening, pieces: asyncio.Queue):
    """The prefill worker's sending task: each piece as it is handed over, in order."""
    out = await opening
    while out.next_block < out.num_blocks:
        data, num_blocks, first_token = await pieces.get()
        await out.piece(KVPiece("", out.next_block, num_blocks, data, None, first_token))
    return out


def _wait_event(event) -> float:
    """When `event` passed (monotonic clock), seen from a thread blocking on it."""
    if event is not None:
        event.synchronize()
    return time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton.benchmarks.kv_loopback", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / MIB)
    parser.add_argument("--window-mib", type=float, default=DEFAULT_WINDOW_BYTES / MIB)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object per size")
    args = parser.parse_args(argv)
    chunk, window = int(args.chunk_mib * MIB), int(args.window_mib * MIB)
    if not args.json:
        print(f"KV loopback, chunk {args.chunk_mib:g} MiB, window {args.window_mib:g} MiB, median of "
              f"{args.repeats} ({os.cpu_count()} CPUs)")
        print(f"{'size':>8} {'grpc GB/s':>10} {'grpc ms':>9} {'tcp GB/s':>9} {'tcp ms':>8} {'grpc/tcp':>9}")
    for mib in args.sizes_mib:
        print(f"  measuring {mib} MiB ...", file=sys.stderr, flush=True)
        r = measure_grpc_loopback(mib * MIB, chunk, window, args.repeats)
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{mib:>4} MiB {r['gbps']:>10.2f} {r['latency_ms']:>9.1f} {r['tcp_gbps']:>9.2f} "
                  f"{r['tcp_latency_ms']:>8.1f} {r['ratio_vs_tcp']:>9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
