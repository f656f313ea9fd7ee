"""Registers and spills of dofattn's Triton kernels on an H100, read from ptxas without a GPU.

    python benchmarks/kernel_registers.py --out docs/results/kernel-registers.json
    python benchmarks/kernel_registers.py --gate --out docs/results/kernel-registers-gate.json   # + the gate's kernels

Each kernel is compiled for sm_90 (Triton's own ptxas, `-v`) at the tile sizes and warps its launcher in
`dofattn/ops/triton/` uses for M features (bf16 inputs, head size 64; the tiles come from the launchers' own
helpers; the scan with no decay, a decay and a gate), and with `--variants` also at other warps and exponent-dot
precisions (for the window's exact part, "bf16" is the 16-bit dot it takes on bf16 inputs). A program that spills
keeps part of its tiles in local memory: every chunk then reads them back through the cache, which is the usual
reason a kernel is far from its memory floor. Registers are per thread (255 at most); spills are bytes per thread.
No timing here: `benchmarks/cuda_ops.py` times on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)   # the compiler, not the interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dofattn.ops.triton import prf, scan  # noqa: E402
from dofattn.ops.triton import window as hybrid  # noqa: E402
from dofattn.ops.triton.common import EXACT, EXACT_HALF, MAX_TILE, _pow2, _tile, _value_tile  # noqa: E402


def _ptxas() -> Path:
    """The ptxas Triton itself runs for sm_90 (from Triton 3.7 its newer one, `ptxas-blackwell`)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return Path(get_ptxas(90).path)
    except ImportError:                                            # Triton ≤ 3.6: one ptxas
        return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


PTXAS = _ptxas()
TARGET = GPUTarget("cuda", 90, 32)
BF16, F32 = "*bf16", "*fp32"


