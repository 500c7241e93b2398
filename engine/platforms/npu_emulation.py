"""TEST-ONLY emulation of documented semantics, not the hardware: plain-torch, CPU stand-ins
for exactly the torch_npu calls engine/platforms/npu.py makes, so CI can run that platform.

Each stand-in checks its arguments against the constraints the op-plugin / torch_npu
documentation states (see docs/npu.md) and raises NpuEmulationError naming the constraint,
then computes what the documentation says the op computes (layer ops in float32, cast back
once; attention with torch SDPA in the input dtype, as the CPU platform does). It says
nothing about performance, real kernel numerics or on-device behaviour; a call that passes
here may still fail on an Ascend device for reasons no document states.

Graph capture (`npu.NPUGraph`, `npu.graph`) is emulated by recording: while capturing,
every aten op and every emulated kernel launch is run once and recorded with its arguments;
replay re-runs the records in order over the same tensors and copies fresh results into the
captured outputs. Host-side arguments (Python lists such as actual_seq_kvlen) are frozen at
capture, as on the device, unless a task group is updated (graph_task_update_begin/end).
Reading a device value on the host during capture (.item(), .tolist(), bool(t)) is refused,
as a real capture cannot do it. Memory pools, streams and events are not modelled.
Enabled only by BATON_NPU_EMULATION=1 (engine/platforms/npu.py); never in production.
"""
from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MASK_SIZE = 2048                 # FIA's compressed mask for sparse_mode 2/3/4
FIA_DTYPES = (torch.float16, torch.bfloat16)
MAX_GQA_RATIO = 64
INT32_MAX = 2 ** 31 - 1


class NpuEmulationError(RuntimeError):
    """A call that breaks a documented constraint (or uses a feature the emulation lacks)."""


def _require(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise NpuEmulationError(f"{op}: {what} [torch_npu emulation: documented constraint]")


def _unsupported(op: str, what: str) -> NpuEmulationError:
    return NpuEmulationError(f"{op}: {what} is documented but not emulated; extend npu_emulation.py first")


# -- graph capture state ------------------------------------------------------------------------
class _Capture:
    """What the one capture under way (if any) is recording, and the update under way (if any)."""

    def __init__(self):
        self.graph: EmulatedNPUGraph | None = None
        self.in_kernel = 0               # >0 while an emulated kernel runs: its insides are one task
        self.group_start: int | None = None
        self.update: _TaskGroup | None = None
        self.update_calls: list[tuple[Callable, tuple, dict]] = []


_state = _Capture()

_HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_DATA_DEPENDENT_SHAPES = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}


class _HostReadGuard(TorchFunctionMode):
    """Refuses reading device values on the host while capturing (it would need a sync)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if _state.in_kernel == 0 and name in _HOST_READS:
            raise NpuEmulationError(
                f"Tensor.{name}() during graph capture: a captured graph cannot read device values on the "
                "host (the value would be frozen at capture); pass host data in, or a device tensor")
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Records every aten op run during capture (outside emulated kernels) for replay."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _state.in_kernel:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("item", "_local_scalar_dense", "equal", "is_nonzero"):
            raise NpuEmulationError(f"aten.{name} during graph capture reads a device value on the host")
        if name in _DATA_DEPENDENT_SHAPES:
            raise NpuEmulationError(f"aten.{name} during graph capture: output shape depends on device data")
        out = func(*args, **kwargs)
        _state.graph._tasks.append(_AtenTask.record(func, args, kwargs, out))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _refresh(captured, fresh, where: str) -> None:
    """Copy a re-run's outputs into the captured outputs (those it did not write in place)."""
    for old, new in zip(_tensors(captured), _tensors(fresh), strict=True):
        if new.data_ptr() == old.data_ptr() and new.shape == old.shape:
            continue
        if new.shape != old.shape:
            raise NpuEmulationError(f"graph replay: {where} produced shape {tuple(new.shape)}, "
                                    f"captured {tuple(old.shape)}")
        old.copy_(new)


@dataclass(slots=True)
class _AtenTask:
    func: Callable
    args: tuple
    kwargs: dict
    out: object
    rerun: bool                      # False for pure views: they alias captured storage already

    @classmethod
    def record(cls, func, args, kwargs, out) -> _AtenTask:
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        outs = _tensors(out)
        writes = any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
        fresh = any(_storage(t) not in inputs for t in outs)
        return cls(func, args, kwargs, out, rerun=writes or fresh or not outs)

    def run(self) -> None:
        if self.rerun:
            _refresh(self.out, self.func(*self.args, **self.kwargs), str(self.func))


@dataclass(slots=True)
class _KernelTask:
    """One emulated torch_npu launch: host arguments frozen at capture (or at the last update)."""
    fn: Callable
    args: tuple
    kwargs: dict
    out: object

    def run(self) -> None:
        _refresh(self.out, self.fn(*self.args, **self.kwargs), self.fn.__name__)


@dataclass(slots=True)
class _TaskGroup:
    """The handle graph_task_group_end returns: the kernel launches captured inside the group."""
    graph: EmulatedNPUGraph
    tasks: list[_KernelTask] = field(default_factory=list)


