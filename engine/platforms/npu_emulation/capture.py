"""Emulated graph capture: recording every op during a capture, replaying the record, and the
runtime (torch_npu.npu) calls npu.py makes around graphs."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from baton.engine.platforms.npu_emulation.common import NpuEmulationError, _require, _unsupported


# -- graph capture state ------------------------------------------------------------------------
class _Capture:
    """What the one capture under way (if any) is recording, and the update under way (if any)."""

    def __init__(self):
        self.graph: EmulatedNPUGraph | None = None
        self.in_kernel = 0               # >0 while an emulated kernel runs: its insides are one task
        self.group_start: int | None = None
        self.update: _TaskGroup | None = None
        self.update_calls: list[tuple[Callable, tuple, dict]] = []


_state = _Capture()

_HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_DATA_DEPENDENT_SHAPES = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}


class _HostReadGuard(TorchFunctionMode):
    """Refuses reading device values on the host while capturing (it would need a sync)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if _state.in_kernel == 0 and name in _HOST_READS:
            raise NpuEmulationError(
                f"Tensor.{name}() during graph capture: a captured graph cannot read device values on the "
                "host (the value would be frozen at capture); pass host data in, or a device tensor")
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Records every aten op run during capture (outside emulated kernels) for replay."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _state.in_kernel:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("item", "_local_scalar_dense", "equal", "is_nonzero"):
            raise NpuEmulationError(f"aten.{name} during graph capture reads a device value on the host")
        if name in _DATA_DEPENDENT_SHAPES:
            raise NpuEmulationError(f"aten.{name} during graph capture: output shape depends on device data")
        out = func(*args, **kwargs)
        _state.graph.tasks.append(_AtenTask.record(func, args, kwargs, out))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _refresh(captured, fresh, where: str) -> None:
    """Copy a re-run's outputs into the captured outputs (those it did not write in place)."""
    for old, new in zip(_tensors(captured), _tensors(fresh), strict=True):
        if new.data_ptr() == old.data_ptr() and new.shape == old.shape:
            continue
        if new.shape != old.shape:
            raise NpuEmulationError(f"graph replay: {where} produced shape {tuple(new.shape)}, "
                                    f"captured {tuple(old.shape)}")
        old.copy_(new)


@dataclass(slots=True)
class _AtenTask:
    func: Callable
    args: tuple
    kwargs: dict
    out: object
    rerun: bool                      # False for pure views: they alias captured storage already

    @classmethod
    def record(cls, func, args, kwargs, out) -> _AtenTask:
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        outs = _tensors(out)
        writes = any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
        fresh = any(_storage(t) not in inputs for t in outs)
        return cls(func, args, kwargs, out, rerun=writes or fresh or not outs)

    def run(self) -> None:
        if self.rerun:
            _refresh(self.out, self.func(*self.args, **self.kwargs), str(self.func))


@dataclass(slots=True)
class _KernelTask:
    """One emulated torch_npu launch: host arguments frozen at capture (or at the last update)."""
    fn: Callable
    args: tuple
    kwargs: dict
    out: object

    def run(self) -> None:
        _refresh(self.out, self.fn(*self.args, **self.kwargs), self.fn.__name__)


@dataclass(slots=True)
class _TaskGroup:
    """The handle graph_task_group_end returns: the kernel launches captured inside the group."""
    graph: EmulatedNPUGraph
    tasks: list[_KernelTask] = field(default_factory=list)


