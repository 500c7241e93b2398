"""Every KV backend, one spec each: the only place a backend's name appears outside its folder.

A spec says what the router, the worker flags and the services need to decide without
importing torch or the backend: its preference, whether two workers on one accelerator may
pair with it, the gRPC services its receiver adds, its flags, its failure policy, and the
module that builds its two ends (`make_sender(SenderContext)`, `make_receiver(ReceiverContext)`),
imported only when a worker uses it. Adding a backend = one folder + one entry in SPECS
(+ its package in pyproject.toml's explicit list; a test says so when it is missing).
Torch-free and grpc-free: the router imports it.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

DEFAULT = "grpc"          # every decode worker serves it: it is also every backend's handshake
AUTO = "auto"             # --kv-backend auto: every installed backend marked auto, best first


@dataclass(frozen=True, slots=True)
class BackendFlag:
    """A worker flag of one backend; its value reaches the backend as options[dest] (its default
    where the caller gave none: the contexts below fill them in)."""

    name: str                         # "--kv-nccl"
    kwargs: dict[str, Any]            # serving.options.flag's keywords (default, choices, help, hidden, ...)
    minimum: float | None = None      # a number below it is refused (check_options)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return self.kwargs.get("default")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str
    summary: str                      # one clause for --kv-backend's help
    module: str                       # defines make_sender(SenderContext) and make_receiver(ReceiverContext)
    preference: int                   # the router picks the lowest both workers speak
    same_accelerator: bool = True     # may two workers on one accelerator of one host pair with it
    services: tuple[str, ...] = ()    # gRPC services its receiver adds to the decode worker's KV server
    flags: tuple[BackendFlag, ...] = ()
    drop_sender_on_failure: bool = True   # failure policy: after a failed push the next request handshakes
                                          # afresh; False where the sender mends itself (reconnects its pair)
    in_process: bool = False          # both ends must live in one process (no engine process)
    requires: tuple[str, ...] = ()    # modules, any one of which must import for the backend to run here
    auto: bool = False                # offered by --kv-backend auto where `requires` is installed

    def available(self) -> bool:
        return not self.requires or any(importlib.util.find_spec(m) is not None for m in self.requires)

    def load(self):
        """The backend's module (imports torch and the backend's library)."""
        return importlib.import_module(self.module)


SPECS: dict[str, BackendSpec] = {s.name: s for s in (
    BackendSpec("grpc", "portable, host-staged bytes in CRC-checked chunks over gRPC",
                "baton.kvtransfer.grpc_backend", preference=90, services=("baton.v1.KVTransfer",)),
    BackendSpec("direct", "device to device over a two-rank NCCL (GPUs), HCCL (NPUs) or gloo (CPU) communicator "
                "per worker pair", "baton.kvtransfer.direct_backend", preference=20, same_accelerator=False,
                services=("baton.v1.KVDirect",), drop_sender_on_failure=False, flags=(
                    BackendFlag("--kv-nccl", dict(default="direct", choices=("direct", "torch"), help=(
                        "device-direct KV on GPUs: call NCCL directly, or through torch's ProcessGroupNCCL"))),
                    BackendFlag("--kv-fault-stall-s", dict(type=float, default=0.0, hidden=True, help=(
                        "TEST ONLY: hold each device-direct KV piece this long, as a stalled link would")),
                        minimum=0.0))),
    BackendSpec("nixl", "NIXL (UCX picks the transport: shared memory, RDMA, CUDA IPC): the prefill worker writes "
                "straight into the decode worker's KV cache pages", "baton.kvtransfer.nixl_backend", preference=10,
                services=("baton.v1.KVNixl",), requires=("nixl", "nixl_cu13", "nixl_cu12"), auto=True),
    BackendSpec("memory", "prefill and decode in one process, pieces handed over",
                "baton.kvtransfer.memory_backend", preference=30, in_process=True),
)}
NAMES = tuple(SPECS)
CROSS_PROCESS_BACKENDS = tuple(s.name for s in SPECS.values() if not s.in_process)
IN_PROCESS_BACKENDS = tuple(s.name for s in SPECS.values() if s.in_process)


def spec(name: str) -> BackendSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown KV backend {name!r}: use one of {', '.join(NAMES)}") from None


def spoken(configured: str) -> list[str]:
    """The backends a worker started with --kv-backend `configured` speaks, best first: that one
    (with auto: every installed auto backend) and grpc, which every decode worker serves."""
    names = [s.name for s in SPECS.values() if s.auto and s.available()] if configured == AUTO else [configured]
    names = [spec(n).name for n in names if n != DEFAULT] + [DEFAULT]
    return sorted(names, key=lambda n: SPECS[n].preference)


def services(configured: str) -> list[str]:
    """The gRPC services a decode worker's KV server runs (for reflection and health)."""
    return [svc for name in spoken(configured) for svc in SPECS[name].services]


