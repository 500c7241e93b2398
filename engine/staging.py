"""Host staging for small host -> device copies: two pinned buffers used in turn, so the host
fills one while the other's copy is still in flight. A buffer is rewritten only after its last
copy has completed (an event recorded when the copy was queued). On the CPU nothing is pinned
and nothing waits."""
from __future__ import annotations

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
