"""The engine's side of the KV seam (engine/kv_handoff.py): a prefill engine packs the prompt
blocks each step made final and hands them to the hook as pieces; a decode engine reserves
blocks for a request whose KV comes from elsewhere, and joins it to the running batch once the
hook says the KV landed. `LLMEngine` composes one `KVExchange` and keeps the requests: what
the exchange needs of them comes through `Requests`, three public methods of the engine."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from baton.engine.kv_handoff import InPlace, KVHandoff, KVPiece, KVState, KVTicket
from baton.engine.kv_proof import KVRefused, check_checksum, check_claims
from baton.engine.requests.logprobs import decode as decode_logprobs
from baton.engine.requests.logprobs import encode as encode_logprobs
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.multimodal import POSITION_OFFSET_META, MultimodalPrompt
from baton.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from baton.engine.scheduling.sequence import Sequence, SequenceStatus
from baton.engine.speculation.speculative import HEAD_STATE_META

if TYPE_CHECKING:
    from baton.engine.output_processor import RequestOutput
    from baton.engine.runner.model_runner import ModelRunner
    from baton.models.audio import AudioPlaceholders
    from baton.models.multimodal import ImagePlaceholders

log = logging.getLogger("baton.engine")

FIRST_LOGPROBS_META, PROMPT_LOGPROBS_META = "first_logprobs", "prompt_logprobs"   # (engine/requests/logprobs.py)


@dataclass(frozen=True, slots=True)
class KVSpec:
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_scales: str = ""                # a float8 cache's scales, as a checksum (engine/runner/kv_scales.py); "" = none


class Requests(Protocol):
    """What the exchange needs of the engine's requests (`LLMEngine` is one)."""

    def sequence(self, request_id: str) -> Sequence | None: ...

    def take_output(self, request_id: str) -> RequestOutput: ...

    def fail_request(self, request_id: str, why: str) -> RequestOutput: ...

    in_flight: object | None          # the step running on the device now, if any


