"""A request's token sequence and its place in the engine: status, KV blocks, progress.

Torch-free. `num_computed_tokens` counts tokens whose KV is in the cache; the scheduler
feeds the rest to the model, in chunks if the budget requires.
"""
from __future__ import annotations

import itertools
from enum import Enum, auto

from baton.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    AWAITING_KV = auto()        # decode side: blocks reserved, its prompt's KV coming from a prefill worker
    FINISHED = auto()


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_ids = itertools.count()


class Sequence:
    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "num_cached_tokens", "block_table", "status", "params", "finish_reason", "max_model_len",
        "arrival", "num_preemptions", "sampling_seed", "num_hashed_blocks", "kv_ticket",
        "num_blocks_handed_off",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_model_len: int, arrival: float = 0.0):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0          # leading blocks already registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.params = params
        self.finish_reason: FinishReason | None = None
        self.max_model_len = max_model_len
        self.arrival = arrival
        self.num_preemptions = 0
        self.sampling_seed = params.seed
        self.kv_ticket = None               # KVTicket of a handed-off request (engine/kv_handoff.py)
        self.num_blocks_handed_off = 0      # prefill side: prompt blocks already packed into pieces

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")
