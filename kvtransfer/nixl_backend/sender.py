"""The prefill side of the nixl backend: the shared handshake, then one control stream per
transfer. `open` offers to write pages and learns where the KV goes: the decode worker's KV
cache and the transfer's reserved block ids (in place), or a buffer it staged for the transfer;
with its agent metadata. Each piece is one NIXL WRITE posted as the piece is final: one region
per row and run of consecutive block ids straight into the cache's pages, or 2 x layers
regions into the staged buffer. After the last piece's writes complete, a NIXL notification
carries the first token, and the decode worker's DONE ends the transfer.
"""
from __future__ import annotations

import asyncio
import collections
import json
import time

import grpc
import numpy as np
import torch

from baton.engine.kv_handoff import KVPiece
from baton.kvtransfer.backend import (
    KVSender,
    KVTransferError,
    OutgoingTransfer,
    SendStats,
    TransferDescriptor,
)
from baton.kvtransfer.handshake import handshake
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.nixl_backend import wire
from baton.kvtransfer.nixl_backend.agent import mem_type, page_descs, piece_descs, sending_agent
from baton.kvtransfer.peer_auth import KVPeerAuth

Code = grpc.StatusCode
BACKEND = "nixl"
POLL_S = 0.00005               # write completion polling, after a first look at once; the wait doubles
POLL_MAX_S = 0.001             # up to this (a piece's bytes take ~0.1 ms a GB over CUDA IPC) after
CLOSE_POLL_S = 0.002           # looking every POLL_S for this long
DRAIN_S = 30.0                 # an abandoned transfer's writes get this long to finish before their memory goes
FORGET_AFTER_LOADS = 256       # the peer's stale registrations are dropped (when idle) after this many loads
# per decode worker's agent, over every sender of this process (they share one agent): its
# metadata loads since its registrations were last forgotten, and its transfers open now
_LOADS: collections.Counter = collections.Counter()
_OPEN: collections.Counter = collections.Counter()
_KNOWN: dict[str, str] = {}    # metadata of a peer's registered KV cache (base64) -> the peer, while loaded


class _Registrations:
    """The process agent's registrations of pieces' memory, one per region however many writes
    use it at once: NIXL keeps one entry per registered region, so registering a region a second
    time and deregistering it once would pull it from under a write still using it (a crash in a
    later post, seen with one payload sent through eight transfers at once)."""

    def __init__(self):
        self._held: dict[tuple[int, int, str], list] = {}     # (address, bytes, device) -> [registration, users]

    def acquire(self, agent, data: torch.Tensor):
        key = (data.data_ptr(), data.numel() * data.element_size(), str(data.device))
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = [agent.register_memory(data), 0]
        held[1] += 1
        return key

    def release(self, agent, key) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del self._held[key]
            agent.deregister_memory(held[0])


_REGISTERED = _Registrations()


