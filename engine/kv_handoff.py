"""The engine's one seam for disaggregated serving: how a prompt's KV leaves a prefill
engine, and how a request whose KV is computed elsewhere reserves blocks in a decode engine
and joins its running batch.

The services implement `KVHandoff`; the engine calls it on its own thread, through its
`KVExchange` (engine/kv_exchange.py). The services call the engine only through its named
methods (`add_request(..., hand_off_kv=True)`, `reserve`, `abort`), never its internals. Every
handed-off request has a `KVTicket`, an explicit state machine saying who owns the request's
KV, so that each block is freed exactly once whatever ends the request, and whenever:

    prefill side   QUEUED -> PREFILLING -> PREFILLED -> SENT
                     |           |             '-> FAILED        (the peer never confirmed)
                     '-----------'-> FREED                      (abort, deadline, failed push)
    decode side    RESERVED -> RECEIVING -> LANDED -> JOINED -> FINISHED
                     |            |           |
                     '------------'-----------'-> FREED          (abort, deadline, peer death, bad bytes,
                                                                  KV that cannot prove it is this request's)

On the prefill side the engine's sequence owns the blocks; they are freed (and stay in the
prefix cache) when the sequence finishes or is aborted. Nothing is held past the step that
made a block final: each `KVPiece` is a packed copy, ordered on the device after that step.
On the decode side the sequence owns its blocks from `reserve` on: fresh blocks, never shared
through the prefix cache until the join, listed in the ticket's `block_ids`; and, where the
decode engine reuses its own prefix cache (`reserve(..., reuse_prefix=True)`), the cached blocks
of the prompt's first `skip_blocks` blocks before them, pinned like any prefix hit, whose KV the
prefill side then does not send (its pieces number the blocks from the first one sent). A staging transfer
writes only into its own buffer, and the engine copies a landed payload into the blocks when
it joins the request, so an abort in any state frees the blocks at once and a late payload is
simply dropped. A backend that writes straight into the blocks (nixl) lands an `InPlace`
payload instead: the join copies nothing. Until it lands, a write may still be on its way,
so a request whose blocks were handed to a sender is aborted with its blocks *held*
(`LLMEngine.abort(..., hold_as=)`) and they are freed by `release_held` once the sender can
no longer write (kvtransfer/receiver.py's quarantine).

Torch-free: payloads and device events are opaque here.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum


class KVState(Enum):
    # prefill side
    QUEUED = "queued"               # in the engine; its prompt blocks are allocated as it runs
    PREFILLING = "prefilling"       # some prompt blocks are final and handed off as pieces
    PREFILLED = "prefilled"         # every piece handed off with the first token; blocks freed
    SENT = "sent"                   # the decode worker confirmed the KV
    FAILED = "failed"               # the decode worker refused or never confirmed it
    # decode side
    RESERVED = "reserved"           # blocks allocated; the KV is expected from a prefill worker
    RECEIVING = "receiving"         # a sender is writing it into a staging buffer
    LANDED = "landed"               # every byte staged; waits for the engine's next step
    JOINED = "joined"               # copied into the blocks; the request runs in the batch
    FINISHED = "finished"           # ended normally; the sequence freed its blocks
    # either side
    FREED = "freed"                 # ended early (abort, deadline, failure); blocks freed


PREFILL_TRANSITIONS: dict[KVState, frozenset[KVState]] = {
    KVState.QUEUED: frozenset({KVState.PREFILLING, KVState.PREFILLED, KVState.FREED}),
    KVState.PREFILLING: frozenset({KVState.PREFILLED, KVState.FREED}),
    KVState.PREFILLED: frozenset({KVState.SENT, KVState.FAILED}),
}
DECODE_TRANSITIONS: dict[KVState, frozenset[KVState]] = {
    KVState.RESERVED: frozenset({KVState.RECEIVING, KVState.LANDED, KVState.FREED}),
    KVState.RECEIVING: frozenset({KVState.LANDED, KVState.FREED}),
    KVState.LANDED: frozenset({KVState.JOINED, KVState.FREED}),
    KVState.JOINED: frozenset({KVState.FINISHED}),
}
TERMINAL = frozenset({KVState.SENT, KVState.FAILED, KVState.FINISHED, KVState.FREED})


class IllegalTransition(RuntimeError):
    """A ticket was asked to move where its state machine has no edge (a bug, or a race lost:
    e.g. a payload landing for a request already aborted)."""


class KVTicket:
    """One handed-off request's KV on one side. Moved by the event loop (transfer progress)
    and the engine thread (join, finish, abort), so every move takes its lock."""

    __slots__ = ("request_id", "side", "state", "history", "payload", "first_token", "meta", "joined_at",
                 "block_ids", "epoch", "proof", "refused", "skip_blocks", "_lock", "_transitions")

    def __init__(self, request_id: str, side: str):
        if side not in ("prefill", "decode"):
            raise ValueError(f"side must be 'prefill' or 'decode', got {side!r}")
        self._lock = threading.Lock()
        self.request_id = request_id
        self.side = side
        self._transitions = PREFILL_TRANSITIONS if side == "prefill" else DECODE_TRANSITIONS
        self.state = KVState.QUEUED if side == "prefill" else KVState.RESERVED
        self.history: list[KVState] = [self.state]
        self.payload: object | None = None      # decode side: the staged KV, from LANDED to JOINED
        self.first_token: int | None = None
        self.meta: dict[str, str] = {}
        self.joined_at: float | None = None     # decode side: time.time() of the join
        self.block_ids: tuple[int, ...] = ()    # decode side: the blocks its KV is written into, in order
        self.skip_blocks = 0                    # the prompt's leading blocks the decode side has already (not sent)
        self.epoch: str | None = None           # decode side: what the landed KV must prove it is for (kv_proof.py)
        self.proof: object | None = None        # prefill side: the running checksum of the pieces packed so far
        self.refused: str | None = None         # decode side: why its landed KV was refused (kv_proof.REASONS)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def can(self, to: KVState) -> bool:
        return to in self._transitions.get(self.state, ())

    def advance(self, to: KVState) -> None:
        """Move to `to`, or raise IllegalTransition."""
        with self._lock:
            self._move(to)

    def try_advance(self, to: KVState) -> bool:
        """Move to `to` if the state machine allows it now; False (nothing changed) if not."""
        with self._lock:
            if not self.can(to):
                return False
            self._move(to)
            return True

    def land(self, payload: object, first_token: int, meta: dict[str, str]) -> bool:
        """Decode side: every byte arrived. False if the request ended meanwhile (the payload is
        dropped: nothing of it was written into the blocks)."""
        with self._lock:
            if not self.can(KVState.LANDED):
                return False
            self.payload, self.first_token, self.meta = payload, first_token, dict(meta)
            self._move(KVState.LANDED)
            return True

    def _move(self, to: KVState) -> None:
        if not self.can(to):
            raise IllegalTransition(f"KV of request {self.request_id} ({self.side} side) cannot go from "
                                    f"{self.state.value} to {to.value}")
        self.state = to
        self.history.append(to)
        if to is not KVState.LANDED:
            self.payload = None                 # the staging buffer goes as soon as nothing needs it

    def __repr__(self) -> str:
        return f"KVTicket({self.request_id!r}, {self.side}, {self.state.value})"


@dataclass(frozen=True, slots=True)
class InPlace:
    """A landed payload a backend wrote straight into the request's reserved blocks: the join
    checks they are the request's blocks and copies nothing."""

    block_ids: tuple[int, ...]
    nbytes: int

    def __len__(self) -> int:
        """Bytes in all, like a payload's len()."""
        return self.nbytes


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Blocks [first_block, first_block + num_blocks) of one request's transfer (prompt blocks
    from the ticket's `skip_blocks` on: those before it are never sent), packed
    contiguously (engine.kv_blocks layout, uint8) on the engine's device. `data` is final once
    the device event `ready` has passed (None: already final, e.g. on the CPU). The last piece
    carries the first sampled token and `meta` (when the prompt's last forward ended, how many
    prompt tokens the prefix cache served). `proof`: the checksum of the transfer's blocks up to
    this piece's last, computed on the device (engine/runner/kv_checksum.py; opaque here): the
    sender seals the last piece with it (engine/kv_proof.py: `seal`)."""

    request_id: str
    first_block: int
    num_blocks: int
    data: object
    ready: object | None = None
    first_token: int | None = None
    meta: dict[str, str] = field(default_factory=dict)
    proof: object | None = None

    @property
    def last(self) -> bool:
        return self.first_token is not None


class KVHandoff:
    """What an engine hands its KV to, and takes landed KV from; implemented by the services.
    Both methods run on the engine thread and must be quick (hand work to the event loop)."""

    def on_prompt_kv(self, piece: KVPiece) -> None:
        """Prefill side: blocks of a handed-off request's prompt became final in the step that
        just ran, packed in `piece`; called once per block, in order, the last piece with the
        first token. An exception stops the request's hand-off (it gets no more pieces)."""

    def may_admit(self) -> bool:
        """Prefill side: may the engine start another prompt? False while the packed KV not yet
        sent is over its bound (the pieces live in device memory outside the KV cache); the
        service wakes the engine once it drains. Asked by the scheduler on every step."""
        return True

    def take_landed(self) -> list[KVTicket]:
        """Decode side: tickets that reached LANDED since the last call; the engine joins each
        at the start of its next step (a ticket that moved on meanwhile, e.g. FREED, is skipped)."""
        return []

    def has_landed(self) -> bool:
        """Decode side: is a landed ticket waiting (so an idle engine steps to join it)?"""
        return False
