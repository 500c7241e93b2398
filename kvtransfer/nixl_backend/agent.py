"""NIXL agents and descriptors: which installed NIXL package, one agent per role of a process,
and the descriptor lists that place a piece's bytes where they belong in the peer's payload.

A payload of N blocks is kv[:, :, blocks]: 2 x layers rows, each holding the N blocks' bytes in
turn. A piece of n blocks from block a is the same shape with n, so its row r goes to offset
r*N*b + a*b of the payload (b: one block's bytes in one row): 2 x layers regions per piece
(`piece_descs`, staged). Written in place into the decode worker's cache of S blocks, its row r,
block i goes to r*S*b + pages[a+i]*b: one region per row and run of consecutive block ids
(`page_descs`).
"""
from __future__ import annotations

import importlib
import uuid
from functools import lru_cache

import grpc
import numpy as np
import torch

from baton.kvtransfer.backend import KVTransferError

PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")     # the meta package, or a CUDA variant's own module
INSTALL_HINT = "pip install nixl-cu13 (CUDA 13 or the CPU; nixl-cu12 for CUDA 12), or pip install 'baton[nixl]'"


@lru_cache(maxsize=1)
def nixl_api():
    """The installed NIXL Python API module (with `nixl_agent`)."""
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise KVTransferError(f"the nixl KV backend needs NIXL's Python package: {INSTALL_HINT}",
                          grpc.StatusCode.FAILED_PRECONDITION)


def new_agent(role: str):
    """A NIXL agent with the UCX backend (UCX picks shared memory, CMA, RDMA or CUDA IPC)."""
    api = nixl_api()
    name = f"baton-{role}-{uuid.uuid4().hex[:12]}"
    try:
        # no progress thread: NIXL's spins a whole core even when idle; our polling of transfer
        # states (sender) and notifications (receiver), while transfers are open, drives UCX instead
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    except Exception as exc:
        raise KVTransferError(f"could not start a NIXL agent: {exc}", grpc.StatusCode.FAILED_PRECONDITION) from exc
    if "UCX" not in agent.backends:
        raise KVTransferError(f"NIXL's UCX plugin did not load (plugins found: {agent.get_plugin_list()}); "
                              f"reinstall NIXL: {INSTALL_HINT}", grpc.StatusCode.FAILED_PRECONDITION)
    return agent


@lru_cache(maxsize=1)
def sending_agent():
    """The process's one sending agent, shared by its senders to every decode worker."""
    return new_agent("prefill")


def mem_type(tensor: torch.Tensor) -> str:
    return "DRAM" if tensor.device.type == "cpu" else "VRAM"


def device_id(tensor: torch.Tensor) -> int:
    return tensor.device.index or 0


def piece_descs(src: torch.Tensor, dst_addr: int, dst_dev: int, rows: int, total_blocks: int, first_block: int,
                num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) Nx3 descriptor arrays (address, length, device) writing the piece `src`
    (rows x num_blocks blocks, contiguous) into the peer's payload of total_blocks at dst_addr."""
    row_bytes = src.numel() // rows                     # num_blocks blocks of one row
    block_row = row_bytes // num_blocks
    r = np.arange(rows, dtype=np.int64)
    local = np.stack([src.data_ptr() + r * row_bytes, np.full(rows, row_bytes), np.full(rows, device_id(src))], 1)
    remote = np.stack([dst_addr + r * total_blocks * block_row + first_block * block_row, np.full(rows, row_bytes),
                       np.full(rows, dst_dev)], 1)
    return local, remote


def page_descs(src: torch.Tensor, dst_addr: int, dst_dev: int, rows: int, stride: int, pages: list[int],
               first_block: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) Nx3 descriptor arrays writing the piece `src` (rows x num_blocks blocks,
    contiguous; blocks [first_block, +num_blocks) of its transfer) straight into the peer's KV
    cache at dst_addr ([rows, stride blocks] of block bytes): block i of the piece goes to block
    pages[first_block + i]. Consecutive block ids coalesce into one region per row."""
    ids = np.asarray(pages[first_block:first_block + num_blocks], dtype=np.int64)
    block_row = src.numel() // rows // num_blocks                # one block's bytes in one row
    starts = np.flatnonzero(np.r_[True, np.diff(ids) != 1])      # where each run of consecutive ids begins
    lengths = np.diff(np.r_[starts, num_blocks])
    r = np.arange(rows, dtype=np.int64)[:, None]                 # rows x runs
    local_addr = src.data_ptr() + (r * num_blocks + starts) * block_row
    remote_addr = dst_addr + (r * stride + ids[starts]) * block_row
    size = np.broadcast_to(lengths * block_row, local_addr.shape)
    local = np.stack([local_addr.ravel(), size.ravel(), np.full(size.size, device_id(src))], 1)
    remote = np.stack([remote_addr.ravel(), size.ravel(), np.full(size.size, dst_dev)], 1)
    return local, remote
