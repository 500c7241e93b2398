"""The `baton` command: router | prefill | decode | serve | generate | bench."""
from __future__ import annotations

import argparse
import sys

USAGE = """baton <command> [flags]

commands:
  serve      router + prefill + decode as local processes on the embedded model
  generate   stream a completion from a running router
  router     the public gRPC router
  prefill    a prefill worker
  decode     a decode worker (--colocated: a worker doing both)
  bench      benchmarks: offline | serve | kv
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd == "router":
        from baton.router.main import main as run
    elif cmd == "prefill":
        from baton.prefill_service.main import main as run
    elif cmd == "decode":
        from baton.decode_service.main import main as run
    elif cmd == "serve":
        run = serve_main
    elif cmd == "generate":
        from baton.client import main as run
    elif cmd == "bench":
        from baton.benchmarks.cli import main as run
    else:
        print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    run(rest)


def serve_main(argv: list[str]) -> None:
    from baton.engine.config import DEFAULT_MODEL
    from baton.launcher import serve
    p = argparse.ArgumentParser(prog="baton serve",
                                description="router + prefill + decode as separate local processes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="router port")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefill-devices", default=None, help="comma list, one per prefill instance")
    p.add_argument("--decode-devices", default=None, help="comma list, one per decode instance")
    p.add_argument("--prefill-instances", type=int, default=1)
    p.add_argument("--decode-instances", type=int, default=1)
    p.add_argument("--colocated", action="store_true", help="colocated worker(s) instead of prefill+decode")
    p.add_argument("--instances", type=int, default=1, help="number of colocated workers")
    p.add_argument("--policy", default="least_loaded")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="router metrics on this port, each worker on the ports after it")
    sys.exit(serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
