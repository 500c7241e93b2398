"""Static instruction counts of the W4A16 GEMV kernels (engine/platforms/triton_kernels/w4a16.py, w4a16_rows.py)
compiled for sm_90 without a GPU: Triton's ptxas, SASS through the cuobjdump Triton ships. Per kernel and tile, the
registers ptxas gives a thread, the instructions of the main loop's body (the longest backward branch: one block of
128 input rows) and those per weight (the loop's count over the weights a thread unpacks in it), and the loop's
most frequent opcodes (LDL / STL: spills). At ~33 T thread-instructions/s (132 SMs x 128 lanes x 1.98 GHz) the
count per weight times a projection's weights is the time the SMs need to issue it:

    pip install --target /tmp/triton_int4 triton==3.9.0
    PYTHONPATH=/tmp/triton_int4 python -m baton.benchmarks.int4_sass [ROWSxBLOCK_NxWARPS ...]   # 1x256x4 2x256x4 ...
ROWS 1 is the one-row GEMV (_w4a16_gemv), 2 / 4 / 8 the multi-row one (w4a16_rows.gemv_rows).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
TYPES = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "out_ptr": "*fp32"}
ROWS_ARGS = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "M", "N", "K_SPLIT", "stride_xm", "stride_qk",
             "stride_sg", "stride_zg", "stride_os", "stride_om", "NIB")
GEMV_ARGS = tuple(a for a in ROWS_ARGS if a != "M")
UNHINTED = ("M", "K_SPLIT", "NIB", "stride_os")     # (the JIT gives no divisibility hint to these)
DEFAULT = ("1x256x4", "2x128x4", "2x256x4", "4x256x4", "4x128x8", "8x128x8", "8x128x4")


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_gemv(rows: int, block_n: int, warps: int, group: int = 128):
    from baton.engine.platforms.triton_kernels import w4a16, w4a16_rows
    fn, names = (w4a16._w4a16_gemv, GEMV_ARGS) if rows == 1 else (w4a16_rows.gemv_rows, ROWS_ARGS)
    consts = dict(GROUP=group, PPG=min(8, group // 16), BLOCK_N=block_n, **({} if rows == 1 else {"ROWS": rows}))
    sig = {n: TYPES.get(n, "i32") for n in names} | dict.fromkeys(consts, "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in UNHINTED}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=SM90, options=dict(num_warps=warps, num_stages=3))


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest loop (a branch back to a lower address)."""
    insts = [(int(a, 16), i) for a, i in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    best: list[str] = []
    for addr, inst in insts:
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", inst)
        if m and int(m.group(1), 16) < addr:
            body = [i for a, i in insts if int(m.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


def describe(rows: int, block_n: int, warps: int) -> str:
    kernel = compile_gemv(rows, block_n, warps)
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    body = loop_body(sass)
    per_weight = len(body) / (128 * block_n / (32 * warps))
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in body)
    top = ", ".join(f"{o} {c}" for o, c in ops.most_common(8))
    return (f"rows {rows} BLOCK_N {block_n:4d} warps {warps}: regs {regs.group(1) if regs else '?':>3}  loop {len(body):5d}"
            f"  {per_weight:6.2f} a weight, {per_weight / rows:5.2f} a weight and row  [{top}]")


def main(argv: list[str] | None = None) -> None:
    for spec in (argv if argv is not None else sys.argv[1:]) or DEFAULT:
        print(describe(*map(int, spec.split("x"))), flush=True)


if __name__ == "__main__":
    main()
