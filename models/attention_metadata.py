"""Per-step attention metadata, built by the model runner and passed down explicitly.

One object per forward pass; no module globals. Layout conventions (vLLM vocabulary):
tokens of all sequences in a step are concatenated (T tokens, B sequences); sequence i owns
query rows query_start_loc[i]:query_start_loc[i+1] and its KV history is seq_lens[i] tokens
long (already-cached context + this step's new tokens), addressed through block_tables[i].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttnMetadata:
    is_decode: bool                  # every sequence has exactly one new token (graph-capturable)
    slot_mapping: torch.Tensor       # [T] int64, flat KV slot (block * block_size + offset); -1 = padding row
    query_start_loc: torch.Tensor    # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor           # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor       # [B, max_blocks] int32, -1 past a sequence's last block
    max_query_len: int
    max_seq_len: int
    has_context: bool                # some sequence attends to KV computed in an earlier step
    # host copies, so reference back ends and NPU ops (which take Python lists) need no sync
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decode_rows: int = 0         # leading sequences with one new token each (a mixed step's decodes)
    _split: tuple | None = None      # split_decodes(), made once per step (every layer asks)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def split_decodes(self) -> tuple[AttnMetadata, AttnMetadata]:
        """(the leading one-token rows as a decode step, the rest as a prefill step); the second's
        query offsets restart at 0. For back ends whose decode kernel is faster on those rows. The
        second's tensors are fresh copies, not offset views: kernels are specialised on pointer
        alignment, and an odd offset would compile another variant mid-run."""
        if self._split is None:
            self._split = self._split_decodes()
        return self._split

    def _split_decodes(self) -> tuple[AttnMetadata, AttnMetadata]:
        nd = self.num_decode_rows
        decode = AttnMetadata(
            is_decode=True, slot_mapping=self.slot_mapping[:nd], query_start_loc=self.query_start_loc[:nd + 1],
            seq_lens=self.seq_lens[:nd], block_tables=self.block_tables[:nd], max_query_len=1,
            max_seq_len=max(self.seq_lens_cpu[:nd]), has_context=True,
            query_start_loc_cpu=self.query_start_loc_cpu[:nd + 1], seq_lens_cpu=self.seq_lens_cpu[:nd],
            num_decode_rows=nd)
        prefill = AttnMetadata(
            is_decode=False, slot_mapping=self.slot_mapping[nd:].clone(), query_start_loc=self.query_start_loc[nd:] - nd,
            seq_lens=self.seq_lens[nd:].clone(), block_tables=self.block_tables[nd:].clone(),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len, has_context=self.has_context,
            query_start_loc_cpu=[s - nd for s in self.query_start_loc_cpu[nd:]], seq_lens_cpu=self.seq_lens_cpu[nd:])
        return decode, prefill
