"""Loopback throughput of the grpc KV backend, next to a plain TCP socket copy of the same bytes.

Sender and receiver run in separate processes (multiprocessing, spawn); each send is timed
from the open to the DONE ack, i.e. until the receiver's on_complete holds every byte.

    python -m kvtransfer.bench                       # 8, 64 and 256 MiB
    python -m kvtransfer.bench --sizes-mib 64 --chunk-mib 4 --window-mib 16 --json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import zlib

from kvtransfer.grpc_options import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW_BYTES

MIB = 1 << 20
READY_TIMEOUT_S = 60.0
BENCH_LAYOUT = dict(model="bench", architecture="bench", dtype="uint8", block_size=1, num_layers=1,
                    num_kv_heads=1, head_dim=1)


# -- the grpc backend ------------------------------------------------------------------------------
def _grpc_receiver(conn, total_bytes: int, repeats: int) -> None:
    asyncio.run(_grpc_receive(conn, total_bytes, repeats))


async def _grpc_receive(conn, total_bytes: int, repeats: int) -> None:
    import grpc

    from kvtransfer.grpc_backend import KVTransferServicer
    from kvtransfer.grpc_options import server_options
    from kvtransfer.layout import KVLayout
    from kvtransfer.receiver import PendingTransfers

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
    from kvtransfer.grpc_backend import GrpcKVSender
    from kvtransfer.layout import KVLayout

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
        if not s_parent.poll(600.0):
            raise TimeoutError("the sender process did not finish")
        sent = s_parent.recv()
        if not r_parent.poll(60.0):
            raise TimeoutError("the receiver process did not report")
        return sent, r_parent.recv()
    finally:
        for p in (sp, rp):
            if p is not None:
                p.join(10.0)
                if p.is_alive():
                    p.kill()


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
def measure_direct(total_bytes: int, src_device: str, dst_device: str, repeats: int = 3,
                   overlap: bool = True, prefill_flops: float = 0.0, chunks: int = 1) -> dict:
    """The direct backend from `src_device` to `dst_device` (each rank on its own thread of
    this process, descriptors over gRPC on 127.0.0.1), the bytes checked once:
      - `seconds`: one transfer at a time, open -> DONE (what a lone request pays);
      - `pipelined`: several transfers in flight on the pair, as under load (bytes per second);
      - on an accelerator with `overlap`, `overlap`: a transfer beside unrelated compute, and,
        given `prefill_flops` (the prefill that makes this KV), `streamed`: that prefill as
        `chunks` chunks of bf16 matmuls, each chunk's piece sent as it ends, as a prefill worker
        streams -- how much of the transfer is still exposed after the prefill ends."""
    return asyncio.run(_direct(total_bytes, src_device, dst_device, repeats, overlap, prefill_flops, chunks))


@contextlib.asynccontextmanager
async def direct_loopback(src_device: str, dst_device: str, max_staged_bytes: int = 1 << 30):
    """A decode side (KVTransfer handshake + KVDirect on `dst_device`) on 127.0.0.1 and a
    handshaken sender from `src_device`, in this process; yields (pending, sender, receiver)."""
    import grpc
    import torch

    from kvtransfer.direct_backend import DirectKVReceiver, DirectKVSender
    from kvtransfer.grpc_backend import KVTransferServicer
    from kvtransfer.layout import KVLayout
    from kvtransfer.receiver import PendingTransfers

    layout = KVLayout(**BENCH_LAYOUT, backends=["direct", "grpc"])
    pending = PendingTransfers(max_staged_bytes=max_staged_bytes)
    server = grpc.aio.server()
    KVTransferServicer(pending, layout).add_to_server(server)
    receiver = DirectKVReceiver(pending, torch.device(dst_device), layout.payload_nbytes(1))
    receiver.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    sender = DirectKVSender(channel, f"127.0.0.1:{port}", torch.device(src_device))
    try:
        await sender.handshake(layout)
        yield pending, sender, receiver
    finally:
        await sender.close()
        await receiver.close()
        await channel.close()
        await server.stop(0)


PIPELINE_BYTES = 8 << 30        # staging the pipelined measure may take on the receiving device


async def _direct(total_bytes: int, src_device: str, dst_device: str, repeats: int, overlap: bool,
                  prefill_flops: float, chunks: int) -> dict:
    import torch

    from kvtransfer.backend import TransferDescriptor

    src = torch.device(src_device)
    landed: dict[str, torch.Tensor] = {}
    payload = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8, device=src)
    depth = max(2, min(8, PIPELINE_BYTES // max(total_bytes, 1)))
    async with direct_loopback(src_device, dst_device, max(total_bytes, 1) * depth) as (pending, sender, _):
        def expect(tid: str) -> None:
            keep = tid == "warm-up"      # checked once; later payloads are dropped at once, as after unpacking
            pending.expect(tid, total_bytes, 120, lambda t, p, *_: landed.__setitem__(t, p if keep else None),
                           lambda t, why: landed.__setitem__(t, why))

        async def one(tid: str) -> float:
            expect(tid)
            t0 = time.perf_counter()
            await sender.send(TransferDescriptor(tid, nbytes=total_bytes), payload, 1, timeout=120)
            return time.perf_counter() - t0

        await one("warm-up")                       # the pair's communicator connects here
        if not torch.equal(landed.pop("warm-up").to(src), payload):
            raise RuntimeError("the received bytes differ from the sent bytes")
        seconds = [await one(f"t{i}") for i in range(repeats)]
        result = {"seconds": seconds, "median_s": statistics.median(seconds), "best_s": min(seconds),
                  "collective": sender.collective, "src": src_device, "dst": dst_device}

        async def pipelined(rounds: int = 3) -> float:
            best = math.inf
            for r in range(rounds):
                tids = [f"p{r}-{i}" for i in range(depth)]
                for tid in tids:
                    expect(tid)
                t0 = time.perf_counter()
                await asyncio.gather(*(sender.send(TransferDescriptor(t, nbytes=total_bytes), payload, 1,
                                                   timeout=120) for t in tids))
                best = min(best, time.perf_counter() - t0)
            return best
        took = await pipelined()
        result["pipelined"] = {"transfers_in_flight": depth, "seconds": took,
                               "bytes_per_s": depth * total_bytes / took}
        if overlap and src.type != "cpu":
            result["overlap"] = await _overlap(one, src, statistics.median(seconds))
        if overlap and prefill_flops > 0:
            result["streamed"] = await _streamed(sender, expect, payload, src, prefill_flops, chunks,
                                                 statistics.median(seconds))
        landed.clear()
        return result


def _matmul_timer(device):
    """(a, compute) where compute(n) launches n bf16 matmuls a @ a on `device` and times them
    to completion; a is 8192^2 on accelerators, 256^2 on the CPU."""
    import torch
    accel = getattr(torch, device.type)
    size = 256 if device.type == "cpu" else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)

    def compute(n: int) -> float:
        accel.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            torch.mm(a, a)
        accel.synchronize(device)
        return time.perf_counter() - t0
    compute(2)
    return a, compute


async def _overlap(one, device, transfer_s: float) -> dict:
    """Compute (bf16 matmuls sized to last about as long as one transfer) alone, then with one
    transfer under way: the fraction of the transfer's time that vanished under the compute."""
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