class KVExchange:
    """Moves prompt KV between engines through `handoff`, the services' hook (the base class
    hands nothing off). Runs on the engine thread."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, scheduler: Scheduler,
                 placeholders: ImagePlaceholders | AudioPlaceholders | None, handoff: KVHandoff):
        self.runner = runner
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.placeholders = placeholders      # None: a text-only model
        self.handoff = handoff
        self.held: dict[str, list[int]] = {}        # hold(key, seq): blocks kept out of the pool until released
        # the checksum of landed KV, checked (--kv-checksum; epoch and size always are): by default on a CPU
        # engine, where it is ~2 % of a gRPC transfer; on an accelerator only when asked: on CUDA its sums
        # are taken in the copy into the blocks (no extra read), but the copy is queued behind the step in
        # flight, so a request whose KV lands while a step runs joins one step later (its first token too)
        mode = runner.config.kv_checksum
        self.checksum = mode == "on" or (mode == "auto" and runner.device.type == "cpu")
        self.proving: list[tuple[KVTicket, object | None, bool]] = []   # landed KV the device checks: (ticket,
        #                                                   its checksum (kv_checksum.Proof), queued this call)

    @property
    def spec(self) -> KVSpec:
        """The paged cache's shape, what a KV transfer's two ends must agree on."""
        r = self.runner
        return KVSpec(str(r.kv_dtype).removeprefix("torch."), self.block_manager.block_size, r.num_cache_layers,
                      r.model.num_kv_heads, r.model.head_dim, r.kv_scales_checksum)

    # -- prefill side -----------------------------------------------------------------------
    def prefill_ticket(self, seq: Sequence, skip_blocks: int = 0) -> KVTicket:
        """The ticket of a handed-off request whose first `skip_blocks` prompt blocks the decode side
        has already (its own prefix cache): its pieces start after them (ValueError: more than the
        full blocks a prefix cache could serve, which always leaves the last token's block to send)."""
        most = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        if not 0 <= skip_blocks <= most:
            raise ValueError(f"skip_blocks must be in [0, {most}] for a prompt of {seq.num_prompt_tokens} tokens, "
                             f"got {skip_blocks}")
        ticket = KVTicket(seq.request_id, "prefill")
        ticket.skip_blocks = seq.num_blocks_handed_off = skip_blocks
        return ticket

    def hand_off(self, out: SchedulerOutput, sampled: list[int | None]) -> dict[str, str]:
        """Pack the prompt blocks this step made final, for every handed-off request: the full
        ones its prefill has covered, and the last, partial one once the prompt is done, with
        the token sampled after it. Returns the requests whose hook failed (and why)."""
        bs = self.block_manager.block_size
        failed: dict[str, str] = {}
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            ticket = seq.kv_ticket
            if ticket is None or ticket.side != "prefill" or ticket.done:
                continue
            done = min(seq.num_computed_tokens, seq.num_prompt_tokens)      # (the step is counted in)
            last = done == seq.num_prompt_tokens
            final = -(-done // bs) if last else done // bs
            if final <= seq.num_blocks_handed_off:
                continue
            first, seq.num_blocks_handed_off = seq.num_blocks_handed_off, final
            try:
                self._hand_off_piece(seq, ticket, first, final, token if last else None)
            except Exception as exc:
                log.exception("the KV hand-off of request %s failed", seq.request_id)
                failed[seq.request_id] = f"its KV could not be handed off: {exc!r}"
        return failed

    def _hand_off_piece(self, seq: Sequence, ticket: KVTicket, first: int, final: int, token: int | None) -> None:
        n, within = final - first, first - ticket.skip_blocks    # numbered within the transfer, as it lands
        data, ready, ticket.proof = self.runner.pack_kv(seq.block_table[first:final], within, ticket.proof)
        meta = {}
        if token is not None:
            meta = {"prefill_done_unix": repr(time.time()), "cached_tokens": str(seq.num_cached_tokens)}
            if seq.mm is not None and seq.mm.position_offset:      # generated tokens' rotary shift
                meta[POSITION_OFFSET_META] = str(seq.mm.position_offset)
            meta.update(_logprobs_meta(seq))
            if seq.spec_hidden is not None:       # a draft head's last state: the decode side drafts from it
                meta[HEAD_STATE_META] = self.runner.drafts.encode_state(seq.spec_hidden)
        self.handoff.on_prompt_kv(KVPiece(seq.request_id, within, n, data, ready, token, meta, ticket.proof))
        state = KVState.PREFILLED if token is not None else KVState.PREFILLING
        if ticket.state is not state:           # (pieces after the first leave it PREFILLING)
            ticket.advance(state)

    # -- decode side ------------------------------------------------------------------------
    def reserve(self, seq: Sequence, reuse_prefix: bool = False) -> KVTicket:
        """Blocks for `seq`, whose prompt KV another worker computes (KVCacheFull if they are not
        free: nothing is then held), and its ticket; it awaits the KV until `join_landed`. With
        `reuse_prefix`, the prompt's leading full blocks this engine's prefix cache holds are pinned
        (ticket.skip_blocks: the prefill side sends none of them) and only the rest are reserved."""
        skip = self._match_own_prefix(seq) if reuse_prefix else 0
        try:    # the rest fresh: a backend may write the KV straight into them, so none is shared until the join
            self.block_manager.allocate(seq, seq.num_prompt_tokens)
        except BaseException:
            self.block_manager.free_sequence(seq)       # the pinned prefix goes back: a refusal holds nothing
            raise
        seq.status = SequenceStatus.AWAITING_KV
        seq.kv_ticket = KVTicket(seq.request_id, "decode")
        seq.kv_ticket.skip_blocks = skip
        seq.kv_ticket.block_ids = tuple(seq.block_table[skip:])
        return seq.kv_ticket

    def _match_own_prefix(self, seq: Sequence) -> int:
        """Pin the prompt's cached leading blocks (BlockManager.match_prefix); how many. A prompt with
        images matches only up to its first image: their pads alone do not say which image it was."""
        if self.placeholders is not None:
            seq.mm = MultimodalPrompt.remote(seq.token_ids, self.placeholders.token_id, 0)
        self.block_manager.match_prefix(seq)
        return len(seq.block_table)

    # -- a running stream moving on, with its KV (a role switch) ---------------------------------
    def export(self, seq: Sequence) -> tuple[KVPiece, list[int]] | str:
        """A decoding sequence's KV for the worker that continues it, and the tokens it made: the
        blocks of its known tokens but the last (whose KV no finished step has written), packed, with
        that last token, as a prefill's last piece carries its first token. The receiving side reserves
        and joins it as any handed-off prompt; the caller then ends the sequence here (its blocks
        freed once). A string says why it cannot move now: not decoding, or guesses in flight."""
        if seq.status is not SequenceStatus.RUNNING or seq.num_completion_tokens < 1:
            return "it is not decoding (its prompt runs, it waits for KV or memory)"
        if seq.num_unverified_tokens:
            return "it has speculative guesses in flight"
        known = seq.num_known_tokens
        num_blocks = -(-(known - 1) // self.block_manager.block_size)
        data, ready, proof = self.runner.pack_kv(seq.block_table[:num_blocks])
        meta = {"cached_tokens": "0"}
        if seq.mm is not None and seq.mm.position_offset:
            meta[POSITION_OFFSET_META] = str(seq.mm.position_offset)
        if seq.params.logprobs is not None:
            meta[FIRST_LOGPROBS_META] = encode_logprobs([(seq.logprobs or {}).get(known - 1)])
        if seq.spec_hidden is not None:       # a draft head's state goes too (a stale one costs guesses, not tokens)
            meta[HEAD_STATE_META] = self.runner.drafts.encode_state(seq.spec_hidden)
        piece = KVPiece(seq.request_id, 0, num_blocks, data, ready, seq.token_ids[known - 1], meta, proof)
        return piece, seq.completion_token_ids

    def hold(self, key: str, seq: Sequence) -> None:
        """Keep an aborted sequence's blocks out of the pool under `key` (a sender it handed them
        to may still write into them) until `release_held(key)`."""
        self.held[key], seq.block_table = seq.block_table, []

    def release_held(self, key: str) -> int:
        """Free the blocks `hold` kept under key (once; 0 when none are held under key)."""
        blocks = self.held.pop(key, [])
        self.block_manager.free_blocks(blocks)
        return len(blocks)

    @property
    def num_held_blocks(self) -> int:
        return sum(map(len, list(self.held.values())))

    def has_landed(self) -> bool:
        """Is landed KV waiting to join (so an idle engine steps to join it)?"""
        return bool(self.proving) or self.handoff.has_landed()

    def join_landed(self, requests: Requests) -> list[RequestOutput]:
        """Copy every landed payload into its request's reserved blocks (unless a backend wrote
        it there: InPlace), check it is the request's KV (engine/kv_proof.py) and run the request
        from the next step on; its first token is emitted then. KV that is not the request's fails
        it, its blocks freed, before any token comes of it. The checksum is queued on the device:
        while a step runs there, it is read at the next call, so the engine never waits for that
        step here (the request joins one step later); otherwise at once."""
        outputs = []
        for ticket in self.handoff.take_landed():
            seq = self._awaiting(requests, ticket)
            if seq is None:
                continue                              # aborted meanwhile: its blocks are free already
            try:
                self.proving.append((ticket, self._land(seq, ticket), True))
            except Exception as exc:
                outputs.append(self._refuse(requests, ticket, exc))
        proving, self.proving = self.proving, []
        for ticket, proof, now in proving:
            if now and proof is not None and requests.in_flight is not None and not proof.done():
                self.proving.append((ticket, proof, False))
                continue
            seq = self._awaiting(requests, ticket)
            if seq is None:
                continue
            try:
                if proof is not None:
                    check_checksum(ticket, proof.hex())
            except KVRefused as exc:
                outputs.append(self._refuse(requests, ticket, exc))
                continue
            self._join(seq, ticket)
            outputs.append(requests.take_output(seq.request_id))
        return outputs

    @staticmethod
    def _awaiting(requests: Requests, ticket: KVTicket) -> Sequence | None:
        """The ticket's sequence, if it still awaits its KV (not aborted meanwhile)."""
        seq = requests.sequence(ticket.request_id)
        if seq is None or seq.kv_ticket is not ticket or ticket.state is not KVState.LANDED:
            return None
        return seq

    def _land(self, seq: Sequence, ticket: KVTicket):
        """Check the payload's claims and write it into the blocks; its checksum (a Proof, queued on
        the device), or None when none is to be checked."""
        payload, in_place = ticket.payload, isinstance(ticket.payload, InPlace)
        blocks = seq.block_table[ticket.skip_blocks:]       # (those before: this engine's own prefix cache)
        if in_place and tuple(payload.block_ids) != tuple(blocks):
            raise KVRefused("stale", f"the KV was written into blocks {list(payload.block_ids)[:8]}..., "
                            f"not the request's {blocks[:8]}...")
        nbytes = None if in_place else getattr(payload, "nbytes", None) or len(payload)
        prove = check_claims(ticket, nbytes, self.runner.block_bytes() * len(blocks)) and self.checksum
        try:
            return self.runner.land_kv(blocks, payload, prove)
        except ValueError as exc:                     # pieces out of order, short of the blocks
            raise KVRefused("partial", str(exc)) from exc

    def _refuse(self, requests: Requests, ticket: KVTicket, exc: Exception) -> RequestOutput:
        ticket.refused = getattr(exc, "reason", None)
        log.warning("request %s: the landed KV could not be joined: %s", ticket.request_id, exc)
        return requests.fail_request(ticket.request_id, f"could not join the transferred KV: {exc}")

    def _join(self, seq: Sequence, ticket: KVTicket) -> None:
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = int(ticket.meta.get("cached_tokens") or 0)   # the prefill's prefix-cache hit
        if self.placeholders is not None:     # images / audio were encoded on the prefill side: only the offset comes
            seq.mm = MultimodalPrompt.remote(seq.token_ids, self.placeholders.token_id,
                                             int(ticket.meta.get(POSITION_OFFSET_META) or 0))
        seq.append_token(ticket.first_token)
        _join_logprobs(seq, ticket.meta)
        if self.runner.drafts is not None and HEAD_STATE_META in ticket.meta:
            seq.spec_hidden = self.runner.drafts.decode_state(ticket.meta[HEAD_STATE_META])
        self.block_manager.register_full_blocks(seq)
        ticket.joined_at = time.time()
        ticket.advance(KVState.JOINED)
        self.scheduler.add_running(seq)
        reason = self.scheduler.stop_reason(seq, ticket.first_token)
        if reason is not None:
            self.scheduler.finish(seq, reason)


def _logprobs_meta(seq: Sequence) -> dict[str, str]:
    """Prefill side: the first token's and the prompt's records go with the KV hand-off."""
    meta = {}
    if seq.params.logprobs is not None:
        meta[FIRST_LOGPROBS_META] = encode_logprobs([(seq.logprobs or {}).get(seq.num_prompt_tokens)])
    if seq.params.prompt_logprobs is not None:
        records = seq.prompt_logprobs or {}
        meta[PROMPT_LOGPROBS_META] = encode_logprobs([records.get(i) for i in range(seq.num_prompt_tokens)])
    return meta


def _join_logprobs(seq: Sequence, meta: dict[str, str]) -> None:
    """Decode side: the records that came with the KV."""
    if FIRST_LOGPROBS_META in meta:
        seq.logprobs = {seq.num_prompt_tokens: decode_logprobs(meta[FIRST_LOGPROBS_META])[0]}
    if PROMPT_LOGPROBS_META in meta:
        seq.prompt_logprobs = dict(enumerate(decode_logprobs(meta[PROMPT_LOGPROBS_META])))
