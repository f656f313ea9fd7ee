"""Linear attention whose state is written by the delta rule: a token can overwrite what its key already holds.

    o, state = delta_attention(phi_q, phi_k, v, beta, log_gate=None, initial_state=None, output_final_state=True)

Layout as for `linear_attention` (`naive.py`): phi_q, phi_k [B, T, H, M] (nonnegative), v [B, T, H, V],
beta [B, T, H] in [0, 1], log_gate [B, T, H] (≤ 0) or None, state [B, H, M, V+1] float32, o [B, T, H, V] in v.dtype.

Math. With k̂_t = φk_t / |φk_t| (0 for a zero key) and g_t = exp(log_gate_t) (1 without a gate):
    S_t = g_t (I - β_t k̂_t k̂_tᵀ) S_{t-1} + φk_t ⊗ v_t          the numerator's state, [M, V]
    c_t = g_t c_{t-1} + φk_t                                    the normaliser, [M]
    o_t = (φq_t · S_t) / max(φq_t · c_t, tiny)
Before writing, token t removes the fraction β_t of what the state returns for its own key direction; β = 0 is
gated linear attention (`linear_attention` with `log_gate`), exactly. The normaliser stays the sum of the kernel's
weights, so what a token erases leaves its row as weight on nothing: the output shrinks instead of being rescaled,
and the denominator stays a sum of positive terms (an erased normaliser could cross zero). Each factor
g (I - β k̂k̂ᵀ) is a contraction for β in [0, 1], so the state stays as bounded as linear attention's.
The state keeps the frozen layout: state[..., :V] = S, state[..., V] = c.

Backends:
    recurrent   the recurrence above, token by token: the reference, and the decode path
    chunk       the same in chunks of C tokens (pure PyTorch, CPU and CUDA, with autograd): within a chunk the
                writes δ_i = |φk_i| v_i − β_i g·(what S holds along k̂_i) solve one unit lower-triangular system
                (I + L) Δ = |φk| v − diag(β γ) K̂ S_0, with L_ti = β_t (γ_t/γ_i) k̂_t·k̂_i for i < t and γ the gates'
                running product inside the chunk; then o_t = γ_t φq_t·S_0 + Σ_{i≤t} (γ_t/γ_i) (φq_t·k̂_i) δ_i, and the
                chunk hands on γ_C S_0 + Σ_i (γ_C/γ_i) k̂_i δ_i. Only that hand-on runs in a loop over chunks.
    auto        recurrent for T = 1, else chunk
Every ratio of gates is the exp of a sum of the gate's own logs (`naive.segment_sums`): ≤ 1, nothing cancels.
Computed in float32 (float64 when any input is float64); the output is cast back to v.dtype.
"""

from __future__ import annotations

import torch

from dofattn.ops.chunk import from_chunks, to_chunks
from dofattn.ops.naive import TINY, check_inputs, compute_dtype, gate_log, segment_sums, suffix_sums

DELTA_BACKENDS = ("recurrent", "chunk")


def check_beta(beta: torch.Tensor, shape: tuple[int, int, int]) -> None:
    """ValueError unless beta is a floating-point [B, T, H] tensor."""
    if tuple(beta.shape) != tuple(shape) or not beta.is_floating_point():
        raise ValueError(f"beta must be a floating-point [B, T, H] = {tuple(shape)} tensor (each token's erase "
                         f"strength, in [0, 1]), got {tuple(beta.shape)} {beta.dtype}")


def unit_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., M] -> (k / |k| with 0 for a zero key, |k| [..., 1]). A zero key is divided by 1, not by a clamped
    norm: its gradient stays that of k itself, where 1/tiny would reach ~1e38 and overflow a backward pass. The
    norm is taken of k over its largest entry, so entries up to the dtype's limit do not overflow its squares."""
    scale = k.abs().amax(-1, keepdim=True)
    scaled = k / torch.where(scale > 0, scale, torch.ones_like(scale))
    norm = torch.linalg.vector_norm(scaled, dim=-1, keepdim=True)
    return scaled / torch.where(norm > 0, norm, torch.ones_like(norm)), norm * scale


