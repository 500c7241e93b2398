"""`baton bench <benchmark>`: run one benchmark, write one JSON.

Every run records the command line, git commit, model shape, dtype, devices, versions and
the device ceilings measured in the same run; `--smoke` is each benchmark's seconds-long
CPU mode on the embedded model. Default output: ./bench-results/<benchmark>-<time>.json.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from baton.benchmarks import record

# modules import lazily: `offline` must run where the serving stack's gRPC pieces don't
BENCHMARKS = {
    "offline": ("baton.benchmarks.offline", "B1: offline throughput on the nano-vllm workload, with a roofline"),
    "serve": ("baton.benchmarks.serve", "B2: online serving sweep against a baton.v1.Router deployment"),
    "kv": ("baton.benchmarks.kv", "B3: KV-transfer latency and bandwidth per backend and request size"),
    "relay": ("baton.benchmarks.relay", "tokens per second one router process relays (synthetic workers)"),
    "multiturn": ("baton.benchmarks.multiturn", "multi-turn chat: later turns' TTFT and prefix-cache hits; "
                  "--compare-offload: without and with the host KV tier"),
    "flip": ("baton.benchmarks.flip", "a load whose mix flips: static splits against roles that follow it "
             "(baton elastic), goodput over the run"),
}
VERBS = " | ".join(BENCHMARKS)      # "offline | serve | kv | relay": every help text that lists them reads this


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows a flag's default when it has a meaningful one (not None/False, not already said)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if not (d is None or d is False or d == "" or d is argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton bench", description=__doc__.replace("<benchmark>", VERBS, 1),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, (module_name, summary) in BENCHMARKS.items():
        if selected is not None and name != selected:
            sub.add_parser(name, help=summary)
            continue
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=summary, description=module.__doc__, formatter_class=_HelpFormatter)
        sp.add_argument("--smoke", action="store_true",
                        help="seconds-long CPU mode on the embedded model (what CI runs)")
        sp.add_argument("--output", default=None,
                        help="JSON path (default ./bench-results/<benchmark>-<time>.json)")
        module.add_arguments(sp)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in BENCHMARKS else None)
    args = parser.parse_args(argv)
    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    try:
        module.resolve(args)
    except ValueError as exc:
        parser.error(str(exc))
    out = Path(args.output) if args.output else record.default_output(args.benchmark, args.smoke)
    problem = unwritable(out)
    if problem:                          # found now, not once the run is over and its results would be lost
        parser.error(f"--output {out}: {problem}")
    args.output = str(out)
    rec = record.new_record(args.benchmark, argv, args.smoke, _config(args))
    try:
        module.run(args, rec)
    except ValueError as exc:            # bad input found once running (model name, lengths, ...)
        print(f"baton bench {args.benchmark}: {exc}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as exc:          # e.g. a launched deployment did not come up (LaunchError)
        print(f"baton bench {args.benchmark}: {exc}", file=sys.stderr)
        sys.exit(1)
    path = record.write(rec, out)
    print(f"[bench] wrote {path}", file=sys.stderr)
    print(path)


def unwritable(path: Path) -> str | None:
    """Why a result file cannot be written at `path` (its folder made if missing), or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make its folder ({exc.strerror or exc})"
    if path.is_dir():
        return "is a folder"
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "not writable"
    return None


def _config(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k != "benchmark"}


if __name__ == "__main__":
    main()
