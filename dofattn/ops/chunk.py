"""Chunked parallel causal linear attention in pure PyTorch (CPU and CUDA): the training/prefill path.

    o, state = chunk_linear_attention(phi_q, phi_k, v, initial_state=None, output_final_state=True, chunk_size=64)

Same layout, math and precision as `naive.py` (the spec): phi_q, phi_k [B, T, H, M], v [B, T, H, V],
state [B, H, M, V+1] (float32), o [B, T, H, V] in v.dtype.

The sequence is cut into N = ⌈T/C⌉ chunks of C tokens (the last one zero-padded: a zero key adds nothing to the
state and padded outputs are dropped). Within a chunk the masked quadratic form runs as one batched matmul
([C, C] per chunk); across chunks, the state before chunk n is S_0 + Σ_{m<n} φk_mᵀ [v_m, 1], an exclusive
cumulative sum of the per-chunk states, applied with one more batched matmul. Cost O(T·C·(M+V) + T·M·V).

With a decay (`log_decay` [H], see `naive.py`) the same three products carry factors of γ: within a chunk the
[C, C] scores are scaled by γ^(t-s); a key enters its chunk's state scaled by γ^(C-1-s); the state entering
chunk n is Σ_{m<n} γ^(C(n-1-m)) kv_m + γ^(nC) S_0 (a decayed prefix sum: an [N, N] matrix of factors for up to
MATRIX_CHUNKS chunks, a loop beyond); query t reads it scaled by γ^(t+1). Every factor is exp(log γ × a distance
≥ 0), so nothing overflows however strong the decay.

With a gate (`log_gate` [B, T, H], a decay per token) the same products carry exp of sums of the gate's logs in
place of γ's powers: within a chunk exp(Σ_{s<j≤t} x_j), a key to its chunk's end exp(Σ_{s<j<C} x_j), a query from
its chunk's start exp(Σ_{j≤t} x_j), and across chunks the chunk totals in the same roles. Each sum is taken over
its own terms (`naive.segment_sums`), so nothing cancels.

Why a cumulative sum and not a loop over chunks: the forward costs about the same either way, but the backward
through a loop is autograd through N small steps, several times slower on a CPU (benchmarks/ops_cpu.py measures
it). Almost all the time is in the four batched matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dofattn.ops.naive import (augment_values, check_inputs, compute_dtype, decay_factors, decay_log, decay_matrix,
                               gate_log, normalise, segment_sums, suffix_sums)

MATRIX_CHUNKS = 64   # decayed prefix sum over chunks: one [N, N] product up to this many chunks, a loop beyond


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


def decayed_states_before_chunks(kv: torch.Tensor, initial_state: torch.Tensor | None, log_decay: torch.Tensor,
                                 chunk_size: int) -> torch.Tensor:
    """Per-chunk states [B, H, N, M, V+1] (keys already scaled by γ^(C-1-s)) -> the state entering each chunk:
    Σ_{m<n} γ^(C(n-1-m)) kv_m + γ^(nC) S_0."""
    N = kv.shape[2]
    chunk_log_decay = log_decay * chunk_size                           # [H]: log of one chunk's decay
    if N <= MATRIX_CHUNKS:
        weights = decay_matrix(chunk_log_decay, N, offset=-1)          # [H, N, N]: γ^(C(n-1-m)) for m < n
        before = torch.einsum("hnm,bhmkv->bhnkv", weights, kv)
    else:
        carry, rows = torch.zeros_like(kv[:, :, 0]), []
        factor = torch.exp(chunk_log_decay)[:, None, None]             # [H, 1, 1]
        for n in range(N):
            rows.append(carry)
            carry = factor * carry + kv[:, :, n]
        before = torch.stack(rows, dim=2)
    if initial_state is not None:
        reach = decay_factors(chunk_log_decay, torch.arange(N, device=kv.device))   # [N, H]: γ^(nC)
        before = before + reach.T[None, :, :, None, None] * initial_state.unsqueeze(2)
    return before


def chunk_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           chunk_size: int = 64, normalize: bool = True,
                           log_decay: torch.Tensor | None = None,
                           log_gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention, chunked: equal to `naive_linear_attention` up to float rounding.

    phi_q, phi_k: [B, T, H, M]; v: [B, T, H, V]; initial_state: [B, H, M, V+1] or None (zeros).
    chunk_size: tokens per chunk (any positive int; need not divide T, capped at T).
    Returns o [B, T, H, V] in v.dtype and the final state [B, H, M, V+1] if output_final_state, else None.
    log_decay: [H] (≤ 0) or None, log_gate: [B, T, H] (≤ 0) or None, as in `naive_linear_attention`.
    """
    check_inputs(phi_q, phi_k, v, initial_state, log_decay, log_gate)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    dtype = compute_dtype(phi_q, phi_k, v, initial_state)
    T = phi_q.shape[1]
    C = min(chunk_size, T)
    S0 = None if initial_state is None else initial_state.to(dtype)   # [B, H, M, V+1]

    q = to_chunks(phi_q.to(dtype), C)                                  # [B, H, N, C, M]
    k = to_chunks(phi_k.to(dtype), C)                                  # [B, H, N, C, M]
    v_aug = to_chunks(augment_values(v, dtype), C)                     # [B, H, N, C, V+1]

    if log_gate is not None:
        x = to_chunks(gate_log(log_gate, dtype).transpose(1, 2)[..., None], C)[..., 0]   # [B, H, N, C], 0 padded
        return _gated(q, k, v_aug, S0, x, T, output_final_state, normalize, v.dtype)
    if log_decay is not None:
        return _decayed(q, k, v_aug, S0, decay_log(log_decay, dtype), T, output_final_state, normalize, v.dtype)
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


