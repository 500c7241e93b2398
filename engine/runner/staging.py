"""Host staging for small host -> device copies: two pinned buffers used in turn, so the host
fills one while the other's copy is still in flight. A buffer is rewritten only after its last
copy has completed (an event recorded when the copy was queued). On the CPU nothing is pinned
and nothing waits."""
from __future__ import annotations

import numpy as np
import torch


class StagingPair:
    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type != "cpu"
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.events: list = [None, None]
        self.turn = 0

    def next_buffer(self) -> int:
        """The index of the buffer to fill now, once its previous copy has left it."""
        i, self.turn = self.turn, self.turn ^ 1
        if self.events[i] is not None:
            self.events[i].synchronize()
        return i

    def copy_queued(self, i: int) -> None:
        """Buffer i's copy to the device was just queued: it is not rewritten before that completes."""
        event = self.events[i] = self.events[i] or torch.Event(self.device)
        event.record()


class HostUpload(StagingPair):
    """Moves a step's small host arrays to the device in one copy.

    Each array is packed, 64-byte aligned, into a pinned staging buffer (Triton specializes
    kernels on 16-byte pointer alignment: a view at an odd offset would compile a new variant); one non-blocking copy
    moves the lot; the device tensors are views of that one allocation. Two staging buffers
    alternate, and a buffer is rewritten only after its last copy has completed (an event),
    so the host can prepare step N+1 while step N's copy is still in flight (engine/runner/staging.py).
    On the CPU the arrays are wrapped as they are.
    """

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if not self.pinned:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // ALIGN) * ALIGN
        i = self.next_buffer()                              # its previous copy has left the buffer
        buf = self.buffers[i]
        if buf is None or buf.numel() < total:
            buf = self.buffers[i] = torch.empty(max(total, 1 << 16) * 2, dtype=torch.uint8, pin_memory=True)
        host = buf.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            host[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        dev = buf[:max(total, ALIGN)].to(self.device, non_blocking=True)
        self.copy_queued(i)
        out = []
        for a, off in zip(arrays, offsets, strict=True):
            dtype = _TORCH_OF[a.dtype.type]
            out.append(dev[off:off + a.nbytes].view(dtype).view(a.shape))
        return out


ALIGN = 64
_TORCH_OF = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32, np.bool_: torch.bool}
