"""The decode worker's engine core (serving/worker/engine_core.py): reserves a request's blocks,
takes its KV from the prefill worker on its own KV port, joins it into the running batch
and decodes; the colocated role also runs whole requests. Tokens go to the front after every
step, in one message (decode_service/server.py streams them). It has the KV plane's sending
half too (serving/worker/kv_push.py): it pushes a running stream's KV to the worker taking it
over, and prefills prompts for decode workers once its worker switched to the prefill role.

Per request, its `KVTicket` (engine/kv_handoff.py) says who owns its blocks: RESERVED at
admission (the engine allocated them) -> RECEIVING (a sender claimed the transfer) -> LANDED
(every byte staged, or written straight into the blocks; `DecodeHandoff` hands it to the
engine) -> JOINED (the engine copied it into the blocks, unless it was written there; the
request decodes) -> FINISHED. Any failure, abort or deadline before that ends it FREED: the
engine frees the blocks, and the transfer registry drops the staging buffer -- or, where a
backend handed the blocks to its sender to write into, the engine holds them until the
registry releases them (no late write can land in another request's blocks). The KV bytes
never leave this process: the receivers land them here, next to the device they go to.
"""
from __future__ import annotations

import collections
import time
import uuid
from dataclasses import dataclass

import grpc

from baton.engine.kv_handoff import KVState, KVTicket
from baton.engine.output_processor import RequestOutput
from baton.engine.requests.sampling_params import SamplingParams
from baton.kvtransfer import registry
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.kvtransfer.receiver import PendingTransfers
from baton.models.multimodal import ImageInput
from baton.serving.grpc_server import Server, ServiceError
from baton.serving.processes import reachable_host
from baton.serving.worker.core_protocol import TokenUpdate, encode_error
from baton.serving.worker.kv_push import PrefillHandoff, PushingCore


class DecodeHandoff(PrefillHandoff):
    """The decode worker's half of the engine's seam: tickets whose KV landed, for the engine
    to join at its next step (appended on the event loop, taken on the engine thread); and the
    prefill side's, for prompts run here in the prefill role."""

    def __init__(self):
        super().__init__()
        self._landed: collections.deque[KVTicket] = collections.deque()

    def land(self, ticket: KVTicket, payload, first_token: int, meta: dict[str, str]) -> bool:
        """False when the request ended meanwhile (nothing is written into its blocks)."""
        if not ticket.land(payload, first_token, meta):
            return False
        self._landed.append(ticket)
        return True

    def take_landed(self) -> list[KVTicket]:
        taken = []
        while self._landed:
            taken.append(self._landed.popleft())
        return taken

    def has_landed(self) -> bool:
        return bool(self._landed)


@dataclass(slots=True)
class Reservation:
    """An admitted request whose KV comes from a prefill worker, until its first token."""
    transfer_id: str
    ticket: KVTicket
    prefill_done_unix: float | None = None    # the prefill worker's clock at its last forward