def _frozen(value):
    """Host-side arguments as the graph keeps them: containers copied, tensors by address."""
    if isinstance(value, list):
        return [_frozen(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _kernel(fn: Callable) -> Callable:
    """An emulated torch_npu op: run eagerly; during capture also recorded as one task; inside
    graph_task_update_begin/end only noted as the new arguments of the group's task."""
    def launch(*args, **kwargs):
        if _state.update is not None:
            _state.update_calls.append((fn, args, kwargs))
            return kwargs.get("out")
        if _state.graph is None or _state.in_kernel:
            return fn(*args, **kwargs)
        _state.in_kernel += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _state.in_kernel -= 1
        task = _KernelTask(fn, tuple(_frozen(a) for a in args), {k: _frozen(v) for k, v in kwargs.items()}, out)
        _state.graph._tasks.append(task)
        return out
    launch.__name__ = launch.__qualname__ = fn.__name__
    launch.__doc__ = fn.__doc__
    return launch


# -- fused infer attention (v2) ---------------------------------------------------------------------
_FIA = "npu_fused_infer_attention_score_v2"
_FIA_UNEMULATED = ("query_rope", "key_rope", "pse_shift", "dequant_scale_query", "dequant_scale_key",
                   "dequant_offset_key", "dequant_scale_value", "dequant_offset_value", "quant_scale_out",
                   "quant_offset_out", "learnable_sink", "out_dtype")
_FIA_RESERVED = ("dequant_scale_key_rope", "quant_scale_p", "query_dtype", "key_dtype", "value_dtype",
                 "query_rope_dtype", "key_rope_dtype", "key_shared_prefix_dtype", "value_shared_prefix_dtype",
                 "dequant_scale_query_dtype", "dequant_scale_key_dtype", "dequant_scale_value_dtype",
                 "dequant_scale_key_rope_dtype")


@dataclass(slots=True)
class _FiaPlan:
    """A validated FIA call: per-batch query rows, kv lengths, and where K/V come from."""
    batch: int
    q_rows: list[tuple[int, int]]          # (start, length) of each batch's queries in the flat query
    kv_lens: list[int]
    kv_starts: list[int]                   # non-paged: start of each batch's keys in the flat key
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool                           # sparse_mode 3 (rightDownCausal) applies
    paged: bool


def _fia_validate(query, key, value, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                  num_query_heads, num_key_value_heads, softmax_scale, input_layout, sparse_mode, block_size,
                  inner_precise, return_softmax_lse, extra) -> _FiaPlan:
    for name in _FIA_UNEMULATED:
        if extra.get(name) is not None:
            raise _unsupported(_FIA, name)
    for name in _FIA_RESERVED:
        _require(extra.get(name) is None, _FIA, f"{name} is reserved and must stay None")
    for name in ("query_quant_mode", "key_quant_mode", "value_quant_mode"):
        if extra.get(name, 0) != 0:
            raise _unsupported(_FIA, name)
    if return_softmax_lse:
        raise _unsupported(_FIA, "return_softmax_lse=True")
    _require(query.dtype in FIA_DTYPES, _FIA, f"query must be float16 or bfloat16, got {query.dtype}")
    _require(key.dtype == query.dtype and value.dtype == query.dtype, _FIA,
             f"key/value dtype ({key.dtype}, {value.dtype}) must match query ({query.dtype}) without quantization")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require(t.is_contiguous(), _FIA, f"{name} must be contiguous")
    _require(key.shape == value.shape, _FIA, f"key and value shapes must match, got {tuple(key.shape)} "
             f"and {tuple(value.shape)}")
    _require(isinstance(softmax_scale, float), _FIA, f"softmax_scale must be a float, got {softmax_scale!r}")
    _require(num_query_heads >= 1, _FIA, "num_query_heads must be >= 1")
    kv_heads = num_key_value_heads or num_query_heads
    _require(num_query_heads % kv_heads == 0 and num_query_heads // kv_heads <= MAX_GQA_RATIO, _FIA,
             f"num_key_value_heads ({kv_heads}) must divide num_query_heads ({num_query_heads}) with ratio <= 64")
    _require(sparse_mode in (0, 1, 2, 3, 4, 9), _FIA, f"sparse_mode must be 0, 1, 2, 3, 4 or 9, got {sparse_mode}")
    _require(inner_precise in (0, 1, 2, 3), _FIA, f"inner_precise must be 0..3, got {inner_precise}")
    if input_layout == "BSND":
        return _plan_bsnd(query, key, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                          num_query_heads, kv_heads, sparse_mode, block_size, inner_precise)
    if input_layout == "TND":
        return _plan_tnd(query, key, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                         num_query_heads, kv_heads, sparse_mode, block_size)
    if input_layout in ("BSH", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND_NTD", "NTD_TND"):
        raise _unsupported(_FIA, f"input_layout {input_layout!r}")
    raise NpuEmulationError(f"{_FIA}: unknown input_layout {input_layout!r}")


def _head_dim_ok(d: int, n: int, batch: int) -> None:
    _require(d % 16 == 0 and d <= 512, _FIA, f"head dim D must be a multiple of 16 and <= 512 (fp16/bf16), got {d}")
    _require(n <= 256, _FIA, f"N must be <= 256, got {n}")
    _require(batch <= 65536, _FIA, f"B must be <= 65536, got {batch}")


def _lengths(values, batch: int, op_arg: str) -> list[int]:
    """Per-batch lengths: one value for all batches, or at least `batch` values (first `batch` used)."""
    _require(isinstance(values, (list, tuple)) and all(isinstance(v, int) for v in values), _FIA,
             f"{op_arg} must be a list of ints (host values), got {type(values).__name__}")
    _require(len(values) == 1 or len(values) >= batch, _FIA,
             f"{op_arg} must have 1 or >= B ({batch}) entries, got {len(values)}")
    lens = list(values) * batch if len(values) == 1 else list(values[:batch])
    _require(all(v >= 0 for v in lens), _FIA, f"{op_arg} entries must be >= 0")
    return lens


def _check_mask(atten_mask, sparse_mode: int, needed: bool) -> None:
    """sparse_mode 3 takes the compressed 2048x2048 mask, 1/True = masked, upper triangle."""
    if not needed:
        return
    if sparse_mode == 0:
        if atten_mask is not None:
            raise _unsupported(_FIA, "sparse_mode 0 with an explicit atten_mask")
        return
    if sparse_mode != 3:
        raise _unsupported(_FIA, f"sparse_mode {sparse_mode}")
    _require(atten_mask is not None, _FIA, "sparse_mode 3 needs atten_mask (the 2048x2048 compressed mask)")
    _require(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), _FIA,
             f"atten_mask must be bool, int8 or uint8, got {atten_mask.dtype}")
    shape = tuple(atten_mask.shape)
    _require(shape in ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE)), _FIA,
             f"sparse_mode 3 takes atten_mask of shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), "
             f"got {shape}")
    _require(atten_mask.is_contiguous(), _FIA, "atten_mask must be contiguous")
    ref = _checked_masks.get(id(atten_mask))
    if ref is None or ref() is not atten_mask:         # verified once per mask tensor
        want = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=atten_mask.device).triu(1)
        _require(bool(torch.equal(atten_mask.reshape(MASK_SIZE, MASK_SIZE).bool(), want)), _FIA,
                 "sparse_mode 3's atten_mask must be the causal pattern: 1/True (masked) strictly above "
                 "the diagonal, 0/False on and below it")
        _checked_masks[id(atten_mask)] = weakref.ref(atten_mask)


