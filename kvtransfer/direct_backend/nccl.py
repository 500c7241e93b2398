"""NCCL's point-to-point calls, straight from the library torch already loaded (ctypes), for
the direct KV backend's GPU pairs.

Why not `ProcessGroupNCCL`: posting one send or receive through it costs 110-160 us of host
time (its work object, events, stream bookkeeping and watchdog entries), measured on two
H200s; `ncclSend` / `ncclRecv` cost a few microseconds. A 72 MiB transfer moves in 0.2 ms over
NVLink, so that cost, paid at both ends, was a large share of a lone transfer's time. The pair
needs nothing else from a process group: one communicator of two ranks, sends and receives
on the pair's own stream, and an abort.

Only the documented C API is used: ncclGetUniqueId, ncclCommInitRank, ncclSend, ncclRecv,
ncclCommAbort, ncclGroupStart/End, ncclGetErrorString, ncclGetVersion.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading

import torch

NCCL_UINT8 = 1              # ncclDataType_t: ncclInt8 = 0, ncclUint8 = 1
NCCL_SUCCESS = 0
UNIQUE_ID_BYTES = 128       # NCCL_UNIQUE_ID_BYTES


class NcclUnavailable(RuntimeError):
    """The NCCL library could not be found or lacks the calls used here."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]


_lib = None
_lib_lock = threading.Lock()


def _candidates() -> list[str]:
    """Where libnccl may be: the copy this process has mapped already (torch's), then by name,
    then the pip wheel's folder next to torch."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths += sorted({line.split()[-1] for line in maps if "libnccl.so" in line})
    except OSError:
        pass
    paths += ["libnccl.so.2", "libnccl.so"]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    paths += sorted(glob.glob(os.path.join(site, "nvidia", "nccl*", "lib", "libnccl.so*")))
    return paths


def library():
    """The NCCL library, its calls typed (loaded once)."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        errors = []
        for path in _candidates():
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as exc:
                errors.append(f"{path}: {exc}")
        else:
            raise NcclUnavailable("no NCCL library found (" + "; ".join(errors) + ")")
        try:
            c_void_p, c_int, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
            for name, args in (("ncclGetVersion", [ctypes.POINTER(c_int)]),
                               ("ncclGetUniqueId", [ctypes.POINTER(_UniqueId)]),
                               ("ncclCommInitRank", [ctypes.POINTER(c_void_p), c_int, _UniqueId, c_int]),
                               ("ncclSend", [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
                               ("ncclRecv", [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
                               ("ncclCommAbort", [c_void_p]),
                               ("ncclGroupStart", []), ("ncclGroupEnd", [])):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, c_int
            lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [c_int], ctypes.c_char_p
        except AttributeError as exc:
            raise NcclUnavailable(f"the NCCL library at {path} lacks a call: {exc}") from None
        _lib = lib
        return lib


def _check(lib, result: int, what: str) -> None:
    if result != NCCL_SUCCESS:
        raise RuntimeError(f"{what} failed: NCCL error {result} ({lib.ncclGetErrorString(result).decode()})")


def version() -> str:
    lib = library()
    v = ctypes.c_int()
    _check(lib, lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    code = v.value        # 2.19 and later: major * 10000 + minor * 100 + patch
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def unique_id() -> bytes:
    """A fresh communicator id (rank 0 makes it; the peer gets it over the rendezvous store)."""
    lib = library()
    uid = _UniqueId()
    _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid.internal)


class Communicator:
    """An NCCL communicator of `nranks` on the calling thread's current CUDA device. Building
    it blocks until every rank has built its end (run it off the event loop)."""

    def __init__(self, uid: bytes, rank: int, nranks: int):
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self._lib = library()
        self.rank = rank
        self.nranks = nranks
        self._comm = ctypes.c_void_p()
        _check(self._lib, self._lib.ncclCommInitRank(ctypes.byref(self._comm), nranks,
                                                     _UniqueId.from_buffer_copy(uid), rank), "ncclCommInitRank")
        self.aborted = False

    def send(self, tensor: torch.Tensor, peer: int, stream) -> None:
        """Enqueue the send of a contiguous uint8 tensor to `peer` on `stream` (a torch.cuda.Stream)."""
        self._op(self._lib.ncclSend, tensor, peer, stream, "ncclSend")

    def recv(self, tensor: torch.Tensor, peer: int, stream) -> None:
        self._op(self._lib.ncclRecv, tensor, peer, stream, "ncclRecv")

    @contextlib.contextmanager
    def group(self):
        """Operations posted inside go out as one launch (a send and a receive to oneself must)."""
        _check(self._lib, self._lib.ncclGroupStart(), "ncclGroupStart")
        try:
            yield
        finally:
            _check(self._lib, self._lib.ncclGroupEnd(), "ncclGroupEnd")

    def _op(self, fn, tensor: torch.Tensor, peer: int, stream, what: str) -> None:
        if self.aborted:
            raise RuntimeError("the NCCL communicator was aborted")
        if tensor.dtype != torch.uint8 or not tensor.is_contiguous():
            raise ValueError(f"{what} takes a contiguous uint8 tensor, got {tensor.dtype}")
        _check(self._lib, fn(tensor.data_ptr(), tensor.numel(), NCCL_UINT8, peer, self._comm,
                             stream.cuda_stream), what)

    def abort(self) -> None:
        """Stop pending operations (their kernels exit) and free the communicator; it may block
        until the kernels have stopped."""
        if self.aborted:
            return
        self.aborted = True
        _check(self._lib, self._lib.ncclCommAbort(self._comm), "ncclCommAbort")
