"""Emulated MoE ops: gating top-k softmax, init routing v2, grouped matmul, token unpermute.

Index layouts are the documented ones (docs/npu.md, "MoE"); only the forms npu.py uses are
emulated (no quantization, no drop/pad, the full expert range, one x / one weight / one y).
Matmuls, products and sums run in the input dtype, which is the CPU platform's rounding, so
greedy tokens can be compared with it exactly; the device's own accumulation is undocumented.
"""
from __future__ import annotations

import itertools

import torch

from baton.engine.platforms.npu_emulation.common import _require, _unsupported

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOP_K = 1024
MAX_EXPERT_NUM = 10240        # init_routing_v2's expert_num outside key_value mode
MAX_GROUPS = 1024             # grouped matmul, one 3-D weight: group_list length
INNER_LIMIT = 65536           # grouped matmul: last dim of x and of weight (as stored) below this


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """Emulated MoeGatingTopKSoftmax -> (y, expert_idx int32, row_idx int32): softmax over the last
    dim in x's dtype, its top k, and row_idx[t, j] = j * T + t (k-major, as the formula states)."""
    op = "npu_moe_gating_top_k_softmax"
    if finished is not None:
        raise _unsupported(op, "finished")
    _require(x.dim() == 2, op, f"x must be 2-D [T, E] here (the op takes 2-D or 3-D), got {x.dim()}-D")
    _require(x.dtype in FLOAT_DTYPES, op, f"x dtype {x.dtype} unsupported (float16, bfloat16, float32)")
    _require(0 < k <= x.shape[-1] and k <= MAX_TOP_K, op, f"k must be in (0, {x.shape[-1]}] and <= {MAX_TOP_K}, got {k}")
    y, expert_idx = torch.topk(torch.softmax(x, dim=-1), k, dim=-1)
    t = x.shape[0]
    row_idx = torch.arange(t * k, dtype=torch.int32, device=x.device).view(k, t).t()
    return y, expert_idx.to(torch.int32), row_idx.contiguous()


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0):
    """Emulated MoeInitRoutingV2, dropless and unquantized -> (expanded_x, expanded_row_idx int32,
    expert_token_cumsum_or_count int64, expanded_scale). Rows are sorted by expert, stably (the
    documented equivalent's argsort kind="stable"); row_idx_type 0 gives the gather index
    expanded_row_idx[t * K + j] = the row of (t, j) in expanded_x, 1 the scatter index (its inverse)."""
    op = "npu_moe_init_routing_v2"
    for name, value in (("scale", scale), ("offset", offset)):
        if value is not None:
            raise _unsupported(op, name)
    if quant_mode != -1:
        raise _unsupported(op, f"quant_mode {quant_mode}")
    if drop_pad_mode != 0:
        raise _unsupported(op, "drop_pad_mode 1 (drop/pad)")
    if expert_tokens_num_type == 2:
        raise _unsupported(op, "expert_tokens_num_type 2 (key_value)")
    _check_routing_args(op, x, expert_idx, active_num, expert_num, expert_tokens_num_type, row_idx_type)
    full = [0, expert_num]
    if list(active_expert_range) not in ([], full):
        raise _unsupported(op, f"active_expert_range {list(active_expert_range)} other than [0, expert_num]")
    t, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    _require(bool(((flat >= 0) & (flat < expert_num)).all()), op, f"expert ids must be in [0, expert_num={expert_num})")
    order = torch.sort(flat, stable=True).indices            # sortedRowIdx: (t, j) rows, expert by expert
    rows = t * k if active_num in (-1, 0) else min(active_num, t * k)
    expanded_x = x[order[:rows] // k]
    gather = torch.empty_like(order)
    gather[order] = torch.arange(t * k, device=order.device)
    expanded_row_idx = (order if row_idx_type == 1 else gather).to(torch.int32)
    counts = torch.bincount(flat, minlength=expert_num)
    tokens = (counts if expert_tokens_num_type == 1 else counts.cumsum(0)).to(torch.int64)
    if not expert_tokens_num_flag:
        tokens = torch.zeros_like(tokens)     # not requested: the op's third output has no documented value
    expanded_scale = torch.zeros(t, dtype=torch.float32, device=x.device)   # no scale: "meaningless"
    return expanded_x, expanded_row_idx, tokens, expanded_scale


def _check_routing_args(op, x, expert_idx, active_num, expert_num, tokens_num_type, row_idx_type) -> None:
    _require(x.dim() == 2 and x.dtype in FLOAT_DTYPES, op,
             f"x must be 2-D [NUM_ROWS, H] float16/bfloat16/float32 (unquantized), got {tuple(x.shape)} {x.dtype}")
    _require(expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0], op,
             f"expert_idx must be [NUM_ROWS={x.shape[0]}, K], got {tuple(expert_idx.shape)}")
    _require(expert_idx.dtype == torch.int32, op, f"expert_idx must be int32, got {expert_idx.dtype}")
    _require(active_num >= -1, op, f"active_num must be >= -1, got {active_num}")
    _require(0 < expert_num <= MAX_EXPERT_NUM, op,
             f"expert_num must be in [1, {MAX_EXPERT_NUM}] (the emulation sizes the counts by it), got {expert_num}")
    _require(tokens_num_type in (0, 1), op, f"expert_tokens_num_type must be 0, 1 or 2, got {tokens_num_type}")
    _require(row_idx_type in (0, 1), op, f"row_idx_type must be 0 or 1, got {row_idx_type}")


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config=None):
    """Emulated GroupedMatmul, unquantized, one x [M, K], one weight [E, K, N] (contiguous or a
    transposed view of [E, N, K]), one y [M, N], m-axis groups: rows of group g (from group_list:
    cumulative ends for group_list_type 0, counts for 1) times weight[g], in x's dtype."""
    op = "npu_grouped_matmul"
    unused = dict(bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                  antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, activation_input=activation_input,
                  activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
                  tuning_config=tuning_config)
    for name, value in unused.items():
        if value is not None:
            raise _unsupported(op, name)
    if act_type != 0:
        raise _unsupported(op, f"act_type {act_type}")
    _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op, "x and weight must be lists")
    if len(x) != 1 or len(weight) != 1 or group_type != 0 or split_item not in (2, 3):
        raise _unsupported(op, "anything but one x, one 3-D weight, one y (split_item 2/3, group_type 0)")
    a, w = x[0], weight[0]
    _check_matmul_args(op, a, w, output_dtype)
    ends = _group_ends(op, group_list, group_list_type, w.shape[0], a.shape[0])
    y = a.new_empty(a.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            y[start:end] = torch.matmul(a[start:end], w[g])
        start = end
    return [y]


def _check_matmul_args(op, a, w, output_dtype) -> None:
    _require(a.dim() == 2 and w.dim() == 3, op,
             f"x must be 2-D and weight 3-D [E, K, N], got {tuple(a.shape)} and {tuple(w.shape)}")
    _require(a.dtype in FLOAT_DTYPES and w.dtype == a.dtype, op,
             f"unquantized x and weight must share float16/bfloat16/float32, got {a.dtype} and {w.dtype}")
    _require(output_dtype in (None, a.dtype), op, f"output_dtype must be None or x's dtype, got {output_dtype}")
    _require(a.is_contiguous(), op, "x must not be transposed (contiguous)")
    transposed = w.stride(1) == 1 and w.shape[1] > 1
    _require(w[0].is_contiguous() or transposed, op, "each weight must be contiguous [K, N] or its transpose")
    _require(a.shape[1] == w.shape[1], op, f"x's K {a.shape[1]} must equal weight's K {w.shape[1]}")
    stored_last = w.shape[1] if transposed else w.shape[2]
    _require(a.shape[1] < INNER_LIMIT and stored_last < INNER_LIMIT, op, f"inner dims must be < {INNER_LIMIT}")


def _group_ends(op, group_list, group_list_type, groups: int, m: int) -> list[int]:
    """The end row of each group, from group_list as a device tensor (read on the host here only)."""
    _require(isinstance(group_list, torch.Tensor) and group_list.dim() == 1 and group_list.dtype == torch.int64, op,
             "group_list must be a 1-D int64 tensor here")
    _require(group_list.shape[0] == groups and groups <= MAX_GROUPS, op,
             f"group_list length must equal the weight's E={groups} (<= {MAX_GROUPS}), got {group_list.shape[0]}")
    values = group_list.tolist()
    _require(all(v >= 0 for v in values), op, "group_list must be non-negative")
    if group_list_type == 0:
        _require(values == sorted(values), op, "cumulative group_list must not decrease")
        _require(values[-1] == m, op, f"cumulative group_list must end at x's rows {m}, got {values[-1]}")
        return values
    _require(group_list_type == 1, op, f"group_list_type must be 0 or 1 (2: int8 only), got {group_list_type}")
    _require(groups != 1, op, "counts group_list (group_list_type 1) must not have length 1")
    _require(sum(values) == m, op, f"group counts must sum to x's rows {m}, got {sum(values)}")
    return list(itertools.accumulate(values))


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """Emulated MoeTokenUnpermute: out[t] = sum_j probs[t, j] * permuted_tokens[sorted_indices[t * K + j]]
    (K = probs.shape[1], 1 without probs); products and the running sum over j in the input dtype."""
    op = "npu_moe_token_unpermute"
    if padded_mode or restore_shape is not None:
        raise _unsupported(op, "padded_mode / restore_shape")
    _require(permuted_tokens.dim() == 2 and permuted_tokens.dtype in FLOAT_DTYPES, op,
             f"permuted_tokens must be 2-D float16/bfloat16/float32, got {tuple(permuted_tokens.shape)} "
             f"{permuted_tokens.dtype}")
    n = permuted_tokens.shape[0]
    _require(sorted_indices.dim() == 1 and sorted_indices.shape[0] == n, op,
             f"sorted_indices must be 1-D with permuted_tokens' {n} rows, got {tuple(sorted_indices.shape)}")
    _require(sorted_indices.dtype == torch.int32, op, f"sorted_indices must be int32, got {sorted_indices.dtype}")
    _require(bool(((sorted_indices >= 0) & (sorted_indices < n)).all()), op, f"sorted_indices must be in [0, {n})")
    k = 1
    if probs is not None:
        _require(probs.dim() == 2 and probs.numel() == n and probs.dtype == permuted_tokens.dtype, op,
                 f"probs must be [tokens, K] with tokens * K = {n} and permuted_tokens' dtype, got "
                 f"{tuple(probs.shape)} {probs.dtype}")
        k = probs.shape[1]
    picked = permuted_tokens[sorted_indices.long()].view(n // k, k, -1)
    if probs is not None:
        picked = picked * probs.unsqueeze(-1)
    out = picked[:, 0]
    for j in range(1, k):
        out = out + picked[:, j]
    return out.contiguous()
