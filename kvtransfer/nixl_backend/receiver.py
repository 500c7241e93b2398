"""The decode side of the nixl backend: the `baton.v1.KVNixl` service. Each transfer's stream
claims it in `PendingTransfers` and tells the prefill worker where to write; the prefill
worker's NIXL writes land there, and its notification completes the transfer.

Where the KV goes, decided per transfer:
  - in place (the normal case): the worker's whole paged KV cache (host memory on the CPU,
    VRAM on a GPU) is registered with this worker's NIXL agent once, at start; READY names the
    transfer's reserved block ids, and the sender writes each piece's blocks straight into them
    (agent.page_descs). The transfer completes with an InPlace payload: the engine's join copies nothing.
  - staged (the fallback): a buffer registered per transfer, then copied into the blocks at the
    join, as the grpc backend's. Used when this worker was given no KV cache (or NIXL could not
    register it: a memory type it does not take, e.g. an NPU's), when admission named no
    blocks, or when the sender does not offer to write pages (an older sender).

A transfer that ends any other way (refused, abandoned, the stream broken, the deadline) is
failed once, through the registry. A write the sender posted may still land (UCX's shared
memory and CMA paths write by address, registration or not), so nothing it could write into is
reused at once: in place, the registry holds the blocks (the engine keeps them out of its pool)
for `quarantine_s`; staged, the buffer stays registered as long. Both end at once when the
sender's abandon says it has no write in flight ("quiet").
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass

import grpc
import torch

from baton.kvtransfer.backend import KVReceiver
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.nixl_backend import wire
from baton.kvtransfer.nixl_backend.agent import device_id, mem_type, new_agent
from baton.kvtransfer.peer_auth import KVPeerAuth, session_of
from baton.kvtransfer.receiver import PendingTransfers, Transfer, TransferRejected

log = logging.getLogger("baton.kvtransfer")
Code = grpc.StatusCode
OPEN_TIMEOUT_S = 10.0            # a stream must say which transfer it carries by then
POLL_S = 0.0005                  # polling (notifications, and UCX's progress, which a write's completion
POLL_MAX_S = 0.004               # may need on this side) only while transfers are open; the wait doubles
                                 # while nothing comes, up to this (the engine thread wants the GIL too) ...
CLOSE_POLL_S = 0.0001            # ... except while the sender says its writes are under way: this often
WRITES_GB_S = 2.0                # for the piece's bytes at this rate (at least CLOSE_MIN_S); after "written",
CLOSE_MIN_S = 0.002              # until the notification lands (EAGER_POLL_S at most)
EAGER_POLL_S = 2.0
QUARANTINE_S = 30.0              # how long what a transfer that ended early could be written into stays untouched


@dataclass(frozen=True, slots=True)
class RegisteredCache:
    """The decode worker's paged KV cache, registered with its NIXL agent for writes in place."""

    kv: torch.Tensor                                 # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    reg: object                                      # its NIXL registration
    md: str                                          # the agent metadata naming it, base64, for READY


class _Incoming:
    """One transfer being written into this worker's staged buffer."""

    def __init__(self, t: Transfer, sender_agent: str, blocks: int):
        self.t = t
        self.sender_agent = sender_agent
        self.blocks = blocks
        self.reg = None                              # NIXL registration of t.buffer (staged)
        self.pages: tuple[int, ...] = ()             # the reserved blocks it writes into (in place)
        self.quiet = False                           # the sender said no write of it is in flight
        self.landed: asyncio.Future = asyncio.get_running_loop().create_future()   # the notification