async def _streamed(sender, expect, payload, device, prefill_flops: float, chunks: int, transfer_s: float,
                    rounds: int = 3) -> dict:
    """A stand-in prefill (matmuls of `prefill_flops`, in `chunks` steps) with the transfer
    streamed as a prefill worker streams it: opened as the compute starts, one piece per chunk
    posted once that chunk's compute is queued (the send waits for it on the device, through an
    event), the first token after the last. exposed = DONE - the end of the last chunk's compute
    (seen by a thread waiting on its event)."""
    import torch

    from kvtransfer.backend import TransferDescriptor
    from kvtransfer.direct_backend import record_ready
    accel = getattr(torch, device.type)
    a, compute = _matmul_timer(device)
    per_mm = compute(10) / 10
    mm_flops = 2 * a.shape[0] ** 3
    per_chunk = max(1, round(prefill_flops / chunks / mm_flops))
    alone = min(compute(per_chunk * chunks) for _ in range(2))
    total, bb = payload.numel(), sender.block_bytes
    bounds = [total // bb * i // chunks for i in range(chunks + 1)]       # in blocks
    loop = asyncio.get_running_loop()
    exposed, prefill = [], []
    for r in range(rounds):
        tid = f"streamed-{r}"
        expect(tid)
        accel.synchronize(device)
        t0 = time.perf_counter()
        opening = asyncio.ensure_future(sender.open(TransferDescriptor(tid, nbytes=total), timeout=120))
        for i in range(chunks):
            for _ in range(per_chunk):
                torch.mm(a, a)
            ready = record_ready(device)
            if i == 0:
                out = await opening
            await out.piece(payload[bounds[i] * bb:bounds[i + 1] * bb], bounds[i + 1] - bounds[i], ready)
        computed = loop.run_in_executor(None, _wait_event, ready)
        await out.finish(1)
        done = time.perf_counter()
        computed_at = await computed
        exposed.append(max(0.0, done - computed_at))
        prefill.append(computed_at - t0)
    exposed_s = statistics.median(exposed)
    return {"chunks": chunks, "prefill_alone_s": alone, "prefill_while_streaming_s": statistics.median(prefill),
            "prefill_flops": prefill_flops, "exposed_s": exposed_s, "transfer_alone_s": transfer_s,
            "hidden_fraction": max(0.0, min(1.0, 1 - exposed_s / transfer_s)),
            "compute": f"{chunks} x {per_chunk} bf16 {a.shape[0]}^3 matmuls on {device} ({per_mm * 1e3:.2f} ms each)"}


def _wait_event(event) -> float:
    """When `event` passed (perf_counter), seen from a thread blocking on it."""
    if event is not None:
        event.synchronize()
    return time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtransfer.bench", description=__doc__,
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