class NixlKVSender(KVSender):
    """Prefill side, one per decode worker; this process's one NIXL agent does the writes."""

    backend = BACKEND

    def __init__(self, channel: grpc.aio.Channel, address: str, auth: KVPeerAuth | None = None, platform=None):
        self.channel = channel
        self.address = address
        self.auth = auth
        self.platform = platform
        self.agent = sending_agent()
        self._call = channel.stream_stream(wire.TRANSFER_METHOD, request_serializer=wire.encode,
                                           response_deserializer=wire.decode)
        self.peer_layout: KVLayout | None = None
        self._layout: KVLayout | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()
        self.block_bytes = 0
        self.rows = 0

    async def handshake(self, layout: KVLayout, timeout: float = 10.0) -> KVLayout:
        done = await handshake(self.channel, self.address, layout, self.auth, timeout, backend=BACKEND)
        self._layout, self._metadata, self.peer_layout = layout, done.metadata, done.peer
        self.block_bytes, self.rows = layout.block_nbytes, 2 * layout.num_layers
        return done.peer

    async def warm(self, timeout: float = 10.0) -> None:
        """Load the decode worker's agent metadata (its registered KV cache) and have NIXL connect to
        it now, so the first transfer's READY names a peer already loaded and connected. A decode
        worker that stages (no registered cache) sends none: each of its transfers loads its own."""
        if self.peer_layout is None:
            raise KVTransferError(f"handshake with {self.address} before warming NIXL", Code.FAILED_PRECONDITION)
        call = self._call(timeout=timeout, metadata=self._metadata)
        try:
            async with asyncio.timeout(timeout):
                await call.write({"warm": self.agent.name})
                reply = await call.read()
        except TimeoutError:
            call.cancel()
            raise KVTransferError(f"NIXL warm-up with {self.address} took over {timeout:g}s",
                                  Code.DEADLINE_EXCEEDED) from None
        except grpc.aio.AioRpcError as exc:
            raise KVTransferError(f"NIXL warm-up with {self.address}: {exc.details()}", exc.code()) from exc
        if reply is grpc.aio.EOF or not isinstance(reply.get("md"), str):
            raise await _ended(call, reply, "warm-up")
        if reply["md"]:
            peer = _KNOWN.get(reply["md"]) or self._load(reply["md"], keep=True)
            try:
                self.agent.make_connection(peer)
            except Exception as exc:
                raise KVTransferError(f"NIXL could not connect to the decode worker at {self.address}: {exc}",
                                      Code.UNAVAILABLE) from exc

    async def open(self, transfer: TransferDescriptor | str, timeout: float = 30.0) -> NixlOutgoing:
        """Open a transfer (before its KV exists); returns once the decode worker staged it."""
        transfer = TransferDescriptor.of(transfer)
        if self.peer_layout is None:
            raise KVTransferError(f"handshake with {self.address} before sending KV", Code.FAILED_PRECONDITION)
        if transfer.nbytes <= 0 or transfer.nbytes % self.block_bytes:
            raise KVTransferError(f"the nixl backend needs the payload size in the descriptor, in whole "
                                  f"{self.block_bytes}-byte blocks (got {transfer.nbytes})", Code.INVALID_ARGUMENT)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            return await self._open(transfer, deadline)
        except KVTransferError as exc:          # a restarted decode worker forgot our session: once more
            if exc.code != Code.UNAUTHENTICATED or self.auth is None:
                raise
        await self.handshake(self._layout, timeout=min(timeout, 10.0))
        return await self._open(transfer, deadline)

    async def _open(self, transfer: TransferDescriptor, deadline: float) -> NixlOutgoing:
        loop = asyncio.get_running_loop()
        wire.trace("S open start", transfer.transfer_id)
        call = self._call(timeout=max(0.0, deadline - loop.time()), metadata=self._metadata)
        try:
            async with asyncio.timeout_at(deadline):
                await call.write({"open": transfer.transfer_id, "nbytes": transfer.nbytes, "agent": self.agent.name,
                                  "pages": True})
                reply = await call.read()
                wire.trace("S ready read", transfer.transfer_id)
                if reply is grpc.aio.EOF or "ready" not in reply:
                    raise await _ended(call, reply, transfer.transfer_id)
                ready = reply["ready"]
                if not _ready_ok(ready, transfer.nbytes // self.block_bytes):
                    raise KVTransferError(f"the decode worker at {self.address} answered the open of "
                                          f"{transfer.transfer_id} with a garbled READY", Code.INTERNAL)
                peer = _KNOWN.get(ready["md"]) if "pages" in ready else None
                peer = peer or self._load(ready["md"], keep="pages" in ready)
        except TimeoutError:
            call.cancel()
            raise KVTransferError(f"KV transfer {transfer.transfer_id} to {self.address} could not open in time",
                                  Code.DEADLINE_EXCEEDED) from None
        except grpc.aio.AioRpcError as exc:
            raise KVTransferError(f"KV transfer {transfer.transfer_id} to {self.address}: {exc.details()}",
                                  exc.code()) from exc
        except BaseException:
            call.cancel()
            raise
        _OPEN[peer] += 1
        return NixlOutgoing(self, call, transfer, peer, ready, deadline)

    def _load(self, md: str, keep: bool) -> str:
        """Load the peer's agent metadata (its new registration; `keep`: its KV cache's, remembered
        while loaded); now and then, with none of its transfers open, forget its registrations
        first, so stale staged ones do not pile up."""
        metadata = wire.unb64(md)
        try:
            peer = self.agent.add_remote_agent(metadata)
            peer = peer.decode() if isinstance(peer, bytes) else peer
            if _LOADS[peer] >= FORGET_AFTER_LOADS and not _OPEN[peer]:
                self.agent.remove_remote_agent(peer)
                for known in [k for k, p in _KNOWN.items() if p == peer]:
                    del _KNOWN[known]
                _LOADS[peer] = 0
                self.agent.add_remote_agent(metadata)
            if keep:
                _KNOWN[md] = peer
        except Exception as exc:
            raise KVTransferError(f"NIXL could not load the metadata of the decode worker at {self.address}: {exc}",
                                  Code.UNAVAILABLE) from exc
        _LOADS[peer] += 1
        return peer


class NixlOutgoing(OutgoingTransfer):
    """A transfer whose buffer the decode worker staged: pieces become NIXL writes as they come."""

    def __init__(self, sender: NixlKVSender, call, transfer: TransferDescriptor, peer: str, ready: dict,
                 deadline: float):
        self.sender = sender
        self.agent = sender.agent
        self.call = call
        self.transfer = transfer
        self.peer = peer
        self.dst = (int(ready["addr"]), int(ready["dev"]), str(ready["mem"]))
        self.pages = ready.get("pages")                                # in place: the reserved block ids
        self.stride = ready.get("stride", 0)                           # ... of a cache of this many blocks
        self.deadline = deadline
        self.num_blocks = transfer.nbytes // sender.block_bytes
        self.next_block = 0
        self.token_sent = False
        self.ended = False
        self.pieces = 0
        self.writes: list[tuple[object, tuple, torch.Tensor]] = []    # (xfer handle, registration's key, piece)
        self.finishing: asyncio.Future | None = None
        self.reply = asyncio.ensure_future(call.read())                # DONE, or why the receiver ended it
        self.reply.add_done_callback(_retrieve)
        self.opened = time.perf_counter()

    async def piece(self, piece: KVPiece) -> None:
        tid = self.transfer.transfer_id
        if self.ended:
            raise KVTransferError(f"transfer {tid} has ended", Code.FAILED_PRECONDITION)
        if self.reply.done():                                          # refused (or the stream broke) early
            self.abandon("the decode worker ended it")
            raise await _ended(self.call, _result(self.reply), tid)
        if piece.first_block != self.next_block or self.token_sent:
            self.abandon("pieces out of order")
            raise KVTransferError(f"transfer {tid}: a piece from block {piece.first_block} where block "
                                  f"{self.next_block} was due", Code.INVALID_ARGUMENT)
        data, end = _as_tensor(piece.data), piece.first_block + piece.num_blocks
        nbytes = piece.num_blocks * self.sender.block_bytes
        if data is None or data.numel() != nbytes or piece.num_blocks < 1 or end > self.num_blocks \
                or (piece.last and end != self.num_blocks):
            self.abandon("payload mismatch")
            raise KVTransferError(f"a piece of {piece.num_blocks} blocks must be {nbytes} contiguous uint8 bytes, "
                                  f"got {_describe(piece.data)}; the descriptor promised {self.num_blocks} blocks, "
                                  f"{self.next_block} sent{'; this last one ends early' if piece.last else ''}",
                                  Code.INVALID_ARGUMENT)
        if piece.ready is not None:                                    # final on its device first
            await asyncio.get_running_loop().run_in_executor(None, piece.ready.synchronize)
        try:
            wire.trace("S write start", tid)
            self._write(data, piece.first_block, piece.num_blocks)
            wire.trace("S write posted", tid)
        except KVTransferError:
            self.abandon("a NIXL write failed")
            raise
        self.next_block, self.pieces = end, self.pieces + 1
        await self._hint({"writing": nbytes})           # (before "written": one write on the stream at a time)
        if piece.last:
            self.token_sent = True
            note = {"tid": tid, "first_token": piece.first_token, "blocks": self.num_blocks,
                    "extra": {str(k): str(v) for k, v in piece.meta.items()}}
            self.finishing = asyncio.ensure_future(self._notify_when_written(json.dumps(note).encode()))
            self.finishing.add_done_callback(_retrieve)

    def _write(self, data: torch.Tensor, first_block: int, num_blocks: int) -> None:
        """Post one WRITE of the piece's rows into their places in the peer's buffer."""
        reg = None
        try:
            reg = _REGISTERED.acquire(self.agent, data)
            if self.pages is not None:
                local, remote = page_descs(data, self.dst[0], self.dst[1], self.sender.rows, self.stride,
                                           self.pages, first_block, num_blocks)
            else:
                local, remote = piece_descs(data, self.dst[0], self.dst[1], self.sender.rows, self.num_blocks,
                                            first_block, num_blocks)
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, mem_type(data)),
                                                self.agent.get_xfer_descs(remote, self.dst[2]), self.peer)
            state = self.agent.transfer(handle)
        except Exception as exc:
            if reg is not None:
                _REGISTERED.release(self.agent, reg)
            raise KVTransferError(f"NIXL write to {self.sender.address} failed: {exc}", Code.UNAVAILABLE) from exc
        self.writes.append((handle, reg, data))
        if state == "ERR":
            raise KVTransferError(f"NIXL write to {self.sender.address} failed at posting", Code.UNAVAILABLE)

    async def _notify_when_written(self, note: bytes) -> None:
        """Once every write completed (the bytes are in the peer's memory), say so with the token,
        and hint the decode side over the stream that the notification is on its way."""
        wait, close_until = POLL_S, time.monotonic() + CLOSE_POLL_S
        while (states := [self.agent.check_xfer_state(h) for h, _, _ in self.writes]).count("DONE") < len(states):
            if "ERR" in states:
                raise KVTransferError(f"a NIXL write to {self.sender.address} failed", Code.UNAVAILABLE)
            await asyncio.sleep(wait)
            if time.monotonic() > close_until:     # most writes finish within it: no backoff overshoot there
                wait = min(2 * wait, POLL_MAX_S)
        wire.trace("S writes done", self.transfer.transfer_id)
        self._release_writes()
        self.agent.send_notif(self.peer, note)
        wire.trace("S notif sent", self.transfer.transfer_id)
        await self._hint({"written": True})

    async def _hint(self, msg: dict) -> None:
        """Tell the decode side to poll closely now ("writing": a piece's writes are posted, and
        UCX may need its progress to complete them; "written": the notification is out)."""
        try:
            await self.call.write(msg)
        except Exception:       # the decode side already polled the notification and closed the stream:
            pass                # its DONE (or the stream's status) decides, in done()

    async def done(self) -> SendStats:
        tid = self.transfer.transfer_id
        if not self.token_sent:
            self.abandon("done before the last piece")
            raise KVTransferError(f"transfer {tid} has not sent its last piece", Code.FAILED_PRECONDITION)
        try:
            async with asyncio.timeout_at(self.deadline):
                await self.finishing
                reply = await self.reply
        except TimeoutError:
            self.abandon("out of time")
            raise KVTransferError(f"KV transfer {tid} to {self.sender.address} did not land in time",
                                  Code.DEADLINE_EXCEEDED) from None
        except KVTransferError:
            self.abandon("a write failed")
            raise
        except grpc.aio.AioRpcError as exc:
            self.abandon("the stream broke")
            raise KVTransferError(f"KV transfer {tid} to {self.sender.address}: {exc.details()}", exc.code()) from exc
        wire.trace("S done read", tid)
        if reply is grpc.aio.EOF or "done" not in reply:
            self.abandon("refused")
            raise await _ended(self.call, reply, tid)
        self._end()
        return SendStats(nbytes=self.transfer.nbytes, chunks=self.pieces, seconds=time.perf_counter() - self.opened)

    def abandon(self, reason: str) -> None:
        """Give the transfer up: the decode worker fails it (and frees its blocks) as the stream ends."""
        if self.ended:
            return
        self._end()
        if self.finishing is not None:
            self.finishing.cancel()
        quiet = not self._in_flight()                  # the decode worker may reuse what we wrote into at once
        asyncio.ensure_future(self._say_abandon(reason, quiet))
        if self.writes:
            asyncio.ensure_future(self._drain())

    def _in_flight(self) -> bool:
        try:
            return any(self.agent.check_xfer_state(h) == "PROC" for h, _, _ in self.writes)
        except Exception:
            return True

    async def _say_abandon(self, reason: str, quiet: bool) -> None:
        try:
            await asyncio.wait_for(self.call.write({"abandon": reason, "quiet": quiet}), 1.0)
            await asyncio.wait_for(self.call.done_writing(), 1.0)
        except Exception:
            pass
        finally:
            self.call.cancel()

    async def _drain(self) -> None:
        """Posted writes keep their memory until they finish (or DRAIN_S passed)."""
        until = time.monotonic() + DRAIN_S
        while time.monotonic() < until and any(self.agent.check_xfer_state(h) == "PROC" for h, _, _ in self.writes):
            await asyncio.sleep(0.01)
        self._release_writes()

    def _release_writes(self) -> None:
        writes, self.writes = self.writes, []
        for handle, reg, _ in writes:
            try:
                handle.release()
                _REGISTERED.release(self.agent, reg)
            except Exception:           # a write still in flight after DRAIN_S: its memory is leaked, not reused
                pass

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            _OPEN[self.peer] -= 1
            self.reply.cancel()