def ptxas_report(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """{registers, spill_stores, spill_loads, stack} per thread of `kernel` compiled for sm_90."""
    for name in constexprs:
        signature[name] = "constexpr"
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        text = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        match = re.search(pattern, text)
        return int(match.group(1)) if match else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame")}


def window_exact(precision: str, warps: int, sink: int = 0) -> dict:
    """The hybrid's exact part (its linear part is the scan, `block_scan`); it does not depend on M. precision
    "bf16": its dots in bf16, as launched for bf16 inputs; else float32 dots at that precision. sink: the width of
    its block of sink keys (0: none; 16 for up to 16 sink tokens)."""
    exact_dot = tl.bfloat16 if precision == "bf16" else tl.float32
    signature = dict(q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, ol_ptr=F32, den_ptr=F32, ls_ptr=F32, off_ptr=F32,
                     valid_ptr=F32, sink_ptr="*i32", o_ptr=BF16, lse_ptr=F32, T="i32", H="i32", D="i32", V="i32",
                     scaling="fp32")
    constexprs = dict(C=64, BD=64, BV=_value_tile(64, exact_dot), SB=sink, HAS_VALID=False, STORE_LSE=False,
                      EXACT_DOT=exact_dot, EXACT_PREC="tf32" if precision == "bf16" else precision)
    return ptxas_report(hybrid._window_exact, signature, constexprs, warps, 1)


def prf_features(M: int, precision: str, warps: int) -> dict:
    signature = dict(x_ptr=BF16, w_ptr=F32, lw_ptr=F32, cnt_ptr="*i32", ks_ptr=F32, phi_ptr=BF16, qs_ptr=F32,
                     T="i32", H="i32", D="i32", M="i32", root_s="fp32", max_excess="fp32")
    BM, BT = prf._prf_tiles(M)
    constexprs = dict(BT=BT, BD=64, BM=BM, QUERY=True, EXACT_PREC=precision)
    return ptxas_report(prf._prf_features, signature, constexprs, warps, 3)


def block_scan(M: int, warps: int | None = None, chunk: int | None = None, decay: bool = False,
               gate: bool = False, reverse: bool = False) -> dict:
    """At the launch's chunk and warps, or at `chunk` and `warps` (always the launch's pipeline stages); with a
    per-head decay, a gate or neither; left to right (the forward) or right to left (the backward's scans)."""
    signature = dict(q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, s_ptr=F32, z_ptr=F32, o_ptr=BF16, d_ptr=F32, ld_ptr=F32,
                     lg_ptr=F32, T="i32", H="i32", K="i32", V="i32", delay="i32")
    BK = _pow2(M)
    launch_chunk, stages, launch_warps = scan._scan_launch(BK, gate)
    constexprs = dict(L=1024, C=chunk or launch_chunk, BK=BK,
                      BV=_value_tile(min(64, MAX_TILE // BK), tl.bfloat16),
                      HAS_Z=True, REVERSE=reverse, NORMALIZE=not reverse, DOT=tl.bfloat16, PREC="tf32",
                      HAS_DECAY=decay, HAS_GATE=gate)
    return ptxas_report(scan._block_scan, signature, constexprs, warps or launch_warps, stages)


def block_state(M: int, reverse: bool) -> dict:
    """The gated scan's first kernel (each block's own state), as launched, in either direction."""
    signature = dict(k_ptr=BF16, v_ptr=BF16, s_ptr=F32, z_ptr=F32, ld_ptr=F32, lg_ptr=F32, T="i32", H="i32",
                     K="i32", V="i32", delay="i32")
    BK = _pow2(M)
    chunk, stages, warps = scan._scan_launch(BK, True)
    constexprs = dict(L=1024, C=chunk, BK=BK, BV=_value_tile(min(64, MAX_TILE // BK), tl.bfloat16),
                      HAS_Z=True, DOT=tl.bfloat16, PREC="tf32", HAS_DECAY=False, REVERSE=reverse, HAS_GATE=True)
    return ptxas_report(scan._block_state, signature, constexprs, warps, stages)


def decode_step(M: int) -> dict:
    """The gated decode step (bf16 features, head size 64)."""
    signature = dict(q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, s_ptr=F32, s_out_ptr=F32, o_ptr=F32, ld_ptr=F32, H="i32",
                     K="i32", V="i32")
    constexprs = dict(BK=_pow2(M), BV=_pow2(65), NORMALIZE=True, HAS_DECAY=False, HAS_GATE=True)
    return ptxas_report(scan._decode_step, signature, constexprs, 4, 3)


def ring_step(M: int, window: int, sink: int, decay: bool, warps: int) -> dict:
    """The window hybrid's decode step (`prf_ring_step`): bf16 q, k, v and ring, head size 64, as launched."""
    signature = dict(q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, w_ptr=F32, lw_ptr=F32, cnt_ptr="*i32", ks_ptr=F32,
                     gain_ptr=BF16, rate_ptr=BF16, s_ptr=F32, rk_ptr=BF16, rv_ptr=BF16, rvalid_ptr="*u8",
                     pos_ptr="*i64", sk_ptr=BF16, sv_ptr=BF16, svalid_ptr="*u8", arrive_ptr="*i32", o_ptr=BF16,
                     H="i32", G="i32", D="i32", M="i32", V="i32", W="i32", NS="i32", root_s="fp32", scaling="fp32",
                     max_excess="fp32")
    constexprs = dict(BD=64, BM=_pow2(M), BV=64, BW=_tile(window), BS=_tile(sink) if sink else 2,
                      BKV=triton.next_power_of_2(4 * 64), HAS_DECAY=decay, HAS_SINK=sink > 0)
    return ptxas_report(hybrid._prf_ring_step, signature, constexprs, warps, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--variants", action="store_true", help="also other warps and exponent-dot precisions")
    parser.add_argument("--gate", action="store_true", help="also the gate's other kernels (backward scan, block "
                        "states, decode step)")
    parser.add_argument("--out", default="kernel-registers.json")
    args = parser.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    half = EXACT_HALF
    rows = []
    for M in dims:             # as launched (bf16 inputs)
        for decay, gate in ((False, False), (True, False), (False, True)):
            chunk, stages, warps = scan._scan_launch(_pow2(M), gate)
            rows.append({"kernel": "_block_scan", "M": M, "chunk": chunk, "stages": stages, "warps": warps,
                         "decay": decay, "gate": gate, **block_scan(M, decay=decay, gate=gate)})
        if args.gate:          # the gate's other kernels: the backward's scan and each block's state, both ways
            chunk, stages, warps = scan._scan_launch(_pow2(M), True)
            rows.append({"kernel": "_block_scan", "M": M, "chunk": chunk, "stages": stages, "warps": warps,
                         "gate": True, "reverse": True, **block_scan(M, gate=True, reverse=True)})
            for reverse in (False, True):
                rows.append({"kernel": "_block_state", "M": M, "chunk": chunk, "stages": stages, "warps": warps,
                             "gate": True, "reverse": reverse, **block_state(M, reverse)})
            rows.append({"kernel": "_decode_step", "M": M, "warps": 4, "gate": True, **decode_step(M)})
        for precision in (half, EXACT):      # 16-bit inputs, float32 inputs
            rows.append({"kernel": "_prf_features", "M": M, "precision": precision, "warps": prf.PRF_WARPS,
                         **prf_features(M, precision, prf.PRF_WARPS)})
    for M in dims:             # the window hybrid's decode step: window 64 with a sink of 4, or with a decay
        for sink, decay in ((4, False), (0, True)):
            rows.append({"kernel": "_prf_ring_step", "M": M, "warps": hybrid.RING_WARPS, "sink": sink, "decay": decay,
                         **ring_step(M, 64, sink, decay, hybrid.RING_WARPS)})
    for sink in (0, 16):
        rows.append({"kernel": "_window_exact", "M": "any", "precision": "bf16", "warps": hybrid.WINDOW_WARPS,
                     "sink": sink, **window_exact("bf16", hybrid.WINDOW_WARPS, sink)})
    if args.variants:
        for M, chunk, warps, (decay, gate) in itertools.product(dims, (32, 64), (4, 8),
                                                                ((False, False), (True, False), (False, True))):
            if (chunk, warps) != tuple(scan._scan_launch(_pow2(M), gate)[::2]):
                rows.append({"kernel": "_block_scan", "M": M, "chunk": chunk,
                             "stages": scan._scan_launch(_pow2(M), gate)[1], "warps": warps, "decay": decay,
                             "gate": gate, "variant": True, **block_scan(M, warps, chunk, decay, gate)})
        for M, precision, warps in itertools.product(dims, ("bf16", "ieee", "tf32x3", "tf32"), (4, 8)):
            if precision != "bf16":          # the projection's directions are float32
                rows.append({"kernel": "_prf_features", "M": M, "precision": precision, "warps": warps,
                             "variant": True, **prf_features(M, precision, warps)})
        for precision, warps in itertools.product(("bf16", "ieee", "tf32x3", "tf32"), (4, 8)):
            rows.append({"kernel": "_window_exact", "M": "any", "precision": precision, "warps": warps,
                         "variant": True, **window_exact(precision, warps)})
        for M, warps in itertools.product(dims, (2, 4, 8)):
            if warps != hybrid.RING_WARPS:
                rows.append({"kernel": "_prf_ring_step", "M": M, "warps": warps, "sink": 4, "variant": True,
                             **ring_step(M, 64, 4, False, warps)})
    for row in rows:
        print(f"{row['kernel']:>14} M={str(row['M']):<4} {row.get('precision', ''):>7} "
              f"{'decay' if row.get('decay') else 'gate' if row.get('gate') else '':>5} "
              f"{'rev' if row.get('reverse') else 'sink' if row.get('sink') else '':>4} "
              f"{'C=' + str(row['chunk']) if 'chunk' in row else '':>4} warps={row['warps']:<2} "
              f"registers={row['registers']:<4} spill stores={row['spill_stores']:<5} loads={row['spill_loads']}",
              flush=True)
    result = {"target": "sm_90", "triton": triton.__version__, "ptxas": str(PTXAS.name), "rows": rows,
              "command": " ".join(sys.argv)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