_checked_masks: dict[int, weakref.ref] = {}   # id -> the mask, if still alive (not mutated later)


def _check_paged(op_layout: str, key, block_table, kv_lens: list[int], batch: int, block_size: int,
                 d: int, kv_heads: int, q_s: int) -> None:
    _require(key.dim() == 3, _FIA, f"with {op_layout} the paged cache must be (blocks, block_size, KV_N*D), "
             f"got shape {tuple(key.shape)}")
    nblk, bs, h = key.shape
    _require(block_size == bs, _FIA, f"block_size argument ({block_size}) must equal the cache's block size ({bs})")
    if op_layout == "TND":
        _require(bs % 16 == 0 and bs <= 1024, _FIA, f"TND paged attention needs block_size 16-aligned and <= 1024, "
                 f"got {bs}")
    elif q_s > 1:
        _require(bs % 128 == 0 and 128 <= bs <= 512, _FIA, "paged attention with Q_S > 1 needs block_size in "
                 f"[128, 512] and a multiple of 128, got {bs}")
    else:
        _require(bs % 16 == 0 and bs <= 512, _FIA, f"paged attention with Q_S = 1 needs block_size 16-aligned "
                 f"and <= 512, got {bs}")
    _require(h == kv_heads * d, _FIA, f"cache hidden size ({h}) must be num_key_value_heads ({kv_heads}) x D ({d})")
    _require(h <= 65535, _FIA, f"KV_N*D must be <= 65535 in the (blocks, block_size, H) layout, got {h}")
    _require(block_table.dtype == torch.int32 and block_table.dim() == 2, _FIA,
             f"block_table must be a 2-D int32 tensor, got {block_table.dtype} {tuple(block_table.shape)}")
    _require(block_table.shape[0] == batch, _FIA, f"block_table's first dim must be B ({batch}), "
             f"got {block_table.shape[0]}")
    need = [-(-n // bs) for n in kv_lens]
    _require(block_table.shape[1] >= max(need, default=0), _FIA,
             f"block_table's second dim ({block_table.shape[1]}) is below the blocks the longest actual_seq_kvlen "
             f"needs ({max(need)})")
    _require(nblk >= sum(need), _FIA, f"the cache's block count ({nblk}) is below the sum of blocks each batch's "
             f"actual_seq_kvlen needs ({sum(need)})")
    for b, n in enumerate(need):                   # ids past a sequence's length are never read
        ids = block_table[b, :n]
        _require(bool(((ids >= 0) & (ids < nblk)).all()), _FIA,
                 f"block_table row {b} names blocks outside [0, {nblk}) within its actual_seq_kvlen")
    _require(key.numel() <= INT32_MAX, _FIA, "a paged cache's element count must fit in int32")


def _plan_bsnd(query, key, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table, q_heads, kv_heads,
               sparse_mode, block_size, inner_precise) -> _FiaPlan:
    _require(query.dim() == 4, _FIA, f"BSND query must be (B, S, N, D), got shape {tuple(query.shape)}")
    b, q_s, n, d = query.shape
    _require(n == q_heads, _FIA, f"num_query_heads ({q_heads}) must equal the query's N ({n})")
    _head_dim_ok(d, n, b)
    if q_s == 1:
        _require(inner_precise in (0, 1), _FIA, "inner_precise must be 0 or 1 when Q_S = 1")
    q_lens = _lengths(actual_seq_qlen, b, "actual_seq_qlen") if actual_seq_qlen is not None and q_s > 1 else [q_s] * b
    _require(all(q <= q_s for q in q_lens), _FIA, f"actual_seq_qlen entries must be <= the query's S ({q_s})")
    paged = block_table is not None
    if paged:
        _require(actual_seq_kvlen is not None, _FIA, "paged attention (block_table given) needs actual_seq_kvlen")
        kv_lens = _lengths(actual_seq_kvlen, b, "actual_seq_kvlen")
        _check_paged("BSND", key, block_table, kv_lens, b, block_size, d, kv_heads, q_s)
        kv_s = None
    else:
        _require(key.dim() == 4 and key.shape[0] == b and key.shape[2] == kv_heads and key.shape[3] == d, _FIA,
                 f"BSND key/value must be (B, KV_S, KV_N, D) = ({b}, S, {kv_heads}, {d}), got {tuple(key.shape)}")
        kv_s = key.shape[1]
        kv_lens = _lengths(actual_seq_kvlen, b, "actual_seq_kvlen") if actual_seq_kvlen is not None else [kv_s] * b
        _require(all(k <= kv_s for k in kv_lens), _FIA, f"actual_seq_kvlen entries must be <= the key's S ({kv_s})")
    causal = q_s > 1 and sparse_mode == 3
    _check_mask(atten_mask, sparse_mode, needed=q_s > 1)
    if causal:
        _require(all(k >= q for q, k in zip(q_lens, kv_lens, strict=True)), _FIA,
                 "rightDownCausal with actual_seq_kvlen < actual_seq_qlen leaves query rows nothing to attend "
                 "(undefined on the device with inner_precise 0/1)")
    rows = [(i * q_s, q) for i, q in enumerate(q_lens)]
    starts = [0] * b if paged else [i * kv_s for i in range(b)]
    return _FiaPlan(b, rows, kv_lens, starts, q_heads, kv_heads, d, causal, paged)


def _cumulative(values, op_arg: str) -> list[int]:
    _require(isinstance(values, (list, tuple)) and all(isinstance(v, int) for v in values), _FIA,
             f"TND needs {op_arg} as a list of ints (host values)")
    _require(0 < len(values) <= 4096, _FIA, f"TND {op_arg} must have 1..4096 entries (the batch), got {len(values)}")
    _require(values[0] >= 0 and all(b >= a for a, b in zip(values, values[1:], strict=False)), _FIA,
             f"TND {op_arg} must be cumulative (non-decreasing ends, no negatives), got {list(values)[:8]}...")
    return list(values)


def _plan_tnd(query, key, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table, q_heads, kv_heads,
              sparse_mode, block_size) -> _FiaPlan:
    _require(query.dim() == 3, _FIA, f"TND query must be (T, N, D), got shape {tuple(query.shape)}")
    t, n, d = query.shape
    _require(n == q_heads, _FIA, f"num_query_heads ({q_heads}) must equal the query's N ({n})")
    _require(actual_seq_qlen is not None and actual_seq_kvlen is not None, _FIA,
             "TND needs both actual_seq_qlen and actual_seq_kvlen")
    q_ends = _cumulative(actual_seq_qlen, "actual_seq_qlen")
    _require(q_ends[-1] == t, _FIA, f"TND actual_seq_qlen's last entry ({q_ends[-1]}) must be T ({t})")
    mha = q_heads == kv_heads
    _require(d == 128 or (mha and d == 64), _FIA,
             f"TND without rope needs D = 128 (or 64 for MHA; 192 only with V_D 128), got D = {d}")
    b = len(q_ends)
    q_lens = [e - s for s, e in zip([0] + q_ends[:-1], q_ends, strict=True)]
    paged = block_table is not None
    if paged:          # paged: kv lengths are per batch, not cumulative
        kv_lens = _lengths(actual_seq_kvlen, b, "actual_seq_kvlen")
        _require(len(actual_seq_kvlen) == b, _FIA, f"TND paged actual_seq_kvlen must have B ({b}) entries")
        _check_paged("TND", key, block_table, kv_lens, b, block_size, d, kv_heads, q_s=2)
        starts = [0] * b
    else:
        kv_ends = _cumulative(actual_seq_kvlen, "actual_seq_kvlen")
        _require(len(kv_ends) == b, _FIA, "TND actual_seq_kvlen must have as many entries as actual_seq_qlen")
        _require(key.dim() == 3 and key.shape[0] == kv_ends[-1] and key.shape[1:] == (kv_heads, d), _FIA,
                 f"TND key/value must be (T_kv, KV_N, D) with T_kv = {kv_ends[-1]}, got {tuple(key.shape)}")
        starts = [0] + kv_ends[:-1]
        kv_lens = [e - s for s, e in zip(starts, kv_ends, strict=True)]
    _check_mask(atten_mask, sparse_mode, needed=True)
    causal = sparse_mode == 3
    if causal:
        _require(all(k >= q for q, k in zip(q_lens, kv_lens, strict=True)), _FIA,
                 "rightDownCausal with kv length < q length leaves query rows nothing to attend")
    rows = list(zip([0] + q_ends[:-1], q_lens, strict=True))
    return _FiaPlan(b, rows, kv_lens, starts, q_heads, kv_heads, d, causal, paged)


def _fia_compute(query, key, value, block_table, plan: _FiaPlan, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per batch, rightDownCausal when asked (query i of a batch with
    lengths Q, K attends kv j <= K - Q + i). The arithmetic is torch SDPA in the input dtype,
    the same primitive the CPU platform uses, so the two can agree bit for bit; a device kernel
    rounds its own way. Query rows past a batch's actual_seq_qlen come out NaN (undefined)."""
    d = plan.head_dim
    flat_q = query.reshape(-1, plan.q_heads, d)
    out = torch.full_like(flat_q, float("nan"))
    if plan.paged:
        nblk, bs, _ = key.shape
        k_flat = key.reshape(nblk * bs, plan.kv_heads, d)
        v_flat = value.reshape(nblk * bs, plan.kv_heads, d)
    else:
        k_flat = key.reshape(-1, plan.kv_heads, d)
        v_flat = value.reshape(-1, plan.kv_heads, d)
    if plan.paged and all(q == 1 for _, q in plan.q_rows) and len(plan.q_rows) == flat_q.shape[0]:
        return _paged_single_query(flat_q, k_flat, v_flat, block_table, plan, scale, bs).reshape(query.shape)
    for b, ((q0, q_len), kv_len) in enumerate(zip(plan.q_rows, plan.kv_lens, strict=True)):
        if q_len == 0:
            continue
        if kv_len == 0:                           # empty key/value: the documented result is zeros
            out[q0:q0 + q_len] = 0
            continue
        if plan.paged:
            pos = torch.arange(kv_len, device=query.device)
            slots = block_table[b].long()[pos // bs] * bs + pos % bs
            k, v = k_flat[slots], v_flat[slots]
        else:
            s = plan.kv_starts[b]
            k, v = k_flat[s:s + kv_len], v_flat[s:s + kv_len]
        mask = None
        if plan.causal:
            qi = torch.arange(q_len, device=query.device)[:, None]
            kj = torch.arange(kv_len, device=query.device)[None, :]
            mask = kj <= kv_len - q_len + qi                       # True = attends
        out[q0:q0 + q_len] = F.scaled_dot_product_attention(
            flat_q[q0:q0 + q_len].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    return out.reshape(query.shape)


def _paged_single_query(q, k_flat, v_flat, block_table, plan: _FiaPlan, scale: float, bs: int) -> torch.Tensor:
    """Q_S = 1 over the paged cache, all batches at once: each batch's blocks gathered to the
    longest length, positions past its actual_seq_kvlen masked (never read on the device)."""
    nb = max(-(-n // bs) for n in plan.kv_lens)
    if nb == 0:
        return torch.zeros_like(q)
    b = q.shape[0]
    pos = torch.arange(nb * bs, device=q.device)
    slots = block_table[:, :nb].long().clamp(min=0).repeat_interleave(bs, dim=1) * bs + pos % bs
    keys, values = k_flat[slots], v_flat[slots]                        # [B, S, KV_N, D]
    lens = torch.tensor(plan.kv_lens, device=q.device)
    mask = pos[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True).squeeze(2)
    return out.masked_fill((lens == 0)[:, None, None], 0).reshape(b, *q.shape[1:])


def npu_fused_infer_attention_score_v2(
        query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, dequant_scale_query=None,
        dequant_scale_key=None, dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None,
        dequant_scale_key_rope=None, quant_scale_out=None, quant_offset_out=None, quant_scale_p=None,
        learnable_sink=None, num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0, pre_tokens=2147483647,
        next_tokens=2147483647, input_layout="BSH", sparse_mode=0, block_size=0, query_quant_mode=0,
        key_quant_mode=0, value_quant_mode=0, inner_precise=0, return_softmax_lse=False, query_dtype=None,
        key_dtype=None, value_dtype=None, query_rope_dtype=None, key_rope_dtype=None, key_shared_prefix_dtype=None,
        value_shared_prefix_dtype=None, dequant_scale_query_dtype=None, dequant_scale_key_dtype=None,
        dequant_scale_value_dtype=None, dequant_scale_key_rope_dtype=None, out_dtype=None):
    """Emulated FIA v2 (BSND and TND, paged or not, sparse_mode 0 without mask or 3) ->
    (attention_out, softmax_lse); softmax_lse is the documented [1] zeros (no lse asked)."""
    extra = dict(locals())
    plan = _fia_validate(query, key, value, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                         num_query_heads, num_key_value_heads, softmax_scale, input_layout, sparse_mode, block_size,
                         inner_precise, return_softmax_lse, extra)
    out = _fia_compute(query, key, value, block_table, plan, softmax_scale)
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def _fia_out(query, key, value, *, workspace=None, out=None, **kwargs):
    """Emulated `.out` variant: writes attention_out into out[0]; out[1] (lse) is left alone."""
    _require(isinstance(out, (list, tuple)) and len(out) == 2, _FIA + ".out", "out must be [attention_out, lse]")
    _require(out[0].shape == query.shape and out[0].dtype == query.dtype, _FIA + ".out",
             f"out[0] must have the query's shape {tuple(query.shape)} and dtype {query.dtype}")
    _require(workspace is None or isinstance(workspace, torch.Tensor), _FIA + ".out", "workspace must be a tensor")
    result, _ = npu_fused_infer_attention_score_v2(query, key, value, **kwargs)
    out[0].copy_(result)
    return out


def _fia_workspace(query, key, value, **kwargs) -> torch.Tensor:
    """Emulated _npu_fused_infer_attention_score_v2_get_max_workspace: takes the op's own
    arguments, validates them as the op does, returns a 1-byte placeholder (size not modelled)."""
    bound = inspect.signature(npu_fused_infer_attention_score_v2).bind(query, key, value, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    _fia_validate(query, key, value, a["atten_mask"], a["actual_seq_qlen"], a["actual_seq_kvlen"], a["block_table"],
                  a["num_query_heads"], a["num_key_value_heads"], a["softmax_scale"], a["input_layout"],
                  a["sparse_mode"], a["block_size"], a["inner_precise"], a["return_softmax_lse"], a)
    return torch.empty(1, dtype=torch.uint8, device=query.device)


# -- KV cache store -------------------------------------------------------------------------------
def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """Emulated ATB ReshapeAndCache: key/value (T, KV_N, D) into caches (blocks, block_size,
    KV_N, D) at flat slots block_id * block_size + offset (int32), in place; slot -1 is skipped
    (the padding convention npu.py relies on; see docs/npu.md)."""
    op = "_npu_reshape_and_cache"
    _require(key.dim() == 3 and key.shape == value.shape, op,
             f"key/value must both be (T, KV_N, D), got {tuple(key.shape)} and {tuple(value.shape)}")
    _require(key_cache.dim() == 4 and key_cache.shape == value_cache.shape, op,
             f"caches must both be (blocks, block_size, KV_N, D), got {tuple(key_cache.shape)} and "
             f"{tuple(value_cache.shape)}")
    _require(key.shape[1:] == key_cache.shape[2:], op, f"key's (KV_N, D) {tuple(key.shape[1:])} must match the "
             f"cache's {tuple(key_cache.shape[2:])}")
    _require(key.dtype == key_cache.dtype and value.dtype == value_cache.dtype, op,
             f"key/value dtype ({key.dtype}) must match the cache dtype ({key_cache.dtype})")
    _require(key_cache.is_contiguous() and value_cache.is_contiguous(), op, "caches must be contiguous (ND)")
    _require(slot_indices.dtype == torch.int32 and slot_indices.dim() == 1, op,
             f"slot_indices must be 1-D int32, got {slot_indices.dtype} {tuple(slot_indices.shape)}")
    _require(slot_indices.shape[0] == key.shape[0], op, f"one slot per token: {slot_indices.shape[0]} slots "
             f"for {key.shape[0]} tokens")
    capacity = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.long()
    _require(bool(((slots >= -1) & (slots < capacity)).all()), op,
             f"slots must be in [0, {capacity}) (or -1 for a padding row)")
    keep = slots >= 0
    slots = slots[keep]
    _require(slots.unique().numel() == slots.numel(), op, "two tokens write the same slot (order undefined)")
    key_cache.view(capacity, *key_cache.shape[2:]).index_copy_(0, slots, key[keep])
    value_cache.view(capacity, *value_cache.shape[2:]).index_copy_(0, slots, value[keep])


# -- fused layer ops -------------------------------------------------------------------------------
_NORM_DTYPES = {(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                (torch.float16, torch.float32), (torch.bfloat16, torch.float32)}


def _rms(x32: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dims = tuple(range(x32.dim() - gamma.dim(), x32.dim()))
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + eps)
    return x32 * rstd * gamma.float(), rstd


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """Emulated RmsNorm -> (y, rstd): y in self's dtype, rstd float32 with the normed dims kept as 1."""
    op = "npu_rms_norm"
    _require(2 <= self.dim() <= 8, op, f"self must have 2..8 dims, got {self.dim()}")
    _require(1 <= gamma.dim() < self.dim() + 1 and tuple(self.shape[self.dim() - gamma.dim():]) == tuple(gamma.shape),
             op, f"gamma's shape {tuple(gamma.shape)} must equal self's trailing dims {tuple(self.shape)}")
    _require((self.dtype, gamma.dtype) in _NORM_DTYPES, op,
             f"(self, gamma) dtypes ({self.dtype}, {gamma.dtype}) are not a documented pair")
    y, rstd = _rms(self.float(), gamma, epsilon)
    return y.to(self.dtype), rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """Emulated AddRmsNorm -> (y, rstd, x1 + x2); the sum is normed before rounding (float32)."""
    op = "npu_add_rms_norm"
    _require(1 <= x1.dim() <= 8 and x1.shape == x2.shape, op,
             f"x1 and x2 must have the same shape (1..8 dims), got {tuple(x1.shape)} and {tuple(x2.shape)}")
    _require(x1.dtype in (torch.float16, torch.bfloat16, torch.float32), op, f"x1 dtype {x1.dtype} unsupported")
    _require(x2.dtype == x1.dtype and gamma.dtype == x1.dtype, op,
             f"x2 and gamma must have x1's dtype {x1.dtype} (single-op mode), got {x2.dtype}, {gamma.dtype}")
    _require(tuple(x1.shape[x1.dim() - gamma.dim():]) == tuple(gamma.shape), op,
             f"gamma's shape {tuple(gamma.shape)} must equal x1's trailing dims {tuple(x1.shape)}")
    s = x1.float() + x2.float()
    y, rstd = _rms(s, gamma, epsilon)
    return y.to(x1.dtype), rstd, s.to(x1.dtype)


_ROTARY_LAYOUTS = {            # 4-D layouts of npu_rotary_mul's input: (B, N) axes, allowed cos/sin shapes
    "BNSD": ((0, 1), ("11SD", "B1SD", "BNSD")),
    "BSND": ((0, 2), ("1S1D", "BS1D", "BSND")),
    "SBND": ((1, 2), ("S11D", "SB1D", "SBND")),
}


def _rotary_shape_ok(x_shape, r_shape) -> bool:
    if len(x_shape) == 3:                                  # TND: T1D or TND
        return r_shape in ((x_shape[0], 1, x_shape[2]), tuple(x_shape))
    for layout, ((bi, ni), patterns) in _ROTARY_LAYOUTS.items():
        if x_shape[bi] >= 1000 or x_shape[ni] >= 1000:
            continue
        for pattern in patterns:
            want = tuple(1 if c == "1" else x_shape[layout.index(c)] for c in pattern)
            if tuple(r_shape) == want:
                return True
    return False


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """Emulated RotaryMul, half mode: input * r1 + rotate_half(input) * r2 (float32, cast back)."""
    op = "npu_rotary_mul"
    if rotary_mode != "half":
        raise _unsupported(op, f"rotary_mode {rotary_mode!r}")
    if rotate is not None:
        raise _unsupported(op, "rotate")
    _require(input.dim() in (3, 4) and r1.dim() == input.dim() and r1.shape == r2.shape, op,
             f"input must be 3-D or 4-D with r1/r2 of the same rank and equal shapes, got "
             f"{tuple(input.shape)}, {tuple(r1.shape)}, {tuple(r2.shape)}")
    d = input.shape[-1]
    _require(d % 2 == 0 and d < 896, op, f"D must be even and < 896, got {d}")
    for t in (input, r1, r2):
        _require(t.dtype in (torch.float16, torch.bfloat16, torch.float32), op, f"dtype {t.dtype} unsupported")
    _require(_rotary_shape_ok(tuple(input.shape), tuple(r1.shape)), op,
             f"cos/sin shape {tuple(r1.shape)} is not a documented broadcast of input {tuple(input.shape)} "
             "(BSND: 1S1D, BS1D, BSND; BNSD: 11SD, B1SD, BNSD; SBND: S11D, SB1D, SBND; TND: T1D, TND; B, N < 1000)")
    x = input.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * r1.float() + torch.cat((-x2, x1), dim=-1) * r2.float()).to(input.dtype)


def npu_swiglu(input, dim=-1):
    """Emulated SwiGLU: silu(first half along dim) * second half (float32, cast back)."""
    op = "npu_swiglu"
    _require(1 <= input.dim() <= 8, op, f"input must have 1..8 dims, got {input.dim()}")
    _require(input.dtype in (torch.float16, torch.bfloat16, torch.float32), op, f"dtype {input.dtype} unsupported")
    _require(input.shape[dim] % 2 == 0, op, f"the split dim must have even size, got {input.shape[dim]}")
    a, b = input.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)


# -- runtime: torch_npu.npu (torch.npu) -------------------------------------------------------------
class _Stream:
    """Streams are not modelled; this stands for the current stream in graph-task calls."""


_STREAM = _Stream()


@dataclass(frozen=True, slots=True)
class _PoolHandle:
    graph_id: int


class EmulatedNPUGraph:
    """Emulated torch.npu.NPUGraph: see the module docstring for what recording models."""

    def __init__(self):
        self._tasks: list = []
        self._captured = False
        self._pool = _PoolHandle(id(self))
        self._modes: tuple = ()

    def capture_begin(self, pool=None, capture_error_mode="global"):
        _require(_state.graph is None, "NPUGraph.capture_begin", "another capture is already under way")
        _require(pool is None or isinstance(pool, _PoolHandle), "NPUGraph.capture_begin",
                 f"pool must come from graph_pool_handle() or another graph's pool(), got {pool!r}")
        _require(capture_error_mode in ("global", "thread_local", "relaxed"), "NPUGraph.capture_begin",
                 f"capture_error_mode must be global, thread_local or relaxed, got {capture_error_mode!r}")
        self._tasks, self._captured = [], False
        _state.graph, _state.group_start = self, None
        self._modes = (_HostReadGuard(), _Recorder())
        for mode in self._modes:
            mode.__enter__()

    def capture_end(self):
        _require(_state.graph is self, "NPUGraph.capture_end", "this graph is not capturing")
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        _state.graph, self._modes = None, ()
        _require(_state.group_start is None, "NPUGraph.capture_end", "a graph task group was begun and not ended")
        self._captured = True

    def replay(self):
        _require(self._captured, "NPUGraph.replay", "nothing captured (capture_end not reached, or reset)")
        _require(_state.graph is None and _state.update is None, "NPUGraph.replay",
                 "replay during a capture or a task update")
        with torch.inference_mode():
            for task in self._tasks:
                task.run()

    def reset(self):
        self._tasks, self._captured = [], False

    def pool(self):
        return self._pool


class _GraphContext:
    """Emulated torch.npu.graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
    capture_error_mode="global")."""

    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global"):
        _require(isinstance(npu_graph, EmulatedNPUGraph), "graph", "npu_graph must be an NPUGraph")
        if auto_dispatch_capture:
            raise _unsupported("graph", "auto_dispatch_capture=True")
        self.npu_graph, self.pool, self.mode = npu_graph, pool, capture_error_mode

    def __enter__(self):
        self.npu_graph.capture_begin(self.pool, capture_error_mode=self.mode)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and _state.graph is self.npu_graph:     # unwind, keep the real error
            for mode in reversed(self.npu_graph._modes):
                mode.__exit__(exc_type, exc, tb)
            _state.graph, self.npu_graph._modes, _state.group_start = None, (), None
            return None
        self.npu_graph.capture_end()
        return None


def _group_begin(stream):
    _require(_state.graph is not None, "graph_task_group_begin", "called outside a graph capture")
    _require(_state.group_start is None, "graph_task_group_begin", "task groups do not nest")
    _state.group_start = len(_state.graph._tasks)


def _group_end(stream) -> _TaskGroup:
    _require(_state.graph is not None and _state.group_start is not None, "graph_task_group_end",
             "no task group was begun in this capture")
    tasks = [t for t in _state.graph._tasks[_state.group_start:] if isinstance(t, _KernelTask)]
    _state.group_start = None
    _require(bool(tasks), "graph_task_group_end", "the group captured no torch_npu op")
    return _TaskGroup(_state.graph, tasks)


def _update_begin(stream, handle):
    _require(isinstance(handle, _TaskGroup), "graph_task_update_begin", "handle must come from graph_task_group_end")
    _require(_state.graph is None and _state.update is None, "graph_task_update_begin",
             "updates happen outside capture, one at a time")
    _state.update, _state.update_calls = handle, []


def _update_end(stream):
    op = "graph_task_update_end"
    group, calls = _state.update, _state.update_calls
    _require(group is not None, op, "no update was begun")
    _state.update, _state.update_calls = None, []
    _require(len(calls) == len(group.tasks), op, f"the update re-issued {len(calls)} ops for a group of "
             f"{len(group.tasks)}")
    for task, (fn, args, kwargs) in zip(group.tasks, calls, strict=True):
        _require(fn is task.fn, op, f"the update re-issued {fn.__name__}, the group captured {task.fn.__name__}")
        same = len(args) == len(task.args) and all(
            _same_tensors(a, b) for a, b in zip(task.args, args, strict=True)) and all(
            _same_tensors(task.kwargs.get(k), kwargs.get(k)) for k in set(task.kwargs) | set(kwargs))
        _require(same, op, "an update may change host arguments only; pass the captured tensors again")
        task.args = tuple(_frozen(a) for a in args)
        task.kwargs = {k: _frozen(v) for k, v in kwargs.items()}


def _same_tensors(old, new) -> bool:
    a, b = _tensors(old), _tensors(new)
    return len(a) == len(b) and all(x.data_ptr() == y.data_ptr() and x.shape == y.shape
                                    for x, y in zip(a, b, strict=True))


def _host_memory(device=None) -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")


def _set_device(device) -> None:
    """Nothing to bind on the host; takes what torch.npu.set_device takes (an index or a device)."""
    ok = isinstance(device, torch.device) or (isinstance(device, int) and device >= 0)
    _require(ok, "set_device", f"device must be an int >= 0 or a torch.device, got {device!r}")


def _device(index: int) -> torch.device:
    """The emulated npu:N is the host CPU: tensors live in host memory, nothing is offloaded."""
    _set_device(index)
    return torch.device("cpu")


def emulated_torch_npu() -> SimpleNamespace:
    """A stand-in for the torch_npu module as npu.py uses it: fused ops at the top level, the
    runtime (what torch_npu.npu / torch.npu provide) under `.npu`, and `device(index)`, which
    has no torch_npu counterpart (npu.py builds torch.device("npu", i) itself on a real host)."""
    fia = _kernel(npu_fused_infer_attention_score_v2)
    fia.out = _kernel(_fia_out)
    runtime = SimpleNamespace(
        NPUGraph=EmulatedNPUGraph, graph=_GraphContext, graph_pool_handle=lambda: _PoolHandle(0),
        synchronize=lambda device=None: None, mem_get_info=_host_memory, set_device=_set_device,
        device_count=lambda: 1, current_stream=lambda device=None: _STREAM,
        is_current_stream_capturing=lambda: _state.graph is not None,
        graph_task_group_begin=_group_begin, graph_task_group_end=_group_end,
        graph_task_update_begin=_update_begin, graph_task_update_end=_update_end,
    )
    return SimpleNamespace(
        EMULATED=True,
        npu_fused_infer_attention_score_v2=fia,
        _npu_fused_infer_attention_score_v2_get_max_workspace=_kernel(_fia_workspace),
        _npu_reshape_and_cache=_kernel(_npu_reshape_and_cache),
        npu_rms_norm=_kernel(npu_rms_norm),
        npu_add_rms_norm=_kernel(npu_add_rms_norm),
        npu_rotary_mul=_kernel(npu_rotary_mul),
        npu_swiglu=_kernel(npu_swiglu),
        npu=runtime,
        device=_device,
    )
