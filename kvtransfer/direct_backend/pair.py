"""One pair of workers' KV link: a two-rank communicator (NCCL called directly, or a torch
process group: gloo, HCCL, NCCL) on a device stream of its own, and a watcher thread that
settles each posted send or receive on the event loop once the device has finished it.
Devices are reached through the engine's platform (streams, events, the collective library).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from baton.engine.platforms import Platform

log = logging.getLogger("baton.kvtransfer")
COLLECTIVES = ("nccl", "hccl", "gloo")
JOIN_TIMEOUT_S = 60.0          # building a pair's communicator (both ends must join)


class PairGroup:
    """One two-rank communicator with its own device stream, and a thread that watches its
    operations complete."""

    def __init__(self, pair_id: str, platform: Platform, nccl: str = "direct"):
        """`nccl`: "direct" calls NCCL through ctypes, "torch" through ProcessGroupNCCL."""
        if platform.dist_backend not in COLLECTIVES:
            raise ValueError(f"unknown collective {platform.dist_backend!r}: use one of {', '.join(COLLECTIVES)}")
        self.pair_id = pair_id
        self.platform = platform
        self.collective = platform.dist_backend
        self.device = platform.device
        self.nccl = nccl
        self.comm = None                         # _NcclComm or TorchGroup, once joined
        self.store = None
        self.broken: str | None = None          # why the pair can no longer be used
        self.control: asyncio.Task | None = None   # the receiver's control stream handler
        self.in_flight = 0                       # transfers open on the pair (receiver side)
        self.last_used = time.monotonic()
        # the pair's operations go on a stream of their own: on the default one they would queue
        # behind whatever compute the engine has launched; high priority, so its kernels go
        # first when SMs free up
        self.stream = platform.new_stream(high_priority=True)
        self._watching: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()   # posted, not yet seen done
        self._watcher: threading.Thread | None = None

    # -- set-up -----------------------------------------------------------------------------
    def host_store(self, host: str) -> int:
        """Decode side: start this pair's rendezvous store on a free port; returns the port."""
        self.store = dist.TCPStore(host, 0, 2, True, timeout=timedelta(seconds=JOIN_TIMEOUT_S),
                                   wait_for_workers=False)
        return self.store.port

    async def join(self, rank: int, host: str = "", port: int = 0, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Build the communicator (rank 1 on the store this end hosts, rank 0 as its client)."""
        def build():
            self.platform.bind_thread()
            if self.store is None:
                self.store = dist.TCPStore(host, port, 2, False, timeout=timedelta(seconds=timeout))
            comm = make_comm(self.collective, dist.PrefixStore(self.pair_id, self.store), rank, timeout, self.nccl)
            # one tiny exchange: communicators that connect lazily (NCCL, HCCL) connect now, so a
            # transfer's receive is posted without blocking, and the link is known to work
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            work = comm.send(probe, self.stream) if rank == 0 else comm.recv(probe, self.stream)
            if work is not None:
                work.wait()
            if self.stream is not None:
                self.stream.synchronize()
            return comm
        try:
            # on a daemon thread: a peer that never joins must not keep this process from exiting
            comm = await asyncio.wait_for(_on_daemon_thread(build, f"kv-join-{self.pair_id[:8]}"), timeout)
        except Exception as exc:
            self.close(f"could not build the {self.collective} communicator of pair {self.pair_id}: {exc}")
            raise
        if self.broken is not None:          # closed while it was being built
            _abort_later(comm)
            raise RuntimeError(f"KV pair {self.pair_id} was closed while it was built: {self.broken}")
        self.comm = comm

    # -- transfers ----------------------------------------------------------------------------
    # Operations are posted from the event loop's thread: posting only enqueues work on the
    # pair's stream (a few microseconds with NCCL called directly), where a hop to another
    # thread and back costs a few hundred on a lone transfer's critical path, at each end.
    def post_send(self, tensor: torch.Tensor, after=None) -> Posted:
        """Post the send of a packed uint8 tensor (once `after`, a device event, has passed)."""
        return self._post(True, tensor, after)

    def post_recv(self, tensor: torch.Tensor) -> Posted:
        return self._post(False, tensor)

    def _post(self, send: bool, tensor: torch.Tensor, after=None) -> Posted:
        comm = self.comm
        if comm is None:
            raise RuntimeError(f"KV pair {self.pair_id} is closed: {self.broken}")
        if self.stream is None:
            return self._track(comm.send(tensor, None) if send else comm.recv(tensor, None), None, tensor)
        with self.platform.on_stream(self.stream):
            if after is not None:            # the engine packed it on its own stream
                self.stream.wait_event(after)
            work = comm.send(tensor, self.stream) if send else comm.recv(tensor, self.stream)
            if work is not None:
                work.wait()                  # the pair's stream waits for it (the host does not)
            event = self.platform.record_event(self.stream, blocking=True)   # passes when the operation has
        return self._track(work, event, tensor)

    def _track(self, work, event, tensor: torch.Tensor) -> Posted:
        """Hand the operation to the pair's watcher thread, which keeps it and its tensor alive
        until it completes (a pending gloo work that is dropped is cancelled, which would put
        every later operation of the pair out of step; a device buffer freed early would be
        reused under the transfer) and then settles its `done`."""
        self.last_used = time.monotonic()
        loop = asyncio.get_running_loop()
        posted = Posted(work, tensor, event, loop)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, args=(loop,), daemon=True,
                                             name=f"kv-watch-{self.pair_id[:8]}")
            self._watcher.start()
        self._watching.put(posted)
        return posted

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watcher thread: operations complete in the order they were posted (one communicator,
        one stream), so waiting for them one after the other loses nothing. An operation that
        ends because the communicator was aborted has failed, not completed."""
        self.platform.bind_thread()
        while (posted := self._watching.get()) is not None:
            error = posted.wait_blocking()
            if error is None and self.broken is not None:
                error = f"the pair was closed: {self.broken}"
            try:
                loop.call_soon_threadsafe(posted.settle, error)
            except RuntimeError:             # the loop has closed: nobody is waiting any more
                return

    async def wait_done(self, posted: list[Posted], timeout: float, what: str) -> None:
        """Wait until every operation has finished on the device (its bytes are final), within `timeout`."""
        pending = [p.done for p in posted if not p.done.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            if late:
                raise TimeoutError(f"the {self.collective} {what} did not complete within {timeout:.1f}s")
        for p in posted:
            p.result()                      # raises if the collective failed
        self.last_used = time.monotonic()

    def close(self, reason: str, wait: float = 0.0) -> None:
        """Abort the communicator (pending operations fail) and stop the watcher; `wait`:
        seconds to let the abort finish (at shutdown; the event loop must not block on it
        otherwise)."""
        if self.broken is None:
            self.broken = reason
        comm, self.comm = self.comm, None
        if comm is not None:
            _abort_later(comm).join(wait)
        self._watching.put(None)             # the watcher ends once what is posted has settled
        self.store = None


class Posted:
    """One posted send or receive, with its tensor (alive until the operation completes).
    `done` is settled on the event loop by the pair's watcher thread once the operation has
    finished. Nothing polls from the loop: a sub-millisecond asyncio sleep lasts a whole
    millisecond (epoll's timeout resolution), four times what 100 MiB takes over NVLink."""

    __slots__ = ("work", "tensor", "event", "done", "_error")

    def __init__(self, work, tensor: torch.Tensor, event, loop: asyncio.AbstractEventLoop):
        self.work = work                     # a torch.distributed work, or None (NCCL called directly)
        self.tensor = tensor
        self.event = event                   # device collectives: passes when the operation has
        self.done = loop.create_future()     # gloo (event None): known by waiting on the work
        self._error: str | None = None

    def settle(self, error: str | None) -> None:
        """Event-loop side of the watcher's notice."""
        self._error = error
        if not self.done.done():
            self.done.set_result(None)

    def wait_blocking(self) -> str | None:
        """Watcher thread: block until the operation has finished; its error, if any."""
        try:
            if self.event is not None:
                self.event.synchronize()     # releases the GIL; a blocking-sync event sleeps, not spins
            else:
                self.work.wait(timedelta(seconds=JOIN_TIMEOUT_S))
        except Exception as exc:             # timed out, or the peer went away
            return str(exc) or type(exc).__name__
        return None

    def completed(self) -> bool:
        return self.done.done()

    def result(self) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)
        if self.event is not None and self.work is not None:
            self.work.wait()                 # raises if the collective failed (aborted, peer gone)


def _abort_later(comm) -> threading.Thread:
    """Abort a communicator on a thread of its own (NCCL/HCCL: it may block until in-flight
    kernels stop, which the event loop must not)."""
    t = threading.Thread(target=_quietly, args=(comm.abort,), daemon=True)
    t.start()
    return t


def _on_daemon_thread(fn, name: str) -> asyncio.Future:
    """Run fn() (which builds a communicator) on a fresh daemon thread; a future of its result
    on the running loop. One built after its waiter gave up is aborted."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)
        elif result is not None:
            _abort_later(result)

    def run():
        try:
            result, error = fn(), None
        except BaseException as exc:
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:                 # the loop has closed
            pass
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class TorchGroup:
    """A two-rank torch.distributed process group as a pair's communicator: gloo on the CPU,
    HCCL on Ascend, and NCCL where its library cannot be called directly (`_NcclComm`)."""

    def __init__(self, pg):
        self.pg = pg
        self.name = type(pg).__name__

    def send(self, tensor: torch.Tensor, stream):
        return self.pg.send([tensor], 1, 0)

    def recv(self, tensor: torch.Tensor, stream):
        return self.pg.recv([tensor], 0, 0)

    def abort(self) -> None:
        abort = getattr(self.pg, "abort", None) or getattr(self.pg, "shutdown", None)
        if abort is not None:
            abort()


class _NcclComm:
    """An NCCL communicator called directly (kvtransfer.nccl), with the pair's interface: send
    and recv are stream-ordered and return no work."""

    def __init__(self, comm, peer: int):
        self.comm = comm
        self.peer = peer
        from baton.kvtransfer.direct_backend import nccl
        self.name = f"NCCL {nccl.version()}, called directly"

    def send(self, tensor: torch.Tensor, stream):
        self.comm.send(tensor, self.peer, stream)

    def recv(self, tensor: torch.Tensor, stream):
        self.comm.recv(tensor, self.peer, stream)

    def abort(self) -> None:
        self.comm.abort()


_warned_nccl = False


def make_comm(collective: str, store, rank: int, timeout: float, nccl_mode: str = "direct"):
    """A two-rank communicator of `collective` on `store`, without touching the default group.
    NCCL is called directly (direct_backend.nccl: a few microseconds a call, where
    ProcessGroupNCCL takes over a hundred) unless `nccl_mode` is "torch"; its id travels over
    the store."""
    global _warned_nccl
    if collective == "nccl" and nccl_mode != "torch":
        from baton.kvtransfer.direct_backend import nccl
        try:
            nccl.library()
        except nccl.NcclUnavailable as exc:
            if not _warned_nccl:
                log.warning("calling NCCL through ProcessGroupNCCL (more host time per transfer): %s", exc)
                _warned_nccl = True
        else:
            if rank == 0:
                store.set("nccl-id", nccl.unique_id())
            return _NcclComm(nccl.Communicator(bytes(store.get("nccl-id")), rank, 2), peer=1 - rank)
    return TorchGroup(make_group(collective, store, rank, timeout))


def make_group(collective: str, store, rank: int, timeout: float):
    """A two-rank process group of `collective` on `store`."""
    td = timedelta(seconds=timeout)
    if collective == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, td)
    if collective == "nccl":     # NCCL's own stream high priority too: sends are not starved by
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)   # the GEMMs they overlap
        options._timeout = td
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # the HCCL twin (never run here)
    options = ProcessGroupHCCL.Options()
    options._timeout = td
    return ProcessGroupHCCL(store, rank, 2, options)



def _quietly(fn) -> None:
    try:
        fn()
    except Exception as exc:      # an abort of a broken communicator may itself complain
        log.debug("aborting a KV communicator: %s", exc)