def _ready_ok(ready, num_blocks: int) -> bool:
    """A READY we can act on: where to write, and, in place, one block id per block of ours."""
    if not isinstance(ready, dict) or not {"md", "addr", "dev", "mem"} <= set(ready):
        return False
    if "pages" not in ready:
        return True
    pages, stride = ready["pages"], ready.get("stride")
    return (isinstance(pages, list) and len(pages) == num_blocks and isinstance(stride, int)
            and all(isinstance(b, int) and 0 <= b < stride for b in pages))


async def _ended(call, reply, tid: str) -> KVTransferError:
    """Why the decode worker ended a transfer: its REFUSED reason and the stream's status."""
    reason = reply.get("refused") if isinstance(reply, dict) else None
    try:
        code, details = await asyncio.wait_for(call.code(), 2.0), await call.details()
    except Exception:
        code, details = Code.UNAVAILABLE, ""
    if code == Code.OK:
        code = Code.INTERNAL
    return KVTransferError(f"the decode worker ended KV transfer {tid}: {reason or details or code.name}", code)


def _as_tensor(data) -> torch.Tensor | None:
    """The piece as a contiguous uint8 tensor (host bytes are viewed, not copied)."""
    if isinstance(data, torch.Tensor):
        return data if data.dtype == torch.uint8 and data.is_contiguous() else None
    try:
        return torch.from_numpy(np.frombuffer(data, np.uint8))
    except (TypeError, ValueError):
        return None


def _describe(data) -> str:
    if isinstance(data, torch.Tensor):
        return f"{data.numel()} {data.dtype} on {data.device}{'' if data.is_contiguous() else ' (not contiguous)'}"
    return f"a {type(data).__name__}"


def _result(fut: asyncio.Future):
    return fut.result() if not fut.cancelled() and fut.exception() is None else None


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
