"""Platform selection by device string: `cpu`, `cuda[:N]`, `npu[:N]`."""
from __future__ import annotations

import torch

from baton.engine.config import PlatformOptions
from baton.engine.platforms.base import LayerOps, Platform


def get_platform(device: str = "cpu", options: PlatformOptions | None = None) -> Platform:
    options = options or PlatformOptions()
    kind, _, index = device.partition(":")
    if index and not index.isdigit():
        raise ValueError(f"bad device {device!r}: use cpu, cuda:N or npu:N")
    if kind == "cpu":
        from baton.engine.platforms.cpu import CpuPlatform
        return CpuPlatform(torch.device("cpu"))
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU; use --device cpu")
        from baton.engine.platforms.cuda import CudaPlatform
        return CudaPlatform(torch.device("cuda", int(index or 0)), options.fused_ops)
    if kind == "npu":
        from baton.engine.platforms.npu import NpuPlatform
        return NpuPlatform.create(int(index or 0), options)
    raise ValueError(f"unknown device {device!r}: use cpu, cuda:N or npu:N")


__all__ = ["LayerOps", "Platform", "PlatformOptions", "get_platform"]