def _frozen(value):
    """Host-side arguments as the graph keeps them: containers copied, tensors by address."""
    if isinstance(value, list):
        return [_frozen(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _kernel(fn: Callable) -> Callable:
    """An emulated torch_npu op: run eagerly; during capture also recorded as one task; inside
    graph_task_update_begin/end only noted as the new arguments of the group's task."""
    def launch(*args, **kwargs):
        if _state.update is not None:
            _state.update_calls.append((fn, args, kwargs))
            return kwargs.get("out")
        if _state.graph is None or _state.in_kernel:
            return fn(*args, **kwargs)
        _state.in_kernel += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _state.in_kernel -= 1
        task = _KernelTask(fn, tuple(_frozen(a) for a in args), {k: _frozen(v) for k, v in kwargs.items()}, out)
        _state.graph.tasks.append(task)
        return out
    launch.__name__ = launch.__qualname__ = fn.__name__
    launch.__doc__ = fn.__doc__
    return launch




# -- runtime: torch_npu.npu (torch.npu) -------------------------------------------------------------
class _Stream:
    """Streams are not modelled; this stands for the current stream in graph-task calls."""


_STREAM = _Stream()


@dataclass(frozen=True, slots=True)
class _PoolHandle:
    graph_id: int


class EmulatedNPUGraph:
    """Emulated torch.npu.NPUGraph: see the module docstring for what recording models."""

    def __init__(self):
        self.tasks: list = []
        self._captured = False
        self._pool = _PoolHandle(id(self))
        self.modes: tuple = ()

    def capture_begin(self, pool=None, capture_error_mode="global"):
        _require(_state.graph is None, "NPUGraph.capture_begin", "another capture is already under way")
        _require(pool is None or isinstance(pool, _PoolHandle), "NPUGraph.capture_begin",
                 f"pool must come from graph_pool_handle() or another graph's pool(), got {pool!r}")
        _require(capture_error_mode in ("global", "thread_local", "relaxed"), "NPUGraph.capture_begin",
                 f"capture_error_mode must be global, thread_local or relaxed, got {capture_error_mode!r}")
        self.tasks, self._captured = [], False
        _state.graph, _state.group_start = self, None
        self.modes = (_HostReadGuard(), _Recorder())
        for mode in self.modes:
            mode.__enter__()

    def capture_end(self):
        _require(_state.graph is self, "NPUGraph.capture_end", "this graph is not capturing")
        for mode in reversed(self.modes):
            mode.__exit__(None, None, None)
        _state.graph, self.modes = None, ()
        _require(_state.group_start is None, "NPUGraph.capture_end", "a graph task group was begun and not ended")
        self._captured = True

    def replay(self):
        _require(self._captured, "NPUGraph.replay", "nothing captured (capture_end not reached, or reset)")
        _require(_state.graph is None and _state.update is None, "NPUGraph.replay",
                 "replay during a capture or a task update")
        with torch.inference_mode():
            for task in self.tasks:
                task.run()

    def reset(self):
        self.tasks, self._captured = [], False

    def pool(self):
        return self._pool


class _GraphContext:
    """Emulated torch.npu.graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
    capture_error_mode="global")."""

    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global"):
        _require(isinstance(npu_graph, EmulatedNPUGraph), "graph", "npu_graph must be an NPUGraph")
        if auto_dispatch_capture:
            raise _unsupported("graph", "auto_dispatch_capture=True")
        self.npu_graph, self.pool, self.mode = npu_graph, pool, capture_error_mode

    def __enter__(self):
        self.npu_graph.capture_begin(self.pool, capture_error_mode=self.mode)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and _state.graph is self.npu_graph:     # unwind, keep the real error
            for mode in reversed(self.npu_graph.modes):
                mode.__exit__(exc_type, exc, tb)
            _state.graph, self.npu_graph.modes, _state.group_start = None, (), None
            return None
        self.npu_graph.capture_end()
        return None


def _group_begin(stream):
    _require(_state.graph is not None, "graph_task_group_begin", "called outside a graph capture")
    _require(_state.group_start is None, "graph_task_group_begin", "task groups do not nest")
    _state.group_start = len(_state.graph.tasks)


def _group_end(stream) -> _TaskGroup:
    _require(_state.graph is not None and _state.group_start is not None, "graph_task_group_end",
             "no task group was begun in this capture")
    tasks = [t for t in _state.graph.tasks[_state.group_start:] if isinstance(t, _KernelTask)]
    _state.group_start = None
    _require(bool(tasks), "graph_task_group_end", "the group captured no torch_npu op")
    return _TaskGroup(_state.graph, tasks)


def _update_begin(stream, handle):
    _require(isinstance(handle, _TaskGroup), "graph_task_update_begin", "handle must come from graph_task_group_end")
    _require(_state.graph is None and _state.update is None, "graph_task_update_begin",
             "updates happen outside capture, one at a time")
    _state.update, _state.update_calls = handle, []


def _update_end(stream):
    op = "graph_task_update_end"
    group, calls = _state.update, _state.update_calls
    _require(group is not None, op, "no update was begun")
    _state.update, _state.update_calls = None, []
    _require(len(calls) == len(group.tasks), op, f"the update re-issued {len(calls)} ops for a group of "
             f"{len(group.tasks)}")
    for task, (fn, args, kwargs) in zip(group.tasks, calls, strict=True):
        _require(fn is task.fn, op, f"the update re-issued {fn.__name__}, the group captured {task.fn.__name__}")
        same = len(args) == len(task.args) and all(
            _same_tensors(a, b) for a, b in zip(task.args, args, strict=True)) and all(
            _same_tensors(task.kwargs.get(k), kwargs.get(k)) for k in set(task.kwargs) | set(kwargs))
        _require(same, op, "an update may change host arguments only; pass the captured tensors again")
        task.args = tuple(_frozen(a) for a in args)
        task.kwargs = {k: _frozen(v) for k, v in kwargs.items()}


def _same_tensors(old, new) -> bool:
    a, b = _tensors(old), _tensors(new)
    return len(a) == len(b) and all(x.data_ptr() == y.data_ptr() and x.shape == y.shape
                                    for x, y in zip(a, b, strict=True))


def _host_memory(device=None) -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")


def _set_device(device) -> None:
    """Nothing to bind on the host; takes what torch.npu.set_device takes (an index or a device)."""
    ok = isinstance(device, torch.device) or (isinstance(device, int) and device >= 0)
    _require(ok, "set_device", f"device must be an int >= 0 or a torch.device, got {device!r}")


def _device(index: int) -> torch.device:
    """The emulated npu:N is the host CPU: tensors live in host memory, nothing is offloaded."""
    _set_device(index)
    return torch.device("cpu")
