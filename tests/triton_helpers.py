"""What the tests of dofattn's Triton kernels (tests/test_triton_*.py) share: the device, the tolerance, inputs on
the device, and decays and gates as leaves.

On CUDA the compiled kernels run. Without a GPU but with the `triton` package installed, the same kernels run in
Triton's interpreter (TRITON_INTERPRET=1, set here and in tests/conftest.py before the kernels are defined) on CPU
tensors, slowly, so the cases stay small; tests/conftest.py loads tests/gpu_dots.py there, so that their float32
dots round as a GPU's do. Without Triton, every test module that imports this one skips.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="needs the triton package")

DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and Triton's interpreter is off", allow_module_level=True)

# Float32 dots run as tf32x3 on the GPU (about float32 accuracy), and so in the interpreter under tests/gpu_dots.py.
RATIO = 2e-4


def on_device(inputs):
    return [None if x is None else x.to(DEVICE) for x in inputs]


def decay_leaf(H: int) -> torch.Tensor:
    """log γ per head, strong to almost none (`test_ops.make_log_decay`), on the device, as a leaf."""
    from tests.test_ops import make_log_decay

    return make_log_decay(H).to(DEVICE).requires_grad_()


def gate_leaf(B: int, T: int, H: int) -> torch.Tensor:
    """Log gates [B, T, H], mostly weak with some strong (`test_ops.make_log_gate`), on the device, as a leaf."""
    from tests.test_ops import make_log_gate

    return make_log_gate(B, T, H).to(DEVICE).requires_grad_()


def skip_wrong_bf16_dots(dtype: torch.dtype):
    """Skips a bf16 case where its dots would come out wrong: in Triton's interpreter without tests/gpu_dots.py,
    whose own bf16 dots are off by orders of magnitude on a plain 16×16 product (the plugin widens bf16 operands
    exactly, as a GPU does)."""
    if CUDA or dtype != torch.bfloat16:
        return
    import triton.runtime.interpreter as interpreter

    if getattr(interpreter.InterpreterBuilder, "create_dot", None).__module__ != "tests.gpu_dots":
        pytest.skip("Triton's interpreter gets bf16 dots wrong without tests/gpu_dots.py")
