"""The paged KV cache the runner owns: how many blocks (exactly as asked, else from a memory budget),
the cache itself on the device (the model's layers, plus an EAGLE-3 head's one), a float8 cache's
scales (fixed at load), and its blocks packed for, or written from, a KV transfer.
"""
from __future__ import annotations

import torch

from baton.engine.config import EngineConfig
from baton.engine.kv_handoff import InPlace
from baton.engine.platforms import Platform
from baton.engine.platforms.base import is_fp8
from baton.engine.runner import kv_checksum, kv_scales
from baton.engine.runner.kv_blocks import Pieces, _as_uint8, _block_index, parts_of, unpack_blocks
from baton.models.forward_context import AttentionBackend

CPU_KV_CACHE_MAX = 1 << 30              # the CPU's default KV cache: sized to the model, at most this


def cpu_kv_cache_default(weight_bytes: int, one_sequence_bytes: int) -> int:
    """The CPU's KV cache when none is asked for: as many bytes as the weights (a small model
    gets a small cache), room for at least one sequence of the full context, at most CPU_KV_CACHE_MAX."""
    return min(CPU_KV_CACHE_MAX, max(weight_bytes, one_sequence_bytes))


class KVCache:
    """[layers, 2, num_blocks, block_size, kv_heads, head_dim] on the platform's device; `layers`: each
    layer's (K, V) views, what a forward reads; `scales`: [model layers, 2, kv_heads] float32 or None."""

    def __init__(self, config: EngineConfig, platform: Platform, model: torch.nn.Module, hf_config,
                 num_layers: int, dtype: torch.dtype, attention: AttentionBackend, scale: float, tp_group=None):
        self.platform = platform
        self.block_size = config.block_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.num_kv_heads, self.head_dim = model.num_kv_heads, model.head_dim
        platform.check_kv_layout(self.block_size, self.head_dim, dtype)
        self.num_blocks = self._size(config, model, hf_config, tp_group)
        self.tensor = platform.allocate_kv_cache(num_layers, self.num_blocks, self.block_size, self.num_kv_heads,
                                                 self.head_dim, dtype)
        self.layers = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(num_layers)]
        # a float8 cache's K and V scales per (layer, kv head), fixed from here on (graphs read them)
        self.scales = self._scales(config, model, hf_config, attention, scale)
        self.scales_checksum = kv_scales.checksum(self.scales)     # what the KV handshake compares

    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def pack(self, block_ids: list[int], first_block: int = 0, so_far: kv_checksum.Proof | None = None):
        """(a contiguous uint8 copy of these blocks on the device; the event after which it is final,
        None on the CPU; the transfer's checksum through them, a Proof). They are blocks
        [first_block, first_block + len) of a transfer whose earlier pieces' checksum is `so_far`.
        Queued on the engine's stream, so later steps cannot overwrite the blocks before the copy
        has read them; the checksum's sums are taken in the same pass where the platform can."""
        # the running total, on the device: each piece's checksum is added to it in place (its last value was
        # copied to the host already, in stream order, for the piece before)
        total = so_far.total if so_far is not None else torch.zeros(2, dtype=torch.int64, device=self.tensor.device)
        data = self.platform.pack_kv(self.tensor, _block_index(self.tensor, block_ids), total, first_block)
        host = total.to("cpu", non_blocking=True, copy=True)     # (page-locked from a device: final after the event)
        ready = self.platform.record_event()
        return data, ready, kv_checksum.Proof(total, host, ready)

    def write(self, block_ids: list[int], payload) -> None:
        """Copy a transferred payload (bytes, a uint8 tensor, or Pieces) into these blocks."""
        unpack_blocks(self.tensor, block_ids, payload)

    def land(self, block_ids: list[int], payload, prove: bool) -> kv_checksum.Proof | None:
        """Write a landed payload into these blocks (an InPlace one is there already) and, if `prove`,
        return its checksum, queued on the device: taken as the payload is copied in where it lies on
        this device (Platform.unpack_kv, a piece at a time), else of the blocks it went into (a host
        payload bound for a device, an InPlace one)."""
        if isinstance(payload, InPlace):
            total = kv_checksum.of_blocks(self.tensor, block_ids) if prove else None
        elif _device_of(payload) == self.tensor.device:
            total = self._unpack_here(block_ids, payload, prove)
        else:
            self.write(block_ids, payload)
            total = kv_checksum.of_blocks(self.tensor, block_ids) if prove else None
        if total is None:
            return None
        return kv_checksum.Proof(total, total.to("cpu", non_blocking=True), self.platform.record_event())

    def _unpack_here(self, block_ids: list[int], payload, prove: bool):
        """A payload on this cache's device into its blocks, piece by piece; with `prove`, its checksum
        (int64 [2] on the device), taken as it is copied."""
        parts = parts_of(payload, len(block_ids))
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids must be distinct to unpack into, got {list(block_ids)[:16]}")
        total = torch.zeros(2, dtype=torch.int64, device=self.tensor.device) if prove else None
        for first, n, data in parts:
            data = _as_uint8(data)
            if data.numel() != n * self.block_bytes():
                raise ValueError(f"a KV piece of {data.numel()} bytes landed for {n} blocks of {self.block_bytes()}: "
                                 "were both ends started with the same layout?")
            index = _block_index(self.tensor, block_ids[first:first + n])
            self.platform.unpack_kv(self.tensor, index, data, total, first)
        return total

    # -- set-up -----------------------------------------------------------------------------
    def _size(self, config: EngineConfig, model: torch.nn.Module, hf_config, tp_group) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        budget = config.kv_cache_memory
        if budget is None:
            free, total = self.platform.memory_info()
            if self.platform.device.type == "cpu":
                budget = min(self._cpu_default(config, model, hf_config), free // 4)
            else:
                used = total - free
                budget = int(total * config.gpu_memory_utilization) - used - _activation_reserve(config, hf_config)
        num = budget // self.block_bytes()
        if config.num_ranks > 1:          # every rank holds the same blocks: the smallest budget wins
            n = torch.tensor([num], dtype=torch.int64, device=self.platform.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN, group=tp_group)
            num = int(n.item())
        if num < 1:
            where = " on the tightest rank" if config.num_ranks > 1 else ""
            raise ValueError(f"no memory left for the KV cache{where} (this rank's budget {budget} bytes, "
                             f"{self.block_bytes()} per block); lower the model size or raise "
                             "--gpu-memory-utilization")
        return int(num)

    def _cpu_default(self, config: EngineConfig, model: torch.nn.Module, hf_config) -> int:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        context = config.max_model_len or getattr(hf_config, "max_position_embeddings", 4096)
        return cpu_kv_cache_default(weights, -(-context // self.block_size) * self.block_bytes())

    def _scales(self, config: EngineConfig, model: torch.nn.Module, hf_config, attention: AttentionBackend,
                scale: float) -> torch.Tensor | None:
        """[layers, 2, kv_heads] float32: the checkpoint's K/V cache scales, else calibrated now
        (engine/runner/kv_scales.py); None without a float8 cache or with --kv-cache-scales one (1)."""
        if not is_fp8(self.dtype) or config.kv_cache_scales == "one":
            return None
        device = self.platform.device
        found = kv_scales.from_checkpoint(getattr(model, "checkpoint_kv_scales", {}), model.num_layers,
                                          model.num_kv_heads, device)
        if found is not None:
            return found
        positions = getattr(hf_config, "max_position_embeddings", kv_scales.CALIBRATION_TOKENS)
        return kv_scales.calibrate(model, attention, scale, hf_config.vocab_size, positions, device)


def _device_of(payload) -> torch.device:
    if isinstance(payload, Pieces):
        return _device_of(payload.parts[0][2]) if payload.parts else torch.device("cpu")
    return payload.device if isinstance(payload, torch.Tensor) else torch.device("cpu")


def _activation_reserve(config: EngineConfig, hf_config) -> int:
    """Device memory kept back from the KV cache for a full step's activations (and 512 MiB more)."""
    tokens = config.max_num_batched_tokens
    per_token = (hf_config.hidden_size * 6 + hf_config.intermediate_size * 3) * 4 + hf_config.vocab_size * 4 // 8
    return tokens * per_token + (512 << 20)