class NixlKVReceiver(KVReceiver):
    backend = "nixl"

    def __init__(self, pending: PendingTransfers, layout: KVLayout, device: torch.device,
                 auth: KVPeerAuth | None = None, kv_cache: torch.Tensor | None = None,
                 quarantine_s: float = QUARANTINE_S):
        self.pending = pending
        self.layout = layout
        self.device = torch.device(device)
        self.auth = auth
        self.quarantine_s = quarantine_s
        self.agent = new_agent("decode")
        self.incoming: dict[str, _Incoming] = {}    # transfer id -> ...
        self.quarantine: list[tuple[float, object, torch.Tensor]] = []
        self._poller: asyncio.Task | None = None
        self._hurry = asyncio.Event()                # a hint came: poll now, not after the wait
        self._close_until = 0.0                      # poll every CLOSE_POLL_S until then
        self.cache = self._register_cache(kv_cache) if kv_cache is not None else None

    def _register_cache(self, kv: torch.Tensor) -> RegisteredCache | None:
        """The paged KV cache, registered once for writes in place; None (staging) where it cannot be."""
        lay = self.layout
        expected = (lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
        if kv.dim() != 6 or (*kv.shape[:2], *kv.shape[3:]) != expected or not kv.is_contiguous():
            log.warning("nixl: the KV cache %s is not the layout's %s: transfers are staged", tuple(kv.shape), expected)
            return None
        try:
            reg = self.agent.register_memory(kv)
            md = wire.b64(self.agent.get_partial_agent_metadata(reg, inc_conn_info=True))
        except Exception as exc:
            log.warning("nixl: could not register the %s KV cache (%s): transfers are staged", kv.device, exc)
            return None
        print(f"[baton] nixl: KV lands in place, in the {kv.nbytes >> 20} MiB KV cache registered in "
              f"{mem_type(kv)} ({kv.device})", file=sys.stderr, flush=True)
        return RegisteredCache(kv, reg, md)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        handler = grpc.stream_stream_rpc_method_handler(self.Transfer, request_deserializer=wire.decode,
                                                        response_serializer=wire.encode)
        handlers = {"Transfer": handler}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
        server.add_registered_method_handlers(wire.SERVICE, handlers)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for tid in list(self.incoming):
            self.pending.fail(tid, "the decode worker's KV receiver closed", Code.UNAVAILABLE)
        self._release_quarantine(force=True)
        if self.cache is not None:
            self.agent.deregister_memory(self.cache.reg)
            self.cache = None

    # -- one stream, one transfer ----------------------------------------------------------------
    async def Transfer(self, request_iterator, context):   # noqa: N802 - the RPC's name
        if self.auth is not None and not self.auth.session_valid(session_of(context.invocation_metadata())):
            await context.abort(Code.UNAUTHENTICATED, "KV transfer without a valid session: handshake with the "
                                "shared KV secret first (a restarted decode worker forgets old sessions)")
        inc = None
        try:
            first = await self._first(context)
            if "warm" in first:              # a sender connecting ahead of its first transfer
                await context.write({"md": self.cache.md if self.cache is not None else ""})
                return
            inc = await self._open(first)
            wire.trace("R opened", inc.t.transfer_id)
            await context.write({"ready": self._where(inc)})
            wire.trace("R ready written", inc.t.transfer_id)
            await self._until_landed(inc, context)
            await context.write({"done": True})
            wire.trace("R done written", inc.t.transfer_id)
        except TransferRejected as exc:
            if inc is not None:
                self.pending.fail(inc.t.transfer_id, str(exc), exc.code)
            with contextlib.suppress(Exception):
                await context.write({"refused": str(exc), "code": exc.code.value[0]})
            await context.abort(exc.code, str(exc))
        finally:      # cancelled (the sender gave up or died), or any other way out
            if inc is not None:
                self._end(inc, "the prefill worker's stream ended before the transfer completed")

    async def _first(self, context) -> dict:
        try:
            msg = await asyncio.wait_for(context.read(), OPEN_TIMEOUT_S)
        except TimeoutError:
            raise TransferRejected(Code.DEADLINE_EXCEEDED, f"no open message within {OPEN_TIMEOUT_S:g}s") from None
        if msg is grpc.aio.EOF or not {"open", "warm"} & set(msg):
            raise TransferRejected(Code.INVALID_ARGUMENT, "a KVNixl stream must start with an open message")
        return msg

    async def _open(self, msg: dict) -> _Incoming:
        t = self.pending.lookup(str(msg["open"]))
        nbytes, agent = msg.get("nbytes"), msg.get("agent")
        if not isinstance(nbytes, int) or not isinstance(agent, str) or not agent:
            self.pending.fail(t.transfer_id, "its open message lacked nbytes or agent", Code.INVALID_ARGUMENT)
            raise TransferRejected(Code.INVALID_ARGUMENT, f"the open of {t.transfer_id} must state nbytes and agent")
        self.pending.claim(t, nbytes)                      # size checked; one stream per transfer
        inc = _Incoming(t, agent, nbytes // self.layout.block_nbytes)
        self.incoming[t.transfer_id] = inc
        if msg.get("pages") is True and self._can_write_in_place(t, inc.blocks):
            inc.pages = self.pending.write_in_place(t, self.quarantine_s)
            self._ensure_polling()
            return inc
        await self.pending.stage(t, allocate=self._allocate)
        try:
            inc.reg = self.agent.register_memory(t.buffer)
        except Exception as exc:
            raise TransferRejected(Code.UNAVAILABLE, f"NIXL could not register the {nbytes}-byte buffer of "
                                   f"{t.transfer_id}: {exc}") from exc
        self._ensure_polling()
        return inc

    def _allocate(self, nbytes: int) -> torch.Tensor:
        self._release_quarantine()
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    def _can_write_in_place(self, t: Transfer, blocks: int) -> bool:
        if self.cache is None or not t.pages:
            return False
        n = self.cache.kv.shape[2]
        if len(t.pages) != blocks or len(set(t.pages)) != blocks or not all(0 <= b < n for b in t.pages):
            log.warning("nixl: transfer %s reserved blocks that do not fit its %d-block payload in a %d-block "
                        "cache: staged", t.transfer_id, blocks, n)
            return False
        return True

    def _where(self, inc: _Incoming) -> dict:
        if inc.pages:
            kv = self.cache.kv
            return {"md": self.cache.md, "addr": kv.data_ptr(), "dev": device_id(kv), "mem": mem_type(kv),
                    "pages": list(inc.pages), "stride": kv.shape[2]}
        buf = inc.t.buffer
        md = self.agent.get_partial_agent_metadata(inc.reg, inc_conn_info=True)
        return {"md": wire.b64(md), "addr": buf.data_ptr(), "dev": device_id(buf), "mem": mem_type(buf)}

    async def _until_landed(self, inc: _Incoming, context) -> None:
        """Until the notification completes the transfer; the stream may only hint that it was
        sent ("written": then poll for it closely) or abandon meanwhile."""
        reader = asyncio.ensure_future(context.read())
        try:
            while True:
                left = self.pending.time_left(inc.t)
                done, _ = await asyncio.wait({reader, inc.landed}, timeout=max(0.0, left),
                                             return_when=asyncio.FIRST_COMPLETED)
                if inc.landed in done:
                    wire.trace("R landed seen", inc.t.transfer_id)
                    self._land(inc, inc.landed.result())
                    wire.trace("R land done", inc.t.transfer_id)
                    return
                self.pending.check_active(inc.t)           # the reaper ended it: how, precisely
                if not done:
                    raise TransferRejected(Code.DEADLINE_EXCEEDED, f"transfer {inc.t.transfer_id} missed its deadline")
                msg = reader.result()
                if isinstance(msg, dict) and isinstance(msg.get("writing"), int):      # a piece's writes posted
                    self._poll_closely(max(CLOSE_MIN_S, msg["writing"] / (WRITES_GB_S * 1e9)))
                elif isinstance(msg, dict) and msg.get("written") is True:            # the notification is out
                    wire.trace("R written hint", inc.t.transfer_id)
                    self._poll_closely(EAGER_POLL_S)
                else:
                    break
                reader = asyncio.ensure_future(context.read())
            if msg is grpc.aio.EOF:
                raise TransferRejected(Code.DATA_LOSS, f"the prefill worker closed the stream of "
                                       f"{inc.t.transfer_id} before its KV landed")
            if "abandon" in msg:
                inc.quiet = msg.get("quiet") is True
                raise TransferRejected(Code.ABORTED, f"the prefill worker gave it up: {msg['abandon']}")
            raise TransferRejected(Code.INVALID_ARGUMENT, f"unexpected message on the stream of "
                                   f"{inc.t.transfer_id}: {sorted(msg)}")
        finally:
            reader.cancel()

    def _land(self, inc: _Incoming, note: dict) -> None:
        t = inc.t
        if note.get("blocks") != inc.blocks:
            raise TransferRejected(Code.DATA_LOSS, f"transfer {t.transfer_id} says it wrote {note.get('blocks')} "
                                   f"blocks; {inc.blocks} were reserved (a truncated payload)")
        first_token, extra = note.get("first_token"), note.get("extra") or {}
        if not isinstance(first_token, int) or not isinstance(extra, dict):
            raise TransferRejected(Code.INVALID_ARGUMENT, f"transfer {t.transfer_id}: a garbled notification")
        buf = t.buffer
        payload = None if inc.pages else memoryview(buf.numpy()) if buf.device.type == "cpu" else buf
        self._deregister(inc)                              # every write is done: nothing more lands
        self.pending.complete(t, first_token, {str(k): str(v) for k, v in extra.items()}, payload)

    # -- notifications -----------------------------------------------------------------------------
    def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    def _poll_closely(self, seconds: float) -> None:
        """A sender's writes are under way (UCX may need this side's progress to complete them) or
        its notification is out: poll every CLOSE_POLL_S for `seconds`, starting now."""
        self._close_until = max(self._close_until, time.monotonic() + seconds)
        self._hurry.set()
        self._ensure_polling()

    async def _poll(self) -> None:
        wait = POLL_S
        while self.incoming:
            news = self.agent.get_new_notifs()
            for agent, notes in news.items():
                for raw in notes:
                    self._notified(agent, raw)
            if time.monotonic() < self._close_until:
                wait = CLOSE_POLL_S
            else:
                wait = POLL_S if news or wait == CLOSE_POLL_S else min(2 * wait, POLL_MAX_S)
            self._hurry.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), wait)

    def _notified(self, agent: str, raw: bytes) -> None:
        try:
            note = json.loads(raw)
            inc = self.incoming.get(note["tid"])
        except (ValueError, KeyError, TypeError):
            log.warning("a NIXL notification from %s is not a Baton one; ignored", agent)
            return
        if inc is None or inc.sender_agent != agent or inc.landed.done():
            log.warning("a NIXL notification from %s for a transfer it does not hold; ignored", agent)
            return
        wire.trace("R notif got", note.get("tid"))
        inc.landed.set_result(note)

    # -- the end of a transfer ---------------------------------------------------------------------
    def _end(self, inc: _Incoming, reason: str) -> None:
        self.incoming.pop(inc.t.transfer_id, None)
        self.pending.fail(inc.t.transfer_id, reason, Code.CANCELLED)     # no-op once it ended
        if inc.quiet:                                      # the sender has no write in flight
            self.pending.release(inc.t.transfer_id)
            self._deregister(inc)
        self._hold(inc)                                    # unless it landed, a write may still be on its way

    def _hold(self, inc: _Incoming) -> None:
        if inc.reg is not None:
            self.quarantine.append((time.monotonic() + self.quarantine_s, inc.reg, inc.t.buffer))
            inc.reg = None

    def _deregister(self, inc: _Incoming) -> None:
        if inc.reg is not None:
            self.agent.deregister_memory(inc.reg)
            inc.reg = None

    def _release_quarantine(self, force: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for until, reg, buf in self.quarantine:
            if force or until <= now:
                self.agent.deregister_memory(reg)
            else:
                keep.append((until, reg, buf))
        self.quarantine = keep
