"""Both ends of a KV transfer for the contract suite, built through the registry as the services
build them: a decode side (a real grpc.aio server on loopback with the backend's receivers, a
PendingTransfers, a KV cache and its block pool) and a prefill side (a KV cache, its block
pool, the backend's sender). Each side counts its block frees per transfer, so a test can say
"freed exactly once, on both sides" by block count. As the decode worker does, admission names
the reserved blocks and the receivers get the KV cache (`pages=False`: they do not, so a
backend that writes in place stages instead); blocks a failed in-place transfer leaves held
are freed when the registry releases them (QUARANTINE_S here). BATON_TEST_DEVICE=cuda:0 puts both
ends' KV caches and the pieces on that device (the grpc backend's pieces go through the host, as
a prefill worker packs them for it); BATON_TEST_PEER_DEVICE=cuda:1 puts the prefill side's on
another (the direct backend pairs two devices: NCCL refuses two ranks on one).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from dataclasses import dataclass, field

import grpc
import torch

from baton.engine.kv_handoff import InPlace, KVPiece
from baton.engine.platforms import get_platform
from baton.engine.runner.kv_blocks import pack_blocks_on_device, unpack_blocks
from baton.kvtransfer import registry
from baton.kvtransfer.backend import TransferDescriptor
from baton.kvtransfer.grpc_options import channel_options, server_options
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.receiver import PendingTransfers

DEVICE = os.environ.get("BATON_TEST_DEVICE", "cpu")
PLATFORM = get_platform(DEVICE)
PEER_DEVICE = os.environ.get("BATON_TEST_PEER_DEVICE", DEVICE)     # the prefill side's
PEER_PLATFORM = get_platform(PEER_DEVICE)
NUM_BLOCKS = 32
QUARANTINE_S = 0.5              # a backend's hold of a failed in-place transfer's blocks, in these tests


def layout(backend: str) -> KVLayout:
    """bfloat16, 16-token blocks, 2 layers x 2 heads x 32: 8 KiB a block."""
    return KVLayout(model="tiny", architecture="LlamaForCausalLM", dtype="bfloat16", block_size=16, num_layers=2,
                    num_kv_heads=2, head_dim=32, backends=registry.spoken(backend))


def kv_cache(backend: str, seed: int | None, device: str = DEVICE) -> torch.Tensor:
    lay = layout(backend)
    shape = (lay.num_layers, 2, NUM_BLOCKS, lay.block_size, lay.num_kv_heads, lay.head_dim)
    if seed is None:
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(device)


class Blocks:
    """A block pool that refuses a double free and counts each transfer's frees."""

    def __init__(self, total: int = NUM_BLOCKS):
        self.total = total
        self.free = list(range(total))
        self.frees: collections.Counter = collections.Counter()

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, "the test ran out of blocks"
        ids, self.free = self.free[:n], self.free[n:]
        return ids

    def give(self, tid: str, ids: list[int]) -> None:
        assert not set(ids) & set(self.free), f"blocks of {tid} freed twice"
        self.frees[tid] += 1
        self.free += ids

    @property
    def all_free(self) -> bool:
        return len(self.free) == self.total


@dataclass
class DecodeSide:
    backend: str
    pending: PendingTransfers
    address: str
    kv: torch.Tensor
    blocks: Blocks = field(default_factory=Blocks)
    landed: dict = field(default_factory=dict)      # tid -> (first_token, extra)
    failed: dict = field(default_factory=dict)      # tid -> reason
    ended: dict = field(default_factory=dict)       # tid -> asyncio.Event
    held: dict = field(default_factory=dict)        # tid -> block ids reserved
    unpacked: int = 0                               # joins that copied a staged payload into the blocks
    in_place: int = 0                               # joins of KV written straight into the blocks

    def expect(self, tid: str, num_blocks: int, deadline_s: float = 20.0) -> None:
        """Admission: reserve the blocks, expect the KV."""
        self.held[tid] = self.blocks.take(num_blocks)
        self.ended[tid] = asyncio.Event()
        self.pending.expect(tid, layout(self.backend).payload_nbytes(num_blocks), deadline_s,
                            self._complete, self._fail, pages=self.held[tid], on_release=self._free)

    def _complete(self, tid, payload, first_token, extra) -> None:
        if isinstance(payload, InPlace):                   # the engine's join: nothing to copy
            assert list(payload.block_ids) == self.held[tid]
            self.in_place += 1
        else:
            unpack_blocks(self.kv, self.held[tid], payload)
            self.unpacked += 1
        self.landed[tid] = (first_token, extra)
        self._free(tid)                                    # ... and, here, the request finishing at once

    def _fail(self, tid, reason) -> None:
        self.failed[tid] = reason
        if not self.pending.held(tid):                     # held: freed when the registry releases them
            self._free(tid)

    def _free(self, tid: str) -> None:
        self.blocks.give(tid, self.held[tid])
        self.ended[tid].set()

    async def wait_ended(self, tid: str, timeout: float) -> None:
        await asyncio.wait_for(self.ended[tid].wait(), timeout)