def _decayed(q: torch.Tensor, k: torch.Tensor, v_aug: torch.Tensor, S0: torch.Tensor | None, log_decay: torch.Tensor,
             T: int, output_final_state: bool, normalize: bool, out_dtype: torch.dtype):
    """`chunk_linear_attention` with a decay, on chunked q, k [B, H, N, C, M] and v_aug [B, H, N, C, V+1]."""
    C = q.shape[3]
    steps = torch.arange(C + 1, device=q.device)
    inside = decay_matrix(log_decay, C)[:, None]                       # [H, 1, C, C]: γ^(t-s), s ≤ t
    A = (q @ k.transpose(-1, -2)) * inside                             # [B, H, N, C, C]
    to_end = decay_factors(log_decay, steps[:C].flip(0)).T[:, None, :, None]   # [H, 1, C, 1]: γ^(C-1-s)
    kv = (k * to_end).transpose(-1, -2) @ v_aug                        # [B, H, N, M, V+1]
    from_start = decay_factors(log_decay, steps[1:]).T[:, None, :, None]       # [H, 1, C, 1]: γ^(t+1)
    o_aug = ((q * from_start) @ decayed_states_before_chunks(kv, S0, log_decay, C)).add_(A @ v_aug)

    final_state = None
    if output_final_state:   # Σ_j γ^(T-1-j) φk_j [v_j, 1] + γ^T S_0; padding keys are zero (their factor is clamped)
        N = q.shape[2]
        position = torch.arange(N * C, device=q.device).view(N, C)
        factor = decay_factors(log_decay, (T - 1 - position).clamp_min(0).flatten())   # [N·C, H]
        factor = factor.T.reshape(-1, N, C)[..., None]                 # [H, N, C, 1]
        final_state = torch.einsum("bhncm,bhncv->bhmv", k * factor, v_aug)
        if S0 is not None:
            final_state = final_state + torch.exp(log_decay * T)[:, None, None] * S0
    o_aug = from_chunks(o_aug, T)                                      # [B, T, H, V+1]
    return (normalise(o_aug, out_dtype) if normalize else o_aug), final_state


def _gated(q: torch.Tensor, k: torch.Tensor, v_aug: torch.Tensor, S0: torch.Tensor | None, x: torch.Tensor, T: int,
           output_final_state: bool, normalize: bool, out_dtype: torch.dtype):
    """`chunk_linear_attention` with a gate: chunked q, k [B, H, N, C, M], v_aug [B, H, N, C, V+1] and the gate's
    logs x [B, H, N, C] (0 on padding: a padded position keeps the state as it is)."""
    A = (q @ k.transpose(-1, -2)).tril_() * torch.exp(segment_sums(x))   # [B, H, N, C, C]
    kv = (k * torch.exp(suffix_sums(x))[..., None]).transpose(-1, -2) @ v_aug   # [B, H, N, M, V+1]
    totals = x.sum(-1)                                                 # [B, H, N]: log of each chunk's decay
    N = x.shape[2]
    if N <= MATRIX_CHUNKS:   # weights[n, m] = exp(Σ_{m<i<n} totals_i) for m < n: row n-1 of the segment sums
        reach = torch.exp(segment_sums(totals)).tril()                 # [B, H, N, N]: m ≤ n'
        weights = F.pad(reach[..., :-1, :], (0, 0, 1, 0))              # row n = row n-1, none for n = 0
        before = torch.einsum("bhnm,bhmkv->bhnkv", weights, kv)
    else:
        carry, rows = torch.zeros_like(kv[:, :, 0]), []
        for n in range(N):
            rows.append(carry)
            carry = torch.exp(totals[:, :, n])[..., None, None] * carry + kv[:, :, n]
        before = torch.stack(rows, dim=2)                              # [B, H, N, M, V+1]
    if S0 is not None:   # S_0 reaches chunk n as exp(Σ_{i<n} totals_i)
        start = F.pad(totals[..., :-1], (1, 0)).cumsum(-1)             # [B, H, N]
        before = before + torch.exp(start)[..., None, None] * S0.unsqueeze(2)
    o_aug = ((q * torch.exp(x.cumsum(-1))[..., None]) @ before).add_(A @ v_aug)

    final_state = None
    if output_final_state:   # the last chunk's state at its end; padded positions have a gate of 1 and no key
        final_state = torch.exp(totals[:, :, -1])[..., None, None] * before[:, :, -1] + kv[:, :, -1]
    o_aug = from_chunks(o_aug, T)                                      # [B, T, H, V+1]
    return (normalise(o_aug, out_dtype) if normalize else o_aug), final_state
