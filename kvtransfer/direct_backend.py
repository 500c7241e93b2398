"""The device-direct KV backend ("direct"): a request's KV goes from the prefill device to the
decode device through a collective library (NCCL between GPUs, HCCL between Ascend NPUs,
gloo on the CPU), with no host staging; gRPC carries only the rendezvous and descriptors.

Each prefill->decode pair of workers shares one two-rank communicator (prefill rank 0,
decode rank 1). `Connect` sets it up: the decode worker hosts a torch.distributed TCPStore
for that pair and both ends build the process group on it. A transfer is one `Transfer`
stream: the sender opens with the descriptor (transfer id, size, first token), the receiver
claims the reserved transfer, posts the receive into a device buffer and answers READY, the
sender packs its blocks on its device and posts the send, and the receiver answers DONE once
the bytes landed and went to its engine. One transfer at a time per pair, and every
operation of a pair is issued from that pair's own thread, so both ends post them in the
same order.

A transfer that does not complete before its deadline (a stalled link, a sender that died
after READY) fails on the receiver -- its blocks are freed through the registry's on_fail --
and the pair's communicator is aborted, since it has a receive posted that will never match;
the sender's next transfer connects a fresh pair.

Security: with a KV secret, Connect and Transfer need the session of the KVTransfer
handshake. The per-pair TCPStore and the collective's own sockets are not authenticated by
torch.distributed; they live on the KV network (`--kv-advertise` host) for as long as the
pair, so keep that network private.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from kvtransfer.backend import KVSender, KVTransferError, SendStats, TransferDescriptor, resolve_payload
from kvtransfer.blocks import pack_blocks_on_device
from kvtransfer.grpc_backend import GrpcKVSender
from kvtransfer.layout import KVLayout
from kvtransfer.peer_auth import KVPeerAuth, session_of
from kvtransfer.receiver import PendingTransfers, TransferRejected

log = logging.getLogger("baton.kvtransfer")
Code = grpc.StatusCode
Ack = kvtransfer_pb2.DirectAck

BACKEND = "direct"
COLLECTIVES = ("nccl", "hccl", "gloo")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
OPEN_TIMEOUT_S = 10.0          # the receiver waits this long for a Transfer stream's first message
JOIN_TIMEOUT_S = 60.0          # building a pair's communicator (both ends must join)
MAX_POLL_S = 200e-6            # completion polling interval at most (a transfer's latency floor)
MAX_PAIRS = 64                 # communicators one decode worker keeps (oldest idle ones closed first)
PAIR_IDLE_S = 600.0            # a pair unused this long is closed (its sender reconnects when it returns)
# Fault injection for tests and drills: a sender holds each transfer this many seconds after
# the receiver answered READY, as a stalled device link would.
STALL_ENV = "BATON_KV_FAULT_STALL_S"


@dataclass(frozen=True, slots=True)
class HeldBlocks:
    """A payload the sender packs itself, on its pair's stream, right before sending: blocks
    `block_ids` of the paged cache `kv`, which the prefill engine holds (their KV is final and
    nothing rewrites them) until the send has ended. No wait for the engine's step in flight."""

    kv: torch.Tensor
    block_ids: tuple[int, ...]


