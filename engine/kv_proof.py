"""KV that can prove what it is (issue 51): every transfer's last piece carries the epoch it was
sent for and a checksum of what was sent, and the decode engine checks both where the bytes
landed, before a token is decoded from them. A refused payload fails its request like any KV that
cannot be joined (its blocks freed once; the router retries it elsewhere before the first token).

- The epoch is the transfer id: a nonce the decode worker issues per reservation at admission
  (decode_service/core.py), set as the ticket's `epoch`. The prefill side seals it into the meta
  from the descriptor it sends under; a payload of an earlier reservation of the same request, or
  a transfer replayed under a new id, names another epoch: `stale`.
- The checksum is computed on the device as the prefill packs each piece (engine/runner/
  kv_checksum.py), summed over the pieces, and checked on the landed payload (on its device) or
  on the blocks it was written into (an `InPlace` payload, a host payload bound for a device):
  a mismatch is `corrupt`.
- Wrong size, or pieces that do not cover the blocks: `partial`. A payload without a proof where
  one was asked (a peer that predates this): `unproven`.

An engine driven directly (tests, tools), whose tickets have no epoch, checks a checksum when one
came and the size always. Torch-free: the checksum itself is the runner's.
"""
from __future__ import annotations

from dataclasses import replace

from baton.engine.kv_handoff import KVPiece, KVTicket

EPOCH_META, CHECKSUM_META = "kv_epoch", "kv_checksum"
REASONS = ("stale", "partial", "corrupt", "unproven")     # baton_kv_transfer_failures{reason=...}


class KVRefused(ValueError):
    """A landed payload that is not the request's KV; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def seal(piece: KVPiece, epoch: str) -> KVPiece:
    """The last piece with its proof in its meta: the epoch it is sent for, and the checksum of
    every piece (waits for the device to finish it: call it off the event loop)."""
    meta = {**piece.meta, EPOCH_META: epoch}
    if piece.proof is not None:
        meta[CHECKSUM_META] = piece.proof.hex()
    return replace(piece, meta=meta)


def check_claims(ticket: KVTicket, nbytes: int | None, expected_nbytes: int) -> bool:
    """Raise KVRefused unless the landed payload is for this epoch and of the reserved size
    (`nbytes` None: written in place, its blocks checked instead). True: a checksum must be checked."""
    meta = ticket.meta
    if ticket.epoch is not None:
        if EPOCH_META not in meta or CHECKSUM_META not in meta:
            raise KVRefused("unproven", "the KV came without its epoch and checksum (a prefill worker "
                            "older than this decode worker?)")
        if meta[EPOCH_META] != ticket.epoch:
            raise KVRefused("stale", f"the KV was sent for transfer {meta[EPOCH_META]!r}, not this reservation's "
                            f"{ticket.epoch!r} (a late or replayed payload)")
    if nbytes is not None and nbytes != expected_nbytes:
        raise KVRefused("partial", f"{nbytes} bytes landed where {expected_nbytes} were reserved")
    return CHECKSUM_META in meta


def check_checksum(ticket: KVTicket, landed: str) -> None:
    if landed != ticket.meta[CHECKSUM_META]:
        raise KVRefused("corrupt", f"the landed KV's checksum {landed} is not the {ticket.meta[CHECKSUM_META]} "
                        "the prefill worker computed")