def pick(prefill: list[str], decode: list[str], same_accelerator: bool) -> str:
    """The best backend both workers speak ("" when none: the decode worker chooses). Two workers
    on one accelerator skip backends that cannot pair there (two ranks of one NCCL device)."""
    common = [SPECS[n] for n in set(prefill) & set(decode) if n in SPECS]
    usable = [s for s in common if s.same_accelerator or not same_accelerator]
    return min(usable, key=lambda s: s.preference).name if usable else ""


# flags of every backend: the device memory KV in flight may take on each side of a transfer
BUFFER_MIB = 4096
BUFFER_FLOOR_BYTES = 256 << 20        # the least an accelerator keeps (one long prompt's KV)
COMMON_FLAGS = (
    BackendFlag("--kv-buffer-mib", dict(type=int, default=BUFFER_MIB, help=(
        "device memory for KV in flight, per worker: on a prefill worker the packed KV not yet sent (past it, "
        "no new prompt starts until it drains), on a decode worker the staging of incoming KV (past it, a "
        "transfer waits for room; one larger than all of it waits until nothing else is staged, then stages alone); "
        "on an accelerator at most half the memory the KV cache left")), minimum=1),
)


def all_flags() -> list[BackendFlag]:
    return [*COMMON_FLAGS, *(f for s in SPECS.values() for f in s.flags)]


def buffer_bytes(options: dict[str, Any], free_device_bytes: int | None) -> int:
    """--kv-buffer-mib in bytes; on an accelerator (`free_device_bytes` given: what the KV cache
    left) at most half of that, yet never under BUFFER_FLOOR_BYTES."""
    limit = int(with_defaults(options)["kv_buffer_mib"]) << 20
    if free_device_bytes is not None:
        limit = max(BUFFER_FLOOR_BYTES, min(limit, free_device_bytes // 2))
    return limit


def with_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with every backend flag it leaves out at that flag's default."""
    return {**{f.dest: f.default for f in all_flags()}, **options}


def check_options(options: dict[str, Any]) -> None:
    """ValueError naming the first backend flag whose value is out of range."""
    for f in all_flags():
        value = with_defaults(options)[f.dest]
        if f.minimum is not None and value < f.minimum:
            raise ValueError(f"{f.name} must be >= {f.minimum:g}, got {value:g}")


@dataclass(slots=True)
class SenderContext:
    """What a prefill worker gives a backend to build its sender to one decode worker."""

    address: str                      # the decode worker's KV address
    channel: Any                      # a grpc.aio.Channel to it (the caller owns it)
    platform: Any                     # engine.platforms.Platform of this worker
    auth: Any = None                  # kvtransfer.peer_auth.KVPeerAuth, or None
    options: dict[str, Any] = field(default_factory=dict)   # the backends' flags, by dest

    def __post_init__(self) -> None:
        self.options = with_defaults(self.options)


@dataclass(slots=True)
class ReceiverContext:
    """What a decode worker gives a backend to build its receiver."""

    pending: Any                      # kvtransfer.receiver.PendingTransfers every receiver reports into
    layout: Any                       # this worker's KVLayout
    platform: Any
    address: str                      # the KV address this worker advertises
    store_host: str = ""              # where per-pair rendezvous listen (the KV network's host)
    auth: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    kv_cache: Any = None              # the engine's paged KV cache tensor, for backends that write into its
                                      # blocks in place (admission then names them); None: they stage

    def __post_init__(self) -> None:
        self.options = with_defaults(self.options)


def make_sender(name: str, ctx: SenderContext):
    return spec(name).load().make_sender(ctx)


def make_receivers(configured: str, ctx: ReceiverContext) -> list:
    """One receiver per backend the worker speaks (grpc's first: it answers the handshake)."""
    names = sorted(spoken(configured), key=lambda n: n != DEFAULT)
    return [spec(n).load().make_receiver(ctx) for n in names]