class PairGroup:
    """One two-rank communicator and the single thread that issues its operations."""

    def __init__(self, pair_id: str, collective: str, device: torch.device):
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}")
        self.pair_id = pair_id
        self.collective = collective
        self.device = device
        self.pg = None
        self.store = None
        self.broken: str | None = None          # why the pair can no longer be used
        self.busy = False                        # a transfer is in flight (one at a time)
        self.last_used = time.monotonic()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{collective}-{pair_id[:8]}",
                                          initializer=self._bind_device)

    def _bind_device(self) -> None:
        """The pair's thread works on the pair's device, on a stream of its own: collectives
        wait for the issuing thread's current stream, and on the default stream they would
        queue behind whatever prefill compute the engine has launched."""
        if self.device.type != "cpu":
            accel = getattr(torch, self.device.type)
            accel.set_device(self.device)
            accel.set_stream(accel.Stream(self.device))

    async def _on_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- set-up -----------------------------------------------------------------------------
    def host_store(self, host: str) -> int:
        """Decode side: start this pair's rendezvous store on a free port; returns the port."""
        self.store = dist.TCPStore(host, 0, 2, True, timeout=timedelta(seconds=JOIN_TIMEOUT_S),
                                   wait_for_workers=False)
        return self.store.port

    async def join(self, rank: int, host: str = "", port: int = 0, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Build the process group (rank 1 on the store this end hosts, rank 0 as its client)."""
        def build():
            if self.store is None:
                self.store = dist.TCPStore(host, port, 2, False, timeout=timedelta(seconds=timeout))
            self.pg = make_group(self.collective, dist.PrefixStore(self.pair_id, self.store), rank, timeout)
            # one tiny exchange: communicators that connect lazily (NCCL, HCCL) connect now, so a
            # transfer's receive is posted without blocking, and the link is known to work
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            work = self.pg.send([probe], 1, 0) if rank == 0 else self.pg.recv([probe], 0, 0)
            work.wait()
            if self.device.type != "cpu":
                getattr(torch, self.device.type).synchronize(self.device)
        try:
            await asyncio.wait_for(self._on_thread(build), timeout)
        except Exception as exc:
            self.close(f"could not build the {self.collective} communicator of pair {self.pair_id}: {exc}")
            raise

    # -- transfers ----------------------------------------------------------------------------
    async def send(self, payload: torch.Tensor | HeldBlocks, nbytes: int, timeout: float) -> None:
        """Send a packed uint8 tensor, or pack HeldBlocks on this pair's stream and send them."""
        def post():
            tensor = payload
            if isinstance(payload, HeldBlocks):    # stream-ordered with the send: no device sync
                tensor = pack_blocks_on_device(payload.kv, payload.block_ids)
            if tensor.dtype != torch.uint8 or tensor.device != self.device or tensor.numel() != nbytes:
                raise ValueError(f"the payload is {tensor.numel()} {tensor.dtype} on {tensor.device}; the "
                                 f"descriptor promised {nbytes} uint8 bytes on {self.device}")
            return self.pg.send([tensor.contiguous()], 1, 0)
        await self._complete(await self._on_thread(post), timeout, "send")

    async def post_recv(self, tensor: torch.Tensor):
        return await self._on_thread(lambda: self.pg.recv([tensor], 0, 0))

    async def _complete(self, work, timeout: float, what: str) -> None:
        """Wait until `work` has finished on the device (its bytes are final), within `timeout`."""
        self.last_used = time.monotonic()
        if self.collective == "gloo":       # gloo completes a work in wait(), which takes a timeout
            await self._on_thread(work.wait, timedelta(seconds=max(timeout, 0.001)))
            return
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while not work.is_completed():      # device collectives: poll, never block the loop
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {self.collective} {what} did not complete within {timeout:.1f}s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, MAX_POLL_S)
        work.wait()

    async def finish_recv(self, work, timeout: float) -> None:
        await self._complete(work, timeout, "receive")

    def close(self, reason: str, wait: float = 0.0) -> None:
        """Abort the communicator (pending operations fail) and free its thread; `wait`: seconds
        to let the abort finish (at shutdown; the event loop must not block on it otherwise)."""
        if self.broken is None:
            self.broken = reason
        pg, self.pg = self.pg, None
        if pg is not None:
            abort = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
            if abort is not None:          # NCCL/HCCL: may block until in-flight kernels stop
                t = threading.Thread(target=_quietly, args=(abort,), daemon=True)
                t.start()
                t.join(wait)
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.store = None


def make_group(collective: str, store, rank: int, timeout: float):
    """A two-rank process group of `collective` on `store`, without touching the default group."""
    td = timedelta(seconds=timeout)
    if collective == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, td)
    if collective == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = td
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # the HCCL twin (never run here)
    options = ProcessGroupHCCL.Options()
    options._timeout = td
    return ProcessGroupHCCL(store, rank, 2, options)


