"""Pytest plugin: Triton's interpreter computes dots as a GPU does, so CPU runs see GPU rounding.

tests/conftest.py loads it for every run without CUDA where Triton imports, so the Triton kernels' tests
(tests/test_triton_*.py; the interpreter is their CPU path) see a GPU's rounding by default. Its settings:

    DOFATTN_DOTS=tf32x3   the default: float32 dots that ask for tf32x3 are computed as a GPU's tf32x3, and
                          those that ask for tf32 as tf32
    DOFATTN_DOTS=tf32     every float32 dot that asks for tf32 or tf32x3 rounds its operands to tf32 (the precision
                          of kernels that ask for nothing)
    DOFATTN_DOTS=off      the plugin does nothing: the interpreter's own full-float32 dots
    DOFATTN_SMS=N         the streaming multiprocessors the scan's block plan assumes (default 132, an H100 SXM or
                          an H200), as on that GPU, instead of the interpreter's 8 (not with DOFATTN_DOTS=off)
    -p no:tests.gpu_dots  on the pytest command line: not loaded at all, as DOFATTN_DOTS=off

    DOFATTN_DOTS=tf32 python3 -m pytest tests/test_triton_scan.py -s -k gate_limits

The interpreter computes every float32 `tl.dot` in full float32, whatever its `input_precision`. On an sm_80+ GPU
"tf32x3" splits each operand into a tf32 part and a tf32 remainder and sums three tf32 products, and "tf32" rounds
each operand to 10 mantissa bits: errors the interpreter never shows. Here each float32 dot is computed as its
precision asks, and bf16 operands are widened exactly before the product.

It replaces a method of Triton's interpreter (`InterpreterBuilder.create_dot`, Triton 3.x), so a later Triton may
need it changed; where that method is missing it refuses to load (and says to set DOFATTN_DOTS=off), rather than
let the tests pass without GPU rounding.
"""

from __future__ import annotations

import os

import numpy as np

os.environ["TRITON_INTERPRET"] = "1"

import triton.runtime.interpreter as interpreter  # noqa: E402

MODE = os.environ.get("DOFATTN_DOTS", "tf32x3")
if MODE not in ("tf32x3", "tf32", "off"):
    raise ValueError(f"DOFATTN_DOTS={MODE!r}: give tf32x3 (a GPU's split dots), tf32 (every float32 dot in tf32) or "
                     f"off (the interpreter's float32 dots)")
if MODE != "off" and not hasattr(interpreter.InterpreterBuilder, "create_dot"):
    raise RuntimeError(f"tests.gpu_dots: Triton {__import__('triton').__version__}'s interpreter has no create_dot "
                       f"to replace; update tests/gpu_dots.py, or set DOFATTN_DOTS=off to run without GPU rounding")

MANTISSA = np.uint32(0xFFFFE000)    # keeps sign, exponent and the top 10 mantissa bits of a float32


def tf32_round(x: np.ndarray) -> np.ndarray:
    """To the nearest tf32 (ties away from zero), as the tensor cores round an operand."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & MANTISSA).astype(np.uint32).view(np.float32).reshape(x.shape)


def tf32_chop(x: np.ndarray) -> np.ndarray:
    """To tf32 by truncation (the remainder's part in a tf32x3 dot)."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & MANTISSA).view(np.float32).reshape(x.shape)


def _widen_bf16(x: np.ndarray) -> np.ndarray:
    """The interpreter keeps bf16 as uint16 bit patterns: their exact float32 values."""
    return (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x.astype(np.float32)


_create_dot = getattr(interpreter.InterpreterBuilder, "create_dot", None)


def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    A, B = a.data, b.data
    if np.uint16 in (A.dtype, B.dtype):
        product = np.matmul(_widen_bf16(A), _widen_bf16(B), dtype=np.float32)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)
    if A.dtype == np.float32 and B.dtype == np.float32:
        precision = str(input_precision).upper()
        if "TF32X3" in precision and MODE == "tf32x3":
            a_hi, b_hi = tf32_round(A), tf32_round(B)
            a_lo, b_lo = tf32_chop(A - a_hi), tf32_chop(B - b_hi)
            product = (np.matmul(a_lo, b_hi, dtype=np.float32) + np.matmul(a_hi, b_lo, dtype=np.float32)
                       + np.matmul(a_hi, b_hi, dtype=np.float32))
            return interpreter.TensorHandle((product + d.data).astype(np.float32), d.dtype.scalar)
        if "TF32" in precision:
            product = np.matmul(tf32_round(A), tf32_round(B), dtype=np.float32)
            return interpreter.TensorHandle((product + d.data).astype(np.float32), d.dtype.scalar)
    return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


def pytest_configure(config):
    if MODE == "off":
        return
    from dofattn.ops.triton import common

    interpreter.InterpreterBuilder.create_dot = create_dot
    common.INTERPRETER_SMS = int(os.environ.get("DOFATTN_SMS", "132"))
