"""What dofattn's Triton kernels share: the precision of the dots that make exponents, the scan's block plan, tile
sizes, the dots' dtype for the inputs' dtypes, and whether the kernels run in Triton's interpreter.

Dots run in bf16/fp16 when φq, φk and v are all 16-bit (value tiles at least 64 wide), else in tf32x3 (about
float32 accuracy); the state, sums and outputs are float32. Dots that make exponents stay near float32 accuracy
(`EXACT`): the feature projection in ieee (float32 x) or tf32x3 (16-bit x); the window's exact logits in ieee
(float32) or in 16-bit dots of the 16-bit q and k, whose products are exact.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Precision of the float32 dots that make exponents: the PRF projection (16-bit x against float32 directions) and,
# for float32 inputs, the window's exact logits and weights × values (forward). Float32 inputs: "ieee", exact to
# float32 rounding at exponents near 200 (on the FMA units: slow, and its operand tiles spill registers). The
# projection of 16-bit x: "tf32x3" (tensor cores, three tf32 products: near float32 accuracy, far under 16-bit
# rounding; no spills in ptxas' report, `benchmarks/kernel_registers.py`). The window's exact part on
# 16-bit q, k, v takes 16-bit dots instead: the products of 16-bit numbers are exact in float32, and the weights go
# to 16 bits for the values' dot, as in FlashAttention. `benchmarks/cuda_ops.py --exact` times alternatives.
EXACT = "ieee"
EXACT_HALF = "tf32x3"


def exact_precision(x: torch.Tensor) -> str:
    return EXACT_HALF if x.dtype in (torch.bfloat16, torch.float16) else EXACT


def _dot_dtype(*xs: torch.Tensor):
    half = all(x.dtype in (torch.bfloat16, torch.float16) for x in xs) and len({x.dtype for x in xs}) == 1
    if half:
        return (tl.bfloat16 if xs[0].dtype == torch.bfloat16 else tl.float16), "tf32"   # PREC unused for 16-bit
    return tl.float32, "tf32x3"


def _value_tile(BV: int, *dots) -> int:
    """The value tile for kernels whose dots run in `dots`: 16-bit dots against a tile under 64 columns have
    faulted (illegal address) or given wrong results on an H100, so those get 64 (masked)."""
    return max(BV, 64) if any(dot != tl.float32 for dot in dots) else BV


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: the kernels then run on CPU tensors (slowly), for tests without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _tile(n: int) -> int:
    """A power-of-two tile of at least 2 for n rows (ring slots, sink slots): no dot needs 16."""
    return max(2, triton.next_power_of_2(n))


CHUNK = 64           # tokens per chunk inside a block (the tril product is C × C); 32/16 for wide features
MAX_TILE = 128 * 64  # state elements a program keeps in registers: M_pad × V_tile
INTERPRETER_SMS = 8  # the streaming multiprocessors the block plan assumes off CUDA (tests/gpu_dots.py sets a GPU's)


def _plan(T: int, BH: int, K: int, V: int, device: torch.device, block: int | None = None) -> tuple[int, int, int]:
    """(L, BK, BV): block length (a power-of-two multiple of CHUNK, or `block`), padded feature tile, value tile."""
    BK = _pow2(K)
    BV = min(_pow2(V), max(16, MAX_TILE // BK))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_SMS
    if block is not None:
        if block < CHUNK or block & (block - 1):
            raise ValueError(f"block must be a power of two >= {CHUNK}, got {block}")
        return block, BK, BV
    L = CHUNK
    while L < 1024 and -(-T // (2 * L)) * BH >= 2 * sms:   # longer blocks while two programs per SM remain
        L *= 2
    return L, BK, BV