class DecodeCore(PushingCore):
    def __init__(self, cfg, emit):
        super().__init__(cfg, emit)
        self.handoff = DecodeHandoff()
        self.pending = PendingTransfers()
        self.reservations: dict[str, Reservation] = {}     # request id -> ...
        self.by_transfer: dict[str, str] = {}              # transfer id -> request id, until it lands or fails
        self.receivers = []
        self.layout = None
        self.kv_server: Server | None = None

    # -- the KV plane --------------------------------------------------------------------------
    async def start_transport(self) -> None:
        await super().start_transport()          # the sending half
        cfg = self.cfg
        self.kv_server = Server(cfg.host, cfg.kv_port, registry.services(cfg.kv_backend), tls=cfg.tls)
        self.layout = self.kv_layout()
        auth = KVPeerAuth(cfg.kv_secret) if cfg.kv_secret else None
        store_host = (cfg.kv_advertise or "").rpartition(":")[0] or cfg.host   # direct pairs' rendezvous
        kv_cache = self.llm.runner.kv_cache if cfg.engine.tp_size == 1 else None    # (TP: one rank's heads here)
        # device backends stage incoming KV in device memory: at most half what the KV cache left
        free = self.llm.platform.memory_info()[0] if self.llm.runner.device.type != "cpu" else None
        self.pending.max_staged_bytes = registry.buffer_bytes(cfg.kv_options, free)
        self.receivers = registry.make_receivers(cfg.kv_backend, registry.ReceiverContext(
            self.pending, self.layout, self.llm.platform, self.kv_address, store_host, auth, cfg.kv_options,
            kv_cache=kv_cache))
        for receiver in self.receivers:
            receiver.add_to_server(self.kv_server.server)
        await self.kv_server.start()

    @property
    def kv_address(self) -> str:
        """Where prefill workers push KV: never a wildcard (serving/processes.reachable_host)."""
        if self.cfg.kv_advertise:
            return self.cfg.kv_advertise
        return f"{reachable_host(self.cfg.host, self.cfg.advertise_host)}:{self.kv_server.port}"

    def hello(self) -> dict:
        return {**super().hello(), "kv_address": self.kv_address}

    async def stop_transport(self) -> None:
        await super().stop_transport()
        for receiver in self.receivers:
            await receiver.close()
        if self.kv_server is not None:
            await self.kv_server.server.stop(0)

    def num_pending(self) -> int:
        return len(self.by_transfer)

    # -- commands ------------------------------------------------------------------------------
    async def cmd_admit(self, rid: str, prompt: list[int], params: SamplingParams, backend: str,
                        timeout: float, reuse_prefix: bool = False) -> dict:
        """Reserve the request's blocks and expect its KV within `timeout` seconds. `reuse_prefix`:
        its prefill worker can skip blocks, so the prompt's prefix cached here is pinned and not
        sent again (--decode-prefix-reuse); the transfer holds the blocks after `skip_blocks`."""
        if rid in self.reservations or rid in self.llm.states:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already admitted here")
        reuse = reuse_prefix and self.cfg.decode_prefix_reuse
        ticket = await self.engine.call(lambda e: e.reserve(rid, prompt, params, reuse_prefix=reuse))
        r = Reservation(uuid.uuid4().hex, ticket)
        ticket.epoch = r.transfer_id             # what the landed KV must prove it was sent for (engine/kv_proof.py)
        self.reservations[rid] = r
        self.by_transfer[r.transfer_id] = rid
        num_blocks = len(ticket.block_ids)
        try:
            self.pending.expect(r.transfer_id, self.layout.payload_nbytes(num_blocks), timeout,
                                self._on_kv_complete, self._on_kv_fail, self._on_kv_claimed,
                                pages=ticket.block_ids, on_release=self.engine.release_held)
        except BaseException:
            await self.cmd_abort(rid)
            raise
        if ticket.skip_blocks:
            self.metrics.add("pd_reused_tokens", ticket.skip_blocks * self.llm.config.block_size)
        return {"transfer_id": r.transfer_id, "num_blocks": num_blocks, "kv_address": self.kv_address,
                "backend": backend, "skip_blocks": ticket.skip_blocks}

    async def cmd_add(self, rid: str, prompt: list[int], params: SamplingParams, images: list[ImageInput]) -> None:
        """Colocated: the whole request here, no transfer."""
        await self.engine.call(lambda e: e.add_request(prompt, params, request_id=rid, images=images))

    async def cmd_abort(self, rid: str) -> bool:
        """End the request wherever it is: its blocks are freed once (held first, where its
        sender may still write into them), its transfer refused."""
        r = self.reservations.pop(rid, None)
        held = None
        if r is not None and self.by_transfer.pop(r.transfer_id, None) is not None:
            self.pending.cancel(r.transfer_id)
            held = r.transfer_id if self.pending.held(r.transfer_id) else None
        if held is None:
            return await super().cmd_abort(rid) or r is not None     # (a prompt prefilled here, a paused stream)
        self.engine.abort(rid, hold_as=held)
        return True

    # -- the KV's arrival ----------------------------------------------------------------------
    def _reservation(self, transfer_id: str, done: bool) -> tuple[str | None, Reservation | None]:
        rid = self.by_transfer.pop(transfer_id, None) if done else self.by_transfer.get(transfer_id)
        return rid, self.reservations.get(rid) if rid else None

    def _on_kv_claimed(self, transfer_id: str) -> None:
        _, r = self._reservation(transfer_id, done=False)
        if r is not None:
            r.ticket.try_advance(KVState.RECEIVING)

    def _on_kv_complete(self, transfer_id: str, payload, first_token: int, extra: dict) -> None:
        rid, r = self._reservation(transfer_id, done=True)
        if r is None:
            return
        r.prefill_done_unix = _float(extra.get("prefill_done_unix"))
        if r.prefill_done_unix:
            self.metrics.add("kv_landed", max(0.0, time.time() - r.prefill_done_unix))
        self.metrics.add("kv_transfer_bytes", len(payload), "in")
        if not self.handoff.land(r.ticket, payload, first_token, extra):
            raise RuntimeError(f"request {rid} ended before its KV landed ({r.ticket.state.value})")
        self.engine.wake()                   # joined between steps, not after an idle wait

    def _on_kv_fail(self, transfer_id: str, reason: str) -> None:
        rid, r = self._reservation(transfer_id, done=True)
        if r is None:
            return
        self.reservations.pop(rid, None)
        self.metrics.add("kv_transfer_failures", 1, "receive")
        self.engine.abort(rid, hold_as=transfer_id if self.pending.held(transfer_id) else None)
        # ABORTED: the transfer failed, not this worker (the router retries without leaving it)
        error = ServiceError(grpc.StatusCode.ABORTED, f"KV handover failed: {reason}")
        self.send_updates([TokenUpdate(rid, [], error=encode_error(error))])

    # -- what the front hears (engine thread) ----------------------------------------------------
    def update_of(self, out: RequestOutput) -> TokenUpdate:
        r = self.reservations.pop(out.request_id, None)        # a reserved request's first output: its join
        if r is not None and r.ticket.refused:                  # ... or its KV refused there
            self.metrics.add("kv_transfer_failures", 1, r.ticket.refused)
        handover = self._handover(r) if r is not None else 0.0
        return TokenUpdate.of(out, encode_error(self.failure(out)) if out.error else None, handover)

    def failure(self, out: RequestOutput) -> Exception:
        return ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV handover failed: {out.error}")

    def _handover(self, r: Reservation) -> float:
        """The prefill's last forward -> this request's first decode step (its join)."""
        if r.ticket.joined_at is None or not r.prefill_done_unix:
            return 0.0
        seconds = max(0.0, r.ticket.joined_at - r.prefill_done_unix)
        self.metrics.add("handover", seconds)
        return seconds


def _float(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None