@dataclass
class PrefillSide:
    backend: str
    sender: object
    kv: torch.Tensor
    blocks: Blocks = field(default_factory=Blocks)

    def pieces(self, ids: list[int], sizes: list[int], first_token: int = 7, extra=None) -> list[KVPiece]:
        """The request's KV in pieces of `sizes` blocks, as the prefill engine hands them over."""
        out, start = [], 0
        for i, n in enumerate(sizes):
            last = i == len(sizes) - 1
            data = pack_blocks_on_device(self.kv, ids[start:start + n])
            if self.backend == "grpc":
                data = data.cpu()
            out.append(KVPiece("r", start, n, data, None, first_token if last else None,
                               dict(extra or {}) if last else {}))
            start += n
        PEER_PLATFORM.synchronize()                      # final before they go (ready=None)
        return out

    def descriptor(self, tid: str, num_blocks: int) -> TransferDescriptor:
        return TransferDescriptor(tid, nbytes=layout(self.backend).payload_nbytes(num_blocks), backend=self.backend)

    @contextlib.asynccontextmanager
    async def request(self, tid: str, num_blocks: int):
        """The prefill's blocks for one request, freed once whatever happens to its transfer."""
        ids = self.blocks.take(num_blocks)
        try:
            yield ids
        finally:
            self.blocks.give(tid, ids)

    async def send(self, tid: str, num_blocks: int, sizes: list[int], timeout: float = 20.0, **kw):
        """Open, every piece, done: the happy path of one request; returns the stats."""
        async with self.request(tid, num_blocks) as ids:
            out = await self.sender.open(self.descriptor(tid, num_blocks), timeout)
            try:
                for piece in self.pieces(ids, sizes, **kw):
                    await out.piece(piece)
                return await out.done()
            except BaseException as exc:
                out.abandon(repr(exc))
                raise


@contextlib.asynccontextmanager
async def decode_side(backend: str, max_staged_bytes: int = 1 << 30, auth=None, pages: bool = True):
    pending = PendingTransfers(max_staged_bytes=max_staged_bytes)
    server = grpc.aio.server(options=server_options())
    port = server.add_insecure_port("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    kv = kv_cache(backend, None)
    ctx = registry.ReceiverContext(pending, layout(backend), PLATFORM, address, "127.0.0.1", auth,
                                   kv_cache=kv if pages else None)
    receivers = registry.make_receivers(backend, ctx)
    for receiver in receivers:
        if hasattr(receiver, "quarantine_s"):
            receiver.quarantine_s = QUARANTINE_S
        receiver.add_to_server(server)
    await server.start()
    side = DecodeSide(backend, pending, address, kv)
    side.stop = lambda: _stop(receivers, server)
    side.receivers = receivers
    try:
        yield side
    finally:
        await side.stop()


async def _stop(receivers, server) -> None:
    for receiver in receivers:
        await receiver.close()
    await server.stop(0)


@contextlib.asynccontextmanager
async def prefill_side(backend: str, address: str, seed: int = 1, auth=None):
    channel = grpc.aio.insecure_channel(address, options=channel_options())
    sender = registry.make_sender(backend, registry.SenderContext(address, channel, PEER_PLATFORM, auth))
    side = PrefillSide(backend, sender, kv_cache(backend, seed, PEER_DEVICE))
    side.die = lambda: _die(sender, channel)
    try:
        await sender.handshake(layout(backend))
        yield side
    finally:
        await _die(sender, channel)


async def _die(sender, channel) -> None:
    """What a dying prefill process's peers see: its connections close, nothing more is said."""
    await sender.close()
    await channel.close()