def collective_for(device: torch.device) -> str:
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as exc:      # an abort of a broken communicator may itself complain
        log.debug("aborting a KV communicator: %s", exc)


# -- decode side ---------------------------------------------------------------------------------
class DirectKVReceiver(kvtransfer_pb2_grpc.KVDirectServicer):
    """Serves KVDirect: builds pairs on request and receives transfers into device buffers
    that the registry `pending` hands to the decode engine."""

    backend = BACKEND

    def __init__(self, pending: PendingTransfers, device: torch.device, store_host: str = "127.0.0.1",
                 auth: KVPeerAuth | None = None):
        self.pending = pending
        self.device = device
        self.collective = collective_for(device)
        self.store_host = store_host
        self.auth = auth
        self.pairs: dict[str, PairGroup] = {}
        self._joins: dict[str, asyncio.Task] = {}

    def add_to_server(self, server: grpc.aio.Server) -> None:
        kvtransfer_pb2_grpc.add_KVDirectServicer_to_server(self, server)

    async def _check_session(self, context) -> None:
        if self.auth is not None and not self.auth.session_valid(session_of(context.invocation_metadata())):
            await context.abort(Code.UNAUTHENTICATED, "KV direct call without a valid session: handshake with "
                                "the shared KV secret first (a restarted decode worker forgets old sessions)")

    async def Connect(self, request, context):
        await self._check_session(context)
        if request.collective != self.collective:
            await context.abort(Code.FAILED_PRECONDITION, f"this decode worker moves KV with {self.collective} "
                                f"(its device is {self.device}), the prefill worker asked for "
                                f"{request.collective or 'nothing'}: both must run on the same kind of device")
        if not request.pair_id or request.pair_id in self.pairs:
            await context.abort(Code.INVALID_ARGUMENT, f"pair id {request.pair_id!r} is empty or already used")
        self._evict_idle()
        pair = PairGroup(request.pair_id, self.collective, self.device)
        port = pair.host_store(self.store_host)
        self.pairs[pair.pair_id] = pair
        # a wildcard bind address means nothing to the sender: it then uses the host it dialed
        advertised = "" if self.store_host in WILDCARD_HOSTS else self.store_host
        self._joins[pair.pair_id] = asyncio.ensure_future(pair.join(rank=1))
        self._joins[pair.pair_id].add_done_callback(lambda f, p=pair: self._joined(p, f))
        return kvtransfer_pb2.ConnectResponse(store_host=advertised, store_port=port,
                                              collective=self.collective)

    def _joined(self, pair: PairGroup, fut: asyncio.Future) -> None:
        self._joins.pop(pair.pair_id, None)
        if fut.cancelled() or fut.exception() is not None:
            self.pairs.pop(pair.pair_id, None)      # join() closed it already

    def _evict_idle(self) -> None:
        """Close pairs of senders that went away (a restarted prefill worker never says so),
        and the oldest idle ones beyond MAX_PAIRS: each communicator holds device buffers."""
        now = time.monotonic()
        idle = sorted((p for p in self.pairs.values() if not p.busy and p.pair_id not in self._joins),
                      key=lambda p: p.last_used)
        for pair in [p for p in idle if now - p.last_used > PAIR_IDLE_S]:
            self._drop(pair, f"unused for {PAIR_IDLE_S:.0f}s")
            idle.remove(pair)
        while len(self.pairs) >= MAX_PAIRS and idle:
            self._drop(idle.pop(0), "too many KV pairs on this decode worker; the oldest idle one was closed")

    def _drop(self, pair: PairGroup, reason: str, wait: float = 0.0) -> None:
        self.pairs.pop(pair.pair_id, None)
        pair.close(reason, wait)

    async def Transfer(self, request_iterator, context):
        await self._check_session(context)
        try:
            msg = await asyncio.wait_for(anext(aiter(request_iterator)), OPEN_TIMEOUT_S)
        except (TimeoutError, StopAsyncIteration):
            await context.abort(Code.INVALID_ARGUMENT, "a KV direct transfer must open with its descriptor")
        op = msg.open
        try:
            await self._receive(op, context)
        except TransferRejected as exc:      # a transfer it had claimed is failed already; others untouched
            await context.write(Ack(kind=Ack.KIND_REFUSED, reason=str(exc)))
            await context.abort(exc.code, str(exc))

    async def _receive(self, op, context) -> None:
        pair = self.pairs.get(op.pair_id)
        if pair is None or pair.broken:
            why = pair.broken if pair else "unknown pair: Connect first (a restarted decode worker forgets pairs)"
            raise TransferRejected(Code.FAILED_PRECONDITION, f"KV pair {op.pair_id!r}: {why}")
        if pair.busy:
            raise TransferRejected(Code.FAILED_PRECONDITION, f"KV pair {op.pair_id} is already carrying a "
                                   "transfer: one at a time per pair")
        t = self.pending.lookup(op.transfer_id)
        self.pending.claim(t, op.total_bytes)
        pair.busy = True
        posted = None
        try:
            join = self._joins.get(pair.pair_id)
            if join is not None:
                await asyncio.wait_for(asyncio.shield(join), self.pending.time_left(t))
            await self.pending.stage(t, lambda n: torch.empty(n, dtype=torch.uint8, device=self.device))
            self.pending.check_active(t)
            posted = await pair.post_recv(t.buffer)
            await context.write(Ack(kind=Ack.KIND_READY))
            await pair.finish_recv(posted, self.pending.time_left(t))
            posted = None
            self.pending.complete(t, op.first_token, dict(op.extra))
            await context.write(Ack(kind=Ack.KIND_DONE))
        except (TimeoutError, asyncio.TimeoutError) as exc:
            reason = f"KV of transfer {op.transfer_id} did not land before its deadline: {exc or 'stalled'}"
            self.pending.fail(op.transfer_id, reason, Code.DEADLINE_EXCEEDED)
            raise TransferRejected(Code.DEADLINE_EXCEEDED, reason) from None
        except RuntimeError as exc:          # the collective failed (peer gone, aborted)
            self.pending.fail(op.transfer_id, f"KV receive failed: {exc}", Code.UNAVAILABLE)
            raise TransferRejected(Code.UNAVAILABLE, f"KV receive of {op.transfer_id} failed: {exc}") from None
        except TransferRejected as exc:      # ended meanwhile (deadline, cancel) or no room to stage
            self.pending.fail(op.transfer_id, str(exc), exc.code)
            raise
        finally:                             # cancelled (the sender went away), or any failure above
            if self.pending.fail(op.transfer_id, "the prefill worker's stream ended before the KV landed",
                                 Code.CANCELLED) or posted is not None:
                self._drop(pair, f"a receive of transfer {op.transfer_id} was left unmatched")
            pair.busy = False

    def close_pairs(self, wait: float = 5.0) -> None:
        """Abort every pair's communicator (at shutdown: each abort gets `wait` seconds)."""
        for pair in list(self.pairs.values()):
            self._drop(pair, "decode worker stopping", wait)

    async def close(self) -> None:
        self.close_pairs()


