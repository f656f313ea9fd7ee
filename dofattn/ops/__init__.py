"""Causal, ratio-normalised linear attention on precomputed nonnegative features, with one entry point.

    from dofattn.ops import linear_attention
    o, state = linear_attention(phi_q, phi_k, v, output_final_state=True)            # prefill
    o, state = linear_attention(phi_q1, phi_k1, v1, initial_state=state,              # decode, T = 1
                                output_final_state=True)

Layout, frozen: phi_q, phi_k [B, T, H, M] (nonnegative), v [B, T, H, V], state [B, H, M, V+1] float32
(Σ φk ⊗ v in the first V columns, the normaliser Σ φk in the last), o [B, T, H, V] in v.dtype.
o_t = (φq_t · S_t)[:V] / max((φq_t · S_t)[V], tiny) with S_t = S_0 + Σ_{j≤t} φk_j ⊗ [v_j, 1].

Backends, all with the same signature and result (`naive.py` is the spec the others are tested against):
    naive       quadratic masked form, O(T²) memory: the reference
    chunk       chunked parallel form in pure PyTorch, CPU and CUDA
    recurrent   token by token: the decode path
    triton      dofattn's own Triton kernels (`triton/scan.py`; CUDA, needs the `triton` package), forward and
                backward
    fla         flash-linear-attention's Triton kernel (CUDA, `pip install fla-core`)
    auto        for CUDA inputs triton when it imports (its decode step for T = 1); else recurrent when T == 1;
                else fla for CUDA inputs when it imports; else chunk

A per-head decay (`log_decay` [H], see `naive.py`) runs on naive, chunk, recurrent and triton; auto picks as
without one but never fla (triton on CUDA when it imports, else recurrent for T = 1 and chunk otherwise), and
asking fla for a decay is a ValueError. A gate (`log_gate` [B, T, H], a decay per token) runs on naive, chunk,
recurrent and triton: auto picks as for a decay (triton on CUDA when it imports, else recurrent for T = 1 and chunk
otherwise); asking fla for one is a ValueError.
"""

from __future__ import annotations

import functools
import importlib

import torch

from dofattn.ops.chunk import chunk_linear_attention
from dofattn.ops.fla import fla_available, fla_linear_attention, optional
from dofattn.ops.naive import check_inputs, naive_linear_attention
from dofattn.ops.recurrent import recurrent_linear_attention


@functools.cache
def load_triton():
    """dofattn's Triton kernels (the package `ops.triton`: modules scan, prf, window) and '' if they import, else
    (None, why not)."""
    return optional(lambda: importlib.import_module("dofattn.ops.triton"))


def triton_available() -> bool:
    """True if Triton imports and CUDA is available (the `triton` backend can run)."""
    return torch.cuda.is_available() and load_triton()[0] is not None


def triton_linear_attention(phi_q, phi_k, v, initial_state=None, output_final_state=False, normalize=True,
                            log_decay=None, log_gate=None):
    """`ops.triton.scan.triton_linear_attention` (CUDA, Triton), imported on first use; RuntimeError without
    Triton."""
    kernels, why = load_triton()
    if kernels is None:
        raise RuntimeError(f"backend 'triton' needs the triton package, which did not import ({why}); "
                           f"use backend='chunk' instead")
    return kernels.scan.triton_linear_attention(phi_q, phi_k, v, initial_state, output_final_state, normalize,
                                                log_decay, log_gate)


BACKENDS = {
    "naive": naive_linear_attention,
    "chunk": chunk_linear_attention,
    "recurrent": recurrent_linear_attention,
    "triton": triton_linear_attention,
    "fla": fla_linear_attention,
}

__all__ = ["linear_attention", "naive_linear_attention", "chunk_linear_attention", "recurrent_linear_attention",
           "triton_linear_attention", "fla_linear_attention", "fla_available", "triton_available", "load_triton",
           "pick_backend", "BACKENDS", "GATE_BACKENDS"]


DECAY_BACKENDS = ("naive", "chunk", "recurrent", "triton")
GATE_BACKENDS = ("naive", "chunk", "recurrent", "triton")


def pick_backend(phi_q: torch.Tensor, backend: str = "auto", decay: bool = False, gate: bool = False) -> str:
    """The backend `linear_attention` runs for these inputs ([B, T, H, M] queries, with a decay, a gate or
    neither); ValueError if unknown or without support for the decay or gate."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {['auto', *BACKENDS]}")
    if decay and backend not in ("auto", *DECAY_BACKENDS):
        raise ValueError(f"backend {backend!r} has no decay; use one of {list(DECAY_BACKENDS)} or 'auto'")
    if gate and backend not in ("auto", *GATE_BACKENDS):
        raise ValueError(f"backend {backend!r} has no gate; use one of {list(GATE_BACKENDS)} or 'auto'")
    if backend != "auto":
        return backend
    if phi_q.is_cuda and triton_available():
        return "triton"                                                 # T = 1 included: the one-kernel step
    if phi_q.shape[1] == 1:
        return "recurrent"
    if phi_q.is_cuda and fla_available() and not (decay or gate):
        return "fla"
    return "chunk"


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     backend: str = "auto", normalize: bool = True,
                     log_decay: torch.Tensor | None = None,
                     log_gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention with the chosen backend (see the module docstring).

    phi_q, phi_k: [B, T, H, M]; v: [B, T, H, V]; initial_state: [B, H, M, V+1] or None (zeros).
    Returns o [B, T, H, V] in v.dtype and the final state [B, H, M, V+1] if output_final_state, else None.
    normalize=False returns the unnormalised [num, den] [B, T, H, V+1] (float32, float64 for float64 inputs) for o.
    log_decay: [H] (≤ 0) or None: each head's state decays by exp(log_decay) per token.
    log_gate: [B, T, H] (≤ 0) or None: the state decays by exp(log_gate_t) before token t (not with log_decay).
    """
    check_inputs(phi_q, phi_k, v, initial_state, log_decay, log_gate)
    name = pick_backend(phi_q, backend, decay=log_decay is not None, gate=log_gate is not None)
    decay = {} if log_decay is None else {"log_decay": log_decay}
    if log_gate is not None:
        decay["log_gate"] = log_gate
    return BACKENDS[name](phi_q, phi_k, v, initial_state=initial_state, output_final_state=output_final_state,
                          normalize=normalize, **decay)
