"""The tensor-parallel all-reduce of small tensors on CUDA, over symmetric (peer-mapped) memory.

Each rank holds one buffer that every other rank has mapped; one kernel per rank copies its partial
sums into its own buffer, waits for the peers, and reads and adds every rank's buffer over NVLink
(torch's `symm_mem::one_shot_all_reduce_copy_out`). At a decode step's sizes (2 MiB for an 8B model
at batch 256) that is a few microseconds against NCCL's tens; larger tensors (prefill activations)
keep NCCL's ring. `choose` decides once at engine start (`--all-reduce`); `TPInfo.all_reduce` routes.
Where a decoder layer's RMSNorm follows the all-reduce, one kernel of our own does both (and the residual
add between them): models/layers/all_reduce_norm.py, through `TPInfo.reduce_add_rms_norm`.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("baton.models")

WORLD_SIZES = (2, 4, 8)         # the one-shot kernel's specialised rank counts
# one-shot reads world x bytes on every rank: above these, NCCL's ring (2x bytes) is as fast or faster
MAX_BYTES = {2: 8 << 20, 4: 4 << 20, 8: 2 << 20}
DTYPES = (torch.bfloat16, torch.float32)        # the kernel's; float16 goes to NCCL
NORM_DTYPE = torch.bfloat16    # the fused kernel's (its slots are emptied for one dtype's values)
ALIGN = 16                      # the kernel's widest vector: the size and offset it needs for full speed
_logged: set[str] = set()
# groups this process has rendezvoused on: torch sets symmetric memory up once per process, and a second
# engine's rendezvous here (a new group after the first was destroyed) hangs against fresh peers
_opened: list[str] = []


class SymmMemAllReduce:
    """Sums a tensor over the ranks through `buffer` (this rank's symmetric allocation, rendezvoused
    on `group_name`); tensors that do not `fit` go to torch.distributed instead."""

    def __init__(self, buffer: torch.Tensor, group_name: str, reduce=None, fused_norm=None,
                 max_bytes: int | None = None, norm_dtype: torch.dtype = NORM_DTYPE):
        self.buffer, self.group_name = buffer, group_name
        # the largest tensor it takes: the buffer's first max_bytes are the one-shot's (the rest, the fused kernel's)
        self.max_bytes = max_bytes or buffer.numel() * buffer.element_size()
        self._reduce = reduce or _one_shot          # (symm view, local x, group name, out) -> out
        # (x, residual, weight, eps) -> (rms_norm(sum + residual), sum + residual); None: not fused here
        self.fused_norm, self.norm_dtype = fused_norm, norm_dtype    # (the dtype its slots were emptied for)
        self.why_unfused = "not set up" if fused_norm is None else None

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in DTYPES and x.device == self.buffer.device and x.is_contiguous()
                and 0 < nbytes <= self.max_bytes and nbytes % ALIGN == 0
                and x.storage_offset() * x.element_size() % ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """A new tensor: the sum of every rank's `x`, the same on all of them."""
        symm = self.buffer.view(x.dtype)[: x.numel()].view(x.shape)
        return self._reduce(symm, x, self.group_name, torch.empty_like(x))

    def fits_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Can `add_rms_norm` take these (else: this all-reduce, then the platform's add-RMSNorm)?"""
        return (self.fused_norm is not None and x.dtype == self.norm_dtype and self.fits(x) and x.dim() == 2
                and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous() and weight.dtype == x.dtype
                and weight.shape == x.shape[-1:])

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(all-reduced x + residual), all-reduced x + residual), in one kernel."""
        return self.fused_norm(x, residual, weight, eps)


def _one_shot(symm: torch.Tensor, x: torch.Tensor, group_name: str, out: torch.Tensor) -> torch.Tensor:
    # one kernel: x into this rank's buffer, a barrier on the peers' signal pads, the sum of all
    # buffers (in rank order, so every rank gets the same bits) into out, and a barrier again, so the
    # next call may overwrite the buffer; launch-only on the host, hence capturable in CUDA graphs
    return torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, x, "sum", group_name, out)


def unavailable(names: list[str], deterministic: bool = False, need_nvlink: bool = True) -> str | None:
    """Why the ranks on devices `names` (one per rank, in rank order: cuda:0, ...) cannot take the
    symmetric-memory all-reduce; None: they can."""
    kind = names[0].partition(":")[0]
    if kind != "cuda":
        return f"the ranks are on {kind}, and symmetric memory is CUDA's"
    devices = [torch.device(d) for d in names]
    if len(devices) not in WORLD_SIZES:
        return f"{len(devices)} ranks, and the one-shot kernel is built for {', '.join(map(str, WORLD_SIZES))}"
    if len(set(devices)) < len(devices):
        return "two ranks share a device"
    if deterministic:
        return "--deterministic keeps NCCL's fixed reduction"
    if not _has_symm_mem():
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out"
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"{a} cannot map {b}'s memory (no peer access between them)"
            if a != b and need_nvlink and _nvlink(a, b) is False:
                return f"{a} and {b} are not NVLink peers (PCIe only; NCCL is as fast there)"
    return None


def _has_symm_mem() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")


def _nvlink(a: torch.device, b: torch.device) -> bool | None:
    """NVML's word on an NVLink between the two GPUs; None where NVML is not installed or cannot say."""
    try:
        import pynvml
        pynvml.nvmlInit()
        ha, hb = (pynvml.nvmlDeviceGetHandleByPciBusId_v2(_pci_bus_id(d)) for d in (a, b))
        return pynvml.nvmlDeviceGetP2PStatus(ha, hb, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK
    except Exception:               # no pynvml, an old driver, a property this torch lacks: unknown
        return None


def _pci_bus_id(device: torch.device) -> str:
    p = torch.cuda.get_device_properties(device)
    return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"


def choose(mode: str, group, rank: int, devices: list[str], deterministic: bool = False,
           backend: str = "nccl") -> SymmMemAllReduce | None:
    """The all-reduce of `--all-reduce mode` for this rank of `group` (devices: every rank's, in rank
    order, e.g. cuda:0, cuda:1): a SymmMemAllReduce, or None for torch.distributed's (`backend`). Every rank decides
    alike, from the same facts, so they all rendezvous or none does. `symm` where it cannot run is a
    RuntimeError that says what to do; `auto` falls back and logs why, once."""
    if mode == "nccl":
        _log_once(rank, f"all-reduce: {backend} (--all-reduce nccl)")
        return None
    reason = unavailable(devices, deterministic, need_nvlink=mode == "auto")
    if reason is None:                       # (every rank gets here, or none does: the same facts)
        reason = _first_in_every_process(group, torch.device(devices[rank]))
    if reason is None:
        try:
            reducer, reason = _open(group, torch.device(devices[rank]), MAX_BYTES[len(devices)],
                                    fuse_norm=mode != "symm-unfused")
        except RuntimeError as e:            # the allocation, the mapping or the probe's kernel
            reducer, reason = None, f"setting up symmetric memory failed: {e}"
        if reducer is not None:
            fused = ("fused with the RMSNorm after it" if reducer.fused_norm is not None
                     else f"not fused with the RMSNorm after it ({reducer.why_unfused})")
            _log_once(rank, f"all-reduce: one-shot over symmetric memory up to {reducer.max_bytes >> 20} MiB, "
                            f"{backend} above; {fused}")
            return reducer
    if mode.startswith("symm"):
        raise RuntimeError(f"--all-reduce {mode} cannot run here: {reason}. Serve with --all-reduce auto (which "
                           f"falls back by itself) or --all-reduce nccl")
    _log_once(rank, f"all-reduce: {backend}, not symmetric memory: {reason}")
    return None


def _first_in_every_process(group, device: torch.device) -> str | None:
    """None if no rank's process has set symmetric memory up before (one all-reduce of the answer, so
    the ranks agree); else why not now."""
    import torch.distributed as dist
    fresh = torch.tensor([0 if _opened else 1], dtype=torch.int32, device=device)
    dist.all_reduce(fresh, op=dist.ReduceOp.MIN, group=group)
    if int(fresh.item()):
        return None
    return ("an earlier engine in this process set symmetric memory up, and torch cannot set it up again "
            "for a new group (one engine per process serves it)")


def _open(group, device: torch.device, max_bytes: int,
          fuse_norm: bool = True) -> tuple[SymmMemAllReduce | None, str | None]:
    """This rank's buffer, mapped by every peer (a collective), checked by one all-reduce of known sums;
    with fuse_norm, the fused all-reduce + RMSNorm too (checked alike), where it can run."""
    import torch.distributed._symmetric_memory as symm_mem
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")     # peer loads only: no NVLink multicast
    name = group.group_name
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 11):
        symm_mem.enable_symm_mem_for_group(name)       # torch 2.11 resolves the group's store by itself
    world, rank = group.size(), group.rank()
    fused_kernel, why_unfused = None, "--all-reduce symm-unfused"
    if fuse_norm:
        try:
            from baton.models.layers import all_reduce_norm as fused_kernel
        except ImportError as e:             # no triton
            why_unfused = f"no Triton ({e})"
    # the one-shot's region, then the fused kernel's slots (models/layers/all_reduce_norm.py), emptied before
    # any peer can write them: the probe's one-shot below is a barrier every rank reaches after its own fill
    size = max_bytes if fused_kernel is None else fused_kernel.buffer_bytes(max_bytes, world)
    buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
    if fused_kernel is not None:
        fused_kernel.empty_slots(buffer, max_bytes, NORM_DTYPE)
    _opened.append(name)
    handle = symm_mem.rendezvous(buffer, name)
    reducer = SymmMemAllReduce(buffer, name, max_bytes=max_bytes)
    probe = torch.full((4096,), float(rank + 1), dtype=torch.bfloat16, device=device)
    got = reducer(probe)
    want = float(world * (world + 1) // 2)
    if not bool((got == want).all()):
        return None, f"a probe all-reduce summed to {got[0].item()}, not {want}"
    reducer.why_unfused = why_unfused
    if fused_kernel is not None:
        reducer.fused_norm, reducer.why_unfused = _fused_norm(fused_kernel, handle, device, world, rank, max_bytes)
    return reducer, None


def _fused_norm(fused_kernel, handle, device: torch.device, world: int, rank: int, max_bytes: int):
    """The fused all-reduce + add + RMSNorm (`fused_kernel`, models/layers/all_reduce_norm.py) over `handle`'s
    buffers, checked by one call on known values (every rank makes it alike: the same facts); (None, why) where
    it did not sum right."""
    # at most one program an SM: every program resident at once, so none waits on a peer's row whose
    # writer is not running
    programs = min(fused_kernel.MAX_PROGRAMS, torch.cuda.get_device_properties(device).multi_processor_count)
    bufs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
    calls = torch.zeros(2, dtype=torch.int32, device=device)      # the kernel's count of its calls, and tickets

    def fused(x, residual, weight, eps):       # (programs: read by the CUDA test's table)
        return fused_kernel.all_reduce_add_rms_norm(x, residual, weight, eps, bufs, calls, rank, world,
                                                    max_bytes=max_bytes, max_programs=programs)
    fused.programs = programs

    rows, n = 3, 4096
    x = torch.full((rows, n), float(rank + 1), dtype=NORM_DTYPE, device=device)
    ones = torch.ones((rows, n), dtype=NORM_DTYPE, device=device)
    out, total = fused(x, ones, ones[0], 1e-6)
    want = float(world * (world + 1) // 2 + 1)
    if not (bool((total == want).all()) and bool((out == 1).all())):
        return None, f"a probe summed to {total[0, 0].item()} and normed to {out[0, 0].item()}, not {want} and 1"
    return fused, None


def install(model: torch.nn.Module, reducer: SymmMemAllReduce) -> None:
    """Every tensor-parallel layer of `model` reduces its small tensors through `reducer`."""
    for module in model.modules():
        tp = getattr(module, "tp", None)
        if getattr(tp, "size", 1) > 1 and hasattr(tp, "custom_all_reduce"):
            tp.custom_all_reduce = reducer
    if getattr(reducer, "fused_norm", None) is not None:
        for module in model.modules():
            if hasattr(module, "fuse_reduced_norms"):       # models/decoder.py: DecoderModel
                module.fuse_reduced_norms()


def _log_once(rank: int, message: str) -> None:
    if rank == 0 and message not in _logged:
        _logged.add(message)
        log.info(message)