# -- prefill side --------------------------------------------------------------------------------
class DirectKVSender(KVSender):
    """Prefill side, one per decode worker: the KVTransfer handshake (layout, secret), then
    transfers over this pair's communicator; payload providers must yield device tensors."""

    backend = BACKEND

    def __init__(self, channel: grpc.aio.Channel, address: str, device: torch.device,
                 auth: KVPeerAuth | None = None):
        self.address = address
        self.channel = channel
        self.device = device
        self.collective = collective_for(device)
        self.stub = kvtransfer_pb2_grpc.KVDirectStub(channel)
        self._handshaker = GrpcKVSender(channel, auth=auth)
        self.peer_layout: KVLayout | None = None
        self._layout: KVLayout | None = None
        self.pair: PairGroup | None = None
        self._lock = asyncio.Lock()
        self._metadata: tuple[tuple[str, str], ...] = ()
        self.stall_s = float(os.environ.get(STALL_ENV) or 0)
        if self.stall_s:
            log.warning("%s=%g: every device-direct KV transfer will stall (fault injection)", STALL_ENV,
                        self.stall_s)

    async def handshake(self, layout: KVLayout, timeout: float = 10.0) -> KVLayout:
        self._layout = layout
        peer = await self._handshaker.handshake(layout, timeout)
        if BACKEND not in peer.backends:
            raise KVTransferError(f"the decode worker at {self.address} does not take device-direct KV "
                                  f"(it speaks {peer.backends}); start both with --kv-backend direct",
                                  Code.FAILED_PRECONDITION)
        self._metadata = self._handshaker.session_metadata
        self.peer_layout = peer
        return peer

    async def _connect(self, timeout: float) -> PairGroup:
        pair = PairGroup(uuid.uuid4().hex, self.collective, self.device)
        reply = await self.stub.Connect(kvtransfer_pb2.ConnectRequest(pair_id=pair.pair_id,
                                                                      collective=self.collective),
                                        timeout=timeout, metadata=self._metadata)
        host = reply.store_host or self.address.rsplit(":", 1)[0]
        await pair.join(rank=0, host=host, port=reply.store_port, timeout=min(timeout, JOIN_TIMEOUT_S))
        return pair

    async def send(self, transfer: TransferDescriptor | str, payload_provider, first_token: int,
                   extra: dict[str, str] | None = None, timeout: float = 30.0) -> SendStats:
        transfer = TransferDescriptor.of(transfer)
        if self.peer_layout is None:
            raise KVTransferError(f"handshake with {self.address} before sending KV", Code.FAILED_PRECONDITION)
        if transfer.nbytes < 0:
            raise KVTransferError("the direct backend needs the payload size in the descriptor",
                                  Code.INVALID_ARGUMENT)
        started = time.perf_counter()
        tid = transfer.transfer_id
        try:
            async with asyncio.timeout(timeout):
                async with self._lock:                 # one transfer at a time on this pair
                    try:
                        await self._connect_and_transfer(transfer, payload_provider, first_token, extra or {},
                                                         started, timeout)
                    except _RefusedBeforeReady as refused:
                        # the peer forgot our pair (restart, idle eviction) or our session: nothing of
                        # the transfer was touched, so once more with a fresh pair (and handshake)
                        self._break(str(refused.error))
                        if refused.error.code == Code.UNAUTHENTICATED:
                            await self.handshake(self._layout, timeout=min(timeout, 10.0))
                        try:
                            await self._connect_and_transfer(transfer, payload_provider, first_token, extra or {},
                                                             started, timeout)
                        except _RefusedBeforeReady as again:
                            raise again.error from None
        except TimeoutError:
            self._break(f"transfer {tid} timed out")
            raise KVTransferError(f"KV transfer {tid} to {self.address} did not finish within {timeout:g}s",
                                  Code.DEADLINE_EXCEEDED) from None
        except grpc.aio.AioRpcError as exc:
            self._break(f"transfer {tid} failed")
            raise KVTransferError(f"KV transfer {tid} to {self.address} failed: {exc.details()}",
                                  exc.code()) from exc
        except RuntimeError as exc:                    # the collective itself failed
            self._break(str(exc))
            raise KVTransferError(f"KV transfer {tid} to {self.address} failed on {self.collective}: {exc}",
                                  Code.UNAVAILABLE) from exc
        return SendStats(nbytes=transfer.nbytes, chunks=1, seconds=time.perf_counter() - started)

    async def _connect_and_transfer(self, transfer, provider, first_token, extra, started, timeout) -> None:
        if self.pair is None or self.pair.broken:
            self.pair = await self._connect(timeout)
        await self._transfer(transfer, provider, first_token, extra, started, timeout)

    async def _transfer(self, transfer: TransferDescriptor, provider, first_token: int, extra: dict,
                        started: float, timeout: float) -> None:
        call = self.stub.Transfer(timeout=timeout, metadata=self._metadata)
        try:
            await call.write(kvtransfer_pb2.DirectMessage(open=kvtransfer_pb2.DirectOpen(
                transfer_id=transfer.transfer_id, pair_id=self.pair.pair_id, total_bytes=transfer.nbytes,
                first_token=first_token, num_tokens=transfer.num_tokens,
                extra={k: str(v) for k, v in extra.items()})))
            try:
                ack = await call.read()
            except grpc.aio.AioRpcError as exc:
                ack, error = grpc.aio.EOF, KVTransferError(exc.details() or exc.code().name, exc.code())
            else:
                error = None
            if ack is grpc.aio.EOF or ack.kind != Ack.KIND_READY:
                error = error or await _why(call, ack)
                if error.code in (Code.FAILED_PRECONDITION, Code.UNAUTHENTICATED):
                    raise _RefusedBeforeReady(error)
                raise error
            # the send runs while we listen: a receiver that gives up (its deadline) ends it
            sending = asyncio.ensure_future(self._send_payload(transfer, provider, started, timeout))
            answer = asyncio.ensure_future(call.read())
            try:
                await asyncio.wait({sending, answer}, return_when=asyncio.FIRST_COMPLETED)
                if answer.done() and not sending.done():
                    ack = answer.result()
                    if ack is grpc.aio.EOF or ack.kind != Ack.KIND_DONE:
                        self._break(f"the receiver ended transfer {transfer.transfer_id} before the bytes went")
                        raise await _why(call, ack)
                await sending                           # the send's own failure, if any
                ack = await answer
            finally:
                for task in (sending, answer):
                    task.cancel()
            if ack is grpc.aio.EOF or ack.kind != Ack.KIND_DONE:
                raise await _why(call, ack)
            await call.done_writing()
        finally:
            if not call.done():
                call.cancel()

    async def _send_payload(self, transfer: TransferDescriptor, provider, started: float, timeout: float) -> None:
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        payload = await resolve_payload(provider)
        if not isinstance(payload, torch.Tensor | HeldBlocks):
            self._break("bad payload")
            raise KVTransferError(f"the direct backend sends HeldBlocks or a uint8 tensor on {self.device}, "
                                  f"got {type(payload).__name__}", Code.INTERNAL)
        try:
            await self.pair.send(payload, transfer.nbytes, timeout - (time.perf_counter() - started))
        except ValueError as exc:               # the payload broke its descriptor's promise
            self._break("payload mismatch")
            raise KVTransferError(str(exc), Code.INVALID_ARGUMENT) from None

    def _break(self, reason: str, wait: float = 0.0) -> None:
        if self.pair is not None:
            self.pair.close(reason, wait)
            self.pair = None

    def close_pair(self, wait: float = 5.0) -> None:
        self._break("sender closed", wait)

    async def close(self) -> None:
        self.close_pair()


class _RefusedBeforeReady(Exception):
    """The receiver refused a transfer before posting its receive: the pair or the session is
    unknown to it, or the transfer's state forbids it; nothing was sent."""

    def __init__(self, error: KVTransferError):
        super().__init__(str(error))
        self.error = error


async def _why(call, ack) -> KVTransferError:
    if ack is not grpc.aio.EOF and ack.kind == Ack.KIND_REFUSED:
        code = await call.code()
        return KVTransferError(ack.reason, code if code is not None and code != Code.OK else Code.ABORTED)
    code = await call.code()
    return KVTransferError(await call.details() or f"the receiver ended the transfer ({code.name})", code)


__all__ = ["BACKEND", "DirectKVReceiver", "DirectKVSender", "HeldBlocks", "PairGroup", "collective_for"]
