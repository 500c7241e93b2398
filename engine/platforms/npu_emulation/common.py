"""What every part of the NPU emulation shares: its error and the documented limits."""
from __future__ import annotations

import torch

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
