"""Regenerate the Python stubs (messages, gRPC services, .pyi type stubs) of every
protos/baton/v1/*.proto. The generated files are committed and never edited by hand.

    python -m protos.generate           # rewrite them in place
    python -m protos.generate --check   # exit 1, with a diff summary, if they are stale (CI)
"""
from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent          # the -I root: imports read `baton/v1/x.proto`
PACKAGE = Path("baton") / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
DIFF_LINES_SHOWN = 40


def proto_files() -> list[Path]:
    """Every proto of the package, relative to ROOT, in a stable order."""
    return sorted(p.relative_to(ROOT) for p in (ROOT / PACKAGE).glob("*.proto"))


def run_protoc(out_root: Path) -> None:
    """Write the stubs of every proto under out_root/baton/v1/. protoc runs in a process of its own:
    its compiled library must not meet other native libraries a caller has loaded (NIXL's bundled
    ones crash it when a test process has both)."""
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"     # google/protobuf/*.proto
    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_root}",
            f"--grpc_python_out={out_root}", f"--pyi_out={out_root}", *map(str, proto_files())]
    if subprocess.run(args, check=False).returncode != 0:
        raise SystemExit("protoc failed; its messages are above")


def generated(root: Path) -> dict[str, Path]:
    """The generated files found under root/baton/v1, by name."""
    folder = root / PACKAGE
    return {p.name: p for p in sorted(folder.iterdir()) if p.name.endswith(SUFFIXES)} if folder.is_dir() else {}


def stale_report(fresh: dict[str, Path], committed: dict[str, Path]) -> list[str]:
    """One line per differing file, then the first lines of the unified diff."""
    summary, diff_lines = [], []
    for name in sorted(fresh.keys() | committed.keys()):
        if name not in committed:
            summary.append(f"  missing   {PACKAGE / name}")
            continue
        if name not in fresh:
            summary.append(f"  orphaned  {PACKAGE / name} (its .proto is gone)")
            continue
        old, new = committed[name].read_text().splitlines(), fresh[name].read_text().splitlines()
        if old == new:
            continue
        diff = list(difflib.unified_diff(old, new, f"committed/{name}", f"regenerated/{name}", lineterm="", n=1))
        added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
        removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
        summary.append(f"  changed   {PACKAGE / name} (+{added} -{removed} lines)")
        diff_lines.extend(diff)
    if len(diff_lines) > DIFF_LINES_SHOWN:
        diff_lines = [*diff_lines[:DIFF_LINES_SHOWN], f"... ({len(diff_lines) - DIFF_LINES_SHOWN} more diff lines)"]
    return summary + diff_lines if summary else []


def write() -> int:
    run_protoc(ROOT)
    wanted = {f"{p.stem}{s}" for p in proto_files() for s in SUFFIXES}
    for name, path in generated(ROOT).items():
        if name not in wanted:                  # the stub of a deleted proto
            path.unlink()
    print(f"generated {len(wanted)} files from {len(proto_files())} protos into {ROOT / PACKAGE}")
    return 0


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        report = stale_report(generated(Path(tmp)), generated(ROOT))
    if report:
        print("generated stubs differ from the protos:", *report, "fix: python -m protos.generate",
              sep="\n", file=sys.stderr)
        return 1
    print(f"generated stubs of {len(proto_files())} protos are up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temporary folder and fail if anything differs")
    args = parser.parse_args(argv)
    return check() if args.check else write()


if __name__ == "__main__":
    sys.exit(main())
