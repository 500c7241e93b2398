"""The `baton` command: serve | generate | router | prefill | decode | bench | plan | top | role |
elastic.

Each subcommand parses its flags before importing anything heavy, so `--help` (and a
mistyped flag) answer at once; torch loads only when a process starts serving.
"""
from __future__ import annotations

import sys

from baton.serving.logs import quiet_grpc

USAGE = """usage: baton <command> [flags]      (baton <command> --help for its flags)

commands:
  serve      router + prefill + decode as local processes: baton serve [MODEL] (a Hub name such as
             Qwen/Qwen3-0.6B, a checkpoint folder, a .gguf file; unset: the embedded model)
  generate   stream a completion from a running router
  router     the public gRPC router
  prefill    a prefill worker
  decode     a decode worker (--colocated: a worker doing both)
  bench      benchmarks: {bench}
  plan       which prefill/decode split of N devices serves a workload best at a TTFT and TPOT target
  top        a live view of a running deployment: requests, stage times, workers (from its router's metrics)
  role       switch a worker's role in place (prefill, decode, colocated): baton role WORKER ROLE --admin-token T
  elastic    switch workers' roles as the traffic mix moves, by a plan (baton plan --output)

  baton --version    the installed version
"""


def main(argv: list[str] | None = None) -> None:
    quiet_grpc()            # before a command imports grpc: it reads GRPC_VERBOSITY then
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if argv else 2)
    if argv[0] in ("--version", "-V", "version"):
        from baton import __version__
        print(f"baton {__version__}")
        return
    cmd, rest = argv[0], argv[1:]
    run = _command(cmd)
    if run is None:
        print(f"baton: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    try:
        run(rest)
    except KeyboardInterrupt:   # Ctrl-C ends a command (elastic's loop, a role switch's wait) as a shell expects
        print(file=sys.stderr)
        sys.exit(130)


def usage() -> str:
    """USAGE, its `bench` line read from the one list of `baton bench` verbs."""
    from baton.benchmarks.cli import VERBS
    return USAGE.format(bench=VERBS)


def _command(name: str):
    if name == "serve":
        return serve_main
    if name == "generate":
        from baton.client import main
    elif name == "router":
        from baton.router.main import main
    elif name == "prefill":
        from baton.prefill_service.main import main
    elif name == "decode":
        from baton.decode_service.main import main
    elif name == "bench":
        from baton.benchmarks.cli import main
    elif name == "plan":
        from baton.benchmarks.planner import main
    elif name == "top":
        from baton.top import main
    elif name == "role":
        from baton.client import role_main as main
    elif name == "elastic":
        from baton.elastic import main
    else:
        return None
    return main


def serve_main(argv: list[str]) -> None:
    from baton.launcher import build_parser, serve
    sys.exit(serve(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
