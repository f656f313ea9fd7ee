"""Causal linear attention on CUDA through flash-linear-attention's Triton kernels (`pip install fla-core`).

    o, state = fla_linear_attention(phi_q, phi_k, v, initial_state=None, output_final_state=True)

Same layout, math and result as `naive.py` (the spec): phi_q, phi_k [B, T, H, M], v [B, T, H, V],
state [B, H, M, V+1] (float32), o [B, T, H, V] in v.dtype. fla's unnormalised `chunk_linear_attn` runs on the
augmented values [v, 1], so the numerator and the denominator come out of one kernel call; the ratio is taken here
with the spec's max(den, tiny). Inputs are upcast to float32 before the call (the spec computes in float32; fla's
16-bit backward also rejects odd K or V, and V+1 is odd whenever V is even).

fla is imported lazily, on the first call: importing dofattn never needs it. Without fla or CUDA this raises a
RuntimeError saying what to install or use instead; `fla_available()` says beforehand.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dofattn.ops.naive import augment_values, check_inputs, normalise


def optional(importer: Callable[[], object]) -> tuple[object | None, str]:
    """What `importer` returns and '' if it runs, else (None, why not): the one path by which a kernel package that
    may be missing or fail to load (dofattn's Triton kernels, fla) is loaded."""
    try:
        return importer(), ""
    except Exception as error:                                         # ImportError, or Triton failing to load
        return None, f"{type(error).__name__}: {error}"


@functools.cache
def load_fla() -> tuple[Callable | None, str]:
    """fla's `chunk_linear_attn` and '' if it imports, else (None, why not)."""
    return optional(lambda: importlib.import_module("fla.ops.linear_attn").chunk_linear_attn)


def fla_available() -> bool:
    """True if flash-linear-attention imports and CUDA is available."""
    return torch.cuda.is_available() and load_fla()[0] is not None


def fla_kwargs(chunk_linear_attn: Callable) -> dict:
    """Keyword arguments that differ between fla versions: older ones take `head_first` (and need it False)."""
    try:
        params = inspect.signature(chunk_linear_attn).parameters
    except (TypeError, ValueError):                                    # no introspectable signature: pass none
        return {}
    return {"head_first": False} if "head_first" in params else {}


def fla_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                         initial_state: torch.Tensor | None = None,
                         output_final_state: bool = False,
                         normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention with fla's chunked Triton kernel (CUDA only).

    phi_q, phi_k: [B, T, H, M]; v: [B, T, H, V]; initial_state: [B, H, M, V+1] or None (zeros).
    Returns o [B, T, H, V] in v.dtype and the final state [B, H, M, V+1] (float32) if output_final_state.
    """
    check_inputs(phi_q, phi_k, v, initial_state)
    chunk_linear_attn, why = load_fla()
    if chunk_linear_attn is None:
        raise RuntimeError(f"fla_linear_attention needs flash-linear-attention (`pip install fla-core`), which "
                           f"did not import ({why}); use backend='chunk' instead")
    if not (torch.cuda.is_available() and phi_q.is_cuda):
        raise RuntimeError(f"fla_linear_attention needs CUDA tensors, got phi_q on {phi_q.device}; "
                           f"use backend='chunk' on CPU")
    B, T, H, M = phi_q.shape
    q, k = phi_q.float(), phi_k.float()                                # [B, T, H, M]
    v_aug = augment_values(v, torch.float32)                           # [B, T, H, V+1]
    if T < H:
        # Older fla rejects T < H as a likely head-first layout; trailing zero tokens change nothing before them.
        q, k, v_aug = (F.pad(x, (0, 0, 0, 0, 0, H - T)) for x in (q, k, v_aug))
    S0 = None if initial_state is None else initial_state.float().contiguous()   # [B, H, M, V+1]

    o_aug, final_state = chunk_linear_attn(q=q, k=k, v=v_aug, scale=1.0, initial_state=S0,
                                           output_final_state=output_final_state, normalize=False,
                                           **fla_kwargs(chunk_linear_attn))
    o_aug = o_aug[:, :T].float()                                       # [B, T, H, V+1]
    o = normalise(o_aug, v.dtype) if normalize else o_aug              # [B, T, H, V] or [num, den]
    return o, (final_state.float() if output_final_state else None)