def recurrent_delta_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                              log_gate: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                              output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta-rule linear attention (module docstring) one token at a time: the reference."""
    check_inputs(phi_q, phi_k, v, initial_state, log_gate=log_gate)
    check_beta(beta, phi_q.shape[:3])
    dtype = compute_dtype(phi_q, phi_k, v, initial_state)
    B, T, H, M = phi_q.shape
    V = v.shape[-1]
    q, k, vv = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    b = beta.to(dtype).clamp(0, 1)
    S = q.new_zeros(B, H, M, V) if initial_state is None else initial_state[..., :V].to(dtype)
    c = q.new_zeros(B, H, M) if initial_state is None else initial_state[..., V].to(dtype)
    g = None if log_gate is None else torch.exp(gate_log(log_gate, dtype))        # [B, H, T]
    outputs = []
    for t in range(T):
        kt = k[:, t]                                                               # [B, H, M]
        unit, norm = unit_keys(kt)
        held = torch.einsum("bhm,bhmv->bhv", unit, S)                              # what S returns along k̂
        S = S - (b[:, t, :, None, None] * unit[..., None]) * held[:, :, None, :]
        if g is not None:
            S, c = g[:, :, t, None, None] * S, g[:, :, t, None] * c
        S = S + (unit * norm)[..., None] * vv[:, t, :, None, :]   # φk as k̂|φk|, as the chunks write it
        c = c + kt
        num = torch.einsum("bhm,bhmv->bhv", q[:, t], S)
        den = torch.einsum("bhm,bhm->bh", q[:, t], c)
        outputs.append(num / den.clamp_min(TINY)[..., None])
    o = torch.stack(outputs, dim=1).to(v.dtype)                                    # [B, T, H, V]
    return o, (torch.cat([S, c[..., None]], -1) if output_final_state else None)


def chunk_delta_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                          log_gate: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                          output_final_state: bool = False,
                          chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta-rule linear attention in chunks (module docstring): equal to the recurrent form up to rounding."""
    check_inputs(phi_q, phi_k, v, initial_state, log_gate=log_gate)
    check_beta(beta, phi_q.shape[:3])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    dtype = compute_dtype(phi_q, phi_k, v, initial_state)
    B, T, H, M = phi_q.shape
    V = v.shape[-1]
    C = min(chunk_size, T)
    q = to_chunks(phi_q.to(dtype), C)                                              # [B, H, N, C, M]
    k = to_chunks(phi_k.to(dtype), C)                                              # zero keys on padding
    vv = to_chunks(v.to(dtype), C)                                                 # [B, H, N, C, V]
    b = to_chunks(beta.to(dtype).clamp(0, 1)[..., None], C)[..., 0]               # [B, H, N, C]
    if log_gate is None:
        x = torch.zeros_like(b)
    else:
        x = to_chunks(gate_log(log_gate, dtype).transpose(1, 2)[..., None], C)[..., 0]   # 0 on padding
    unit, norm = unit_keys(k)                                                      # [B, H, N, C, M], [.., C, 1]
    start = torch.exp(x.cumsum(-1))[..., None]                                     # γ_t from the chunk's start
    inside = torch.exp(segment_sums(x))                                            # γ_t / γ_i, 0 for i ≥ t
    to_end = torch.exp(suffix_sums(x))[..., None]                                  # γ_C / γ_i
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    L = (b[..., None] * inside * (unit @ unit.transpose(-1, -2))).masked_fill(~lower, 0.0)
    eye = torch.eye(C, dtype=dtype, device=q.device)
    # (I + L) [U | P] = [|φk| v | diag(β γ) K̂]: the writes are U − P S_0 for the state S_0 entering the chunk
    solved = torch.linalg.solve_triangular(eye + L, torch.cat([norm * vv, (b[..., None] * start) * unit], -1),
                                           upper=False, unitriangular=True)
    U, P = solved[..., :V], solved[..., V:]
    diag = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = ((q @ unit.transpose(-1, -2)) * inside).masked_fill(~diag, 0.0)            # (γ_t/γ_i) φq_t·k̂_i, i ≤ t
    den_in = ((q @ k.transpose(-1, -2)) * inside).masked_fill(~diag, 0.0).sum(-1)  # Σ_{i≤t} (γ_t/γ_i) φq_t·φk_i
    kc = (k * to_end).sum(-2)                                                      # [B, H, N, M]: a chunk's Σ φk
    S = q.new_zeros(B, H, M, V) if initial_state is None else initial_state[..., :V].to(dtype)
    c = q.new_zeros(B, H, M) if initial_state is None else initial_state[..., V].to(dtype)
    nums, dens = [], []
    total = start[..., -1, 0]                                                      # [B, H, N]: γ_C
    for n in range(q.shape[2]):
        writes = U[:, :, n] - P[:, :, n] @ S                                       # [B, H, C, V]
        nums.append(start[:, :, n] * (q[:, :, n] @ S) + A[:, :, n] @ writes)
        dens.append(start[:, :, n, :, 0] * torch.einsum("bhcm,bhm->bhc", q[:, :, n], c) + den_in[:, :, n])
        S = total[:, :, n, None, None] * S + (unit[:, :, n] * to_end[:, :, n]).transpose(-1, -2) @ writes
        c = total[:, :, n, None] * c + kc[:, :, n]
    num = torch.stack(nums, 2)                                                     # [B, H, N, C, V]
    den = torch.stack(dens, 2)[..., None]                                          # [B, H, N, C, 1]
    o = from_chunks(num / den.clamp_min(TINY), T).to(v.dtype).contiguous()         # [B, T, H, V]
    return o, (torch.cat([S, c[..., None]], -1) if output_final_state else None)


def delta_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                    log_gate: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                    output_final_state: bool = False,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta-rule linear attention (module docstring) on `backend`: recurrent, chunk or auto (recurrent for
    one token, else chunk)."""
    if backend not in ("auto", *DELTA_BACKENDS):
        raise ValueError(f"the delta rule runs on {list(DELTA_BACKENDS)} or 'auto', got backend {backend!r}")
    if backend == "auto":
        backend = "recurrent" if phi_q.shape[1] == 1 else "chunk"
    op = recurrent_delta_attention if backend == "recurrent" else chunk_delta_attention
    return op(phi_q, phi_k, v, beta, log_gate, initial_state, output_final_state)
