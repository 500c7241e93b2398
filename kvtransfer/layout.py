"""What both ends must agree on before the first byte moves: the KV layout.

A payload of n blocks is `kv[:, :, blocks]` of the paged cache
[layers, 2, num_blocks, block_size, kv_heads, head_dim], contiguous, as raw bytes of `dtype`.
Torch-free, so the router and tests can reason about layouts without a device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.v1 import kvtransfer_pb2

DTYPE_BYTES = {
    "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
# Fields whose values must be equal on both ends; `backends` needs one value in common instead.
# tp_rank is included: rank r of a prefill group holds a different slice of heads than rank r+1.
MATCHED_FIELDS = ("model", "architecture", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
                  "tp_size", "tp_rank", "kv_scales")
_INT_FIELDS = ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size")


class KVLayoutMismatch(ValueError):
    """The two ends cannot exchange KV; the message names every differing field."""


@dataclass(slots=True)
class KVLayout:
    model: str
    architecture: str
    dtype: str                           # torch dtype name without "torch.", e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int                    # heads held by this tensor-parallel rank
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    backends: list[str] = field(default_factory=lambda: ["grpc"])
    kv_scales: str = ""                  # a float8 cache's per-head K/V scales, as a checksum; "" = none (scale 1)

    def __post_init__(self) -> None:
        self.dtype = self.dtype.removeprefix("torch.")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}")
        bad = [f"{name}={getattr(self, name)}" for name in _INT_FIELDS if getattr(self, name) < 1]
        if bad:
            raise ValueError(f"KV layout needs positive sizes, got {', '.join(bad)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        self.backends = list(self.backends)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * DTYPE_BYTES[self.dtype])

    def payload_nbytes(self, n_blocks: int) -> int:
        """Bytes of the payload kv[:, :, blocks] of `n_blocks` blocks."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        return n_blocks * self.block_nbytes

    def to_proto(self) -> kvtransfer_pb2.KVLayout:
        return kvtransfer_pb2.KVLayout(
            model=self.model, architecture=self.architecture, dtype=self.dtype, block_size=self.block_size,
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            tp_size=self.tp_size, tp_rank=self.tp_rank, backends=self.backends, kv_scales=self.kv_scales)

    @classmethod
    def from_proto(cls, msg: kvtransfer_pb2.KVLayout) -> KVLayout:
        """Raises ValueError when the message does not describe a usable layout."""
        return cls(model=msg.model, architecture=msg.architecture, dtype=msg.dtype, block_size=msg.block_size,
                   num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
                   tp_size=msg.tp_size, tp_rank=msg.tp_rank, backends=list(msg.backends), kv_scales=msg.kv_scales)


def layout_differences(local: KVLayout, remote: KVLayout, local_role: str = "decode",
                       remote_role: str = "prefill") -> list[str]:
    """One line per field that keeps the two ends apart, e.g. "block_size: prefill has 16, decode has 32"."""
    diffs = [f"{name}: {remote_role} has {getattr(remote, name)!r}, {local_role} has {getattr(local, name)!r}"
             for name in MATCHED_FIELDS if getattr(local, name) != getattr(remote, name)]
    if not set(local.backends) & set(remote.backends):
        diffs.append(f"backends: {remote_role} has {remote.backends}, {local_role} has {local.backends} "
                     "(no KV backend in common)")
    return diffs


def check_compatible(local: KVLayout, remote: KVLayout, local_role: str = "decode",
                     remote_role: str = "prefill") -> None:
    """Raise KVLayoutMismatch listing every differing field with both values."""
    diffs = layout_differences(local, remote, local_role, remote_role)
    if diffs:
        raise KVLayoutMismatch(f"incompatible KV layouts ({len(diffs)} field{'s' * (len(diffs) > 1)} differ): "
                               + "; ".join(diffs)
                               + f". Start the {remote_role} and {local_role} workers with the same model, "
                               "dtype (--dtype and --kv-cache-dtype), KV cache scales (--kv-cache-scales), "
                               "block size and parallelism.")
