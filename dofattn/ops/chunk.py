"""Chunked parallel causal linear attention in pure PyTorch (CPU and CUDA): the training/prefill path.

    o, state = chunk_linear_attention(phi_q, phi_k, v, initial_state=None, output_final_state=True, chunk_size=64)

Same layout, math and precision as `naive.py` (the spec): phi_q, phi_k [B, T, H, M], v [B, T, H, V],
state [B, H, M, V+1] (float32), o [B, T, H, V] in v.dtype.

The sequence is cut into N = ⌈T/C⌉ chunks of C tokens (the last one zero-padded: a zero key adds nothing to the
state and padded outputs are dropped). Within a chunk the masked quadratic form runs as one batched matmul
([C, C] per chunk); across chunks, the state before chunk n is S_0 + Σ_{m<n} φk_mᵀ [v_m, 1], an exclusive
cumulative sum of the per-chunk states, applied with one more batched matmul. Cost O(T·C·(M+V) + T·M·V).

Why a cumulative sum and not a loop over chunks: on a 2-core CPU at T=8192, H=9, M=V=64, C=64, the forward
costs about the same either way (~70 ms), but forward+backward takes ~210 ms with the cumsum against ~600-900 ms
with the loop (autograd through N small steps). Almost all the time is in the four batched matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dofattn.ops.naive import augment_values, check_inputs, compute_dtype, normalise


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, N, C, D], T zero-padded up to N·C."""
    B, T, H, D = x.shape
    N = -(-T // chunk_size)
    x = F.pad(x, (0, 0, 0, 0, 0, N * chunk_size - T))                 # [B, N·C, H, D]
    return x.view(B, N, chunk_size, H, D).permute(0, 3, 1, 2, 4).contiguous()   # [B, H, N, C, D]


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, N, C, D] -> [B, T, H, D], padding dropped."""
    B, H, N, C, D = x.shape
    return x.reshape(B, H, N * C, D)[:, :, :T].transpose(1, 2)


def states_before_chunks(kv: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    """Per-chunk states [B, H, N, M, V+1] -> the state entering each chunk (exclusive prefix sum, plus S_0)."""
    before = F.pad(kv[:, :, :-1], (0, 0, 0, 0, 1, 0)).cumsum(dim=2)   # [B, H, N, M, V+1], zeros first
    if initial_state is not None:
        before = before + initial_state.unsqueeze(2)
    return before


def chunk_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           chunk_size: int = 64, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention, chunked: equal to `naive_linear_attention` up to float rounding.

    phi_q, phi_k: [B, T, H, M]; v: [B, T, H, V]; initial_state: [B, H, M, V+1] or None (zeros).
    chunk_size: tokens per chunk (any positive int; need not divide T, capped at T).
    Returns o [B, T, H, V] in v.dtype and the final state [B, H, M, V+1] if output_final_state, else None.
    """
    check_inputs(phi_q, phi_k, v, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    dtype = compute_dtype(phi_q, phi_k, v, initial_state)
    T = phi_q.shape[1]
    C = min(chunk_size, T)
    S0 = None if initial_state is None else initial_state.to(dtype)   # [B, H, M, V+1]

    q = to_chunks(phi_q.to(dtype), C)                                  # [B, H, N, C, M]
    k = to_chunks(phi_k.to(dtype), C)                                  # [B, H, N, C, M]
    v_aug = to_chunks(augment_values(v, dtype), C)                     # [B, H, N, C, V+1]

    A = (q @ k.transpose(-1, -2)).tril_()                              # [B, H, N, C, C], s ≤ t within a chunk
    kv = k.transpose(-1, -2) @ v_aug                                   # [B, H, N, M, V+1]
    o_aug = (q @ states_before_chunks(kv, S0)).add_(A @ v_aug)         # [B, H, N, C, V+1]

    final_state = None
    if output_final_state:
        final_state = kv.sum(dim=2)                                    # [B, H, M, V+1]
        if S0 is not None:
            final_state = final_state + S0
    o_aug = from_chunks(o_aug, T)                                      # [B, T, H, V+1]
    return (normalise(o_aug, v.dtype) if normalize else o_aug), final_state
