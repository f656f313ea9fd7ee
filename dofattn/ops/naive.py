"""The reference (the spec) for causal, ratio-normalised linear attention on precomputed nonnegative features.

    o, state = naive_linear_attention(phi_q, phi_k, v, initial_state=None, output_final_state=True)

Layout, frozen for the whole package:
    phi_q, phi_k   [B, T, H, M]    nonnegative feature maps of queries and keys (already expanded to H heads)
    v              [B, T, H, V]
    state          [B, H, M, V+1]  float32; state[..., :V] = Σ_j φk_j ⊗ v_j, state[..., V] = Σ_j φk_j
    o              [B, T, H, V]    in v.dtype

Math: S_t = S_0 + Σ_{j≤t} φk_j ⊗ [v_j, 1], [num_t, den_t] = φq_t · S_t, o_t = num_t / max(den_t, tiny) with
tiny = finfo(float32).tiny. Appending a column of ones to the values makes numerator and denominator one product.

Decay (optional): log_decay [H], ≤ 0 (clamped to [-1e4, 0]), the log of a per-head factor γ that the state is
multiplied by before each token: S_t = γ S_{t-1} + φk_t ⊗ [v_t, 1], so the pair (t, s) is weighted γ^(t-s)
φq_t·φk_s, and S_0 reaches token t as γ^(t+1) S_0. Every factor is computed as exp(log_decay × a nonnegative
distance): ≤ 1, never an overflow.

Gate (optional, instead of a decay): log_gate [B, T, H], ≤ 0 (clamped to [-1e4, 0]), a factor per token: S_t =
exp(log_gate_t) S_{t-1} + φk_t ⊗ [v_t, 1], so the pair (t, s) weighs exp(Σ_{s<j≤t} log_gate_j) φq_t·φk_s. Every such
sum is taken over its own terms (`segment_sums`), never as a difference of running sums: no cancellation, and each
factor ≤ 1.

This file computes it the obvious, quadratic way: A = φq φkᵀ under a causal mask, plus φq·S_0. It is O(T²) in
time and memory (B·H·T² floats) and exists to be read and tested against; the fast ops (`chunk`, `recurrent`, `fla`)
import its small helpers (`check_inputs`, `augment_values`, `normalise`) so that every op shares one definition.

Precision: everything is computed in float32 whatever the input dtype (bf16/fp16 inputs are upcast), or in float64
when any input is float64 (for tight tests); the output is cast back to v.dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TINY = torch.finfo(torch.float32).tiny


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd is on and any of `tensors` (None skipped) requires a gradient."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def check_inputs(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                 initial_state: torch.Tensor | None = None, log_decay: torch.Tensor | None = None,
                 log_gate: torch.Tensor | None = None) -> None:
    """Raise ValueError, saying what is wrong, unless the shapes follow the frozen layout above."""
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, H, {'V' if name == 'v' else 'M'}], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if phi_q.shape != phi_k.shape:
        raise ValueError(f"phi_q and phi_k must have the same shape [B, T, H, M], "
                         f"got {tuple(phi_q.shape)} and {tuple(phi_k.shape)}")
    B, T, H, M = phi_q.shape
    if v.shape[:3] != phi_q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {B}, {T}, {H} as in phi_q, got {tuple(v.shape)}")
    if T == 0 or M == 0 or v.shape[-1] == 0:
        raise ValueError(f"T, M and V must be positive, got T={T}, M={M}, V={v.shape[-1]}")
    if initial_state is not None:
        expected = (B, H, M, v.shape[-1] + 1)
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be [B, H, M, V+1] = {expected} (last column: the normaliser "
                             f"Σ φk), got {tuple(initial_state.shape)}")
    check_log_decay(log_decay, H)
    if log_gate is not None:
        if log_decay is not None:
            raise ValueError("log_decay and log_gate do not combine: fold the decay into the gate")
        if tuple(log_gate.shape) != (B, T, H) or not log_gate.is_floating_point():
            raise ValueError(f"log_gate must be a floating-point [B, T, H] = {(B, T, H)} tensor (the log of each "
                             f"token's decay), got {tuple(log_gate.shape)} {log_gate.dtype}")


def check_log_decay(log_decay: torch.Tensor | None, H: int) -> None:
    """ValueError unless log_decay is None or a floating-point [H] tensor."""
    if log_decay is not None and (tuple(log_decay.shape) != (H,) or not log_decay.is_floating_point()):
        raise ValueError(f"log_decay must be a floating-point [H] = ({H},) tensor (the log of each head's decay), "
                         f"got {tuple(log_decay.shape)} {log_decay.dtype}")


def decay_log(log_decay: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log_decay in the compute dtype, clamped to [-1e4, 0]: γ = 0 and γ = 1 are the limits (a -inf would give
    0·inf = NaN at distance 0, a positive value an overflow)."""
    return log_decay.to(dtype).clamp(-1e4, 0.0)


def log_decay_matrix(log_decay: torch.Tensor, rows: int, cols: int | None = None, offset: int = 0,
                     at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([H, rows, cols] log_decay_h · max(t - s, 0), [rows, cols] True where t - s < 0), t = i + offset, s = j;
    `at` [rows]: the rows' own positions i (a sample of a long sequence's rows) instead of 0..rows-1."""
    cols = rows if cols is None else cols
    t = (torch.arange(rows, device=log_decay.device) if at is None else at)[:, None] + offset
    distance = t - torch.arange(cols, device=log_decay.device)                     # [rows, cols]
    return log_decay[:, None, None] * distance.clamp_min(0), distance < 0


def decay_matrix(log_decay: torch.Tensor, rows: int, cols: int | None = None, offset: int = 0) -> torch.Tensor:
    """[H, rows, cols]: exp(log_decay_h · (t - s)) where 0 ≤ t - s (t = i + offset, s = j), else 0."""
    log_factor, before = log_decay_matrix(log_decay, rows, cols, offset)
    return torch.exp(log_factor).masked_fill(before, 0.0)


def decay_factors(log_decay: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """[N, H]: exp(log_decay_h · distance_n) for nonnegative distances [N], shaped to scale [B, N, H, ·] rows."""
    return torch.exp(distance.to(log_decay.dtype)[:, None] * log_decay)


def segment_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., t, s] = Σ_{s<j≤t} x_j, 0 where s ≥ t. Each entry sums its own terms (a
    cumulative sum down the masked columns), so nothing cancels however large the running sums grow."""
    L = x.shape[-1]
    later = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1)        # [j, s]: j > s
    return x[..., :, None].expand(*x.shape, L).masked_fill(~later, 0.0).cumsum(-2)


def log_pair_factors(length: int, offset: int = 0, at: torch.Tensor | None = None,
                     log_decay: torch.Tensor | None = None,
                     log_gate: torch.Tensor | None = None) -> torch.Tensor | None:
    """The ops' decay arguments as a log factor on each pair (query t, key s) of a sequence of `length` from position
    0, float32: a decay (t - s + offset) log γ_h where positive, else 0 ([1, H, T or R, T]; beside a window, offset -W:
    counted from its edge); a gate Σ_{s<j≤t} log g_j ([B, H, T or R, T]; pure linear attention: offset 0); None for
    neither. `at` [R]: only the rows of these query positions. The quadratic form of the pairs' weights, which the
    naive layer and the l2 loss read."""
    if log_decay is not None:
        rows = length if at is None else len(at)
        return log_decay_matrix(log_decay, rows, length, offset=offset, at=at)[0][None]
    if log_gate is not None:
        if offset:
            raise ValueError("a gate weighs pairs from the key on (offset 0): it does not sit beside a window")
        factor = segment_sums(gate_log(log_gate, torch.float32))
        return factor if at is None else factor[:, :, at]
    return None


def suffix_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L]: out[..., j] = Σ_{i>j} x_i (0 for the last)."""
    return F.pad(x.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))


def gate_log(log_gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log_gate [B, T, H] -> [B, H, T] in the compute dtype, clamped to [-1e4, 0] (as `decay_log`)."""
    return decay_log(log_gate, dtype).permute(0, 2, 1)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 are never computed in)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in tensors) else torch.float32


def augment_values(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, V] -> [B, T, H, V+1]: the values with a column of ones (the denominator's "value")."""
    v = v.to(dtype)
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def normalise(o_aug: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., V+1] = [num, den] -> num / max(den, tiny) in `dtype`: [..., V], contiguous."""
    num, den = o_aug[..., :-1], o_aug[..., -1:]
    return (num / den.clamp_min(TINY)).to(dtype).contiguous()       # o_aug may be a transposed view


def naive_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           normalize: bool = True,
                           log_decay: torch.Tensor | None = None,
                           log_gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention by the quadratic masked form.

    phi_q, phi_k: [B, T, H, M]; v: [B, T, H, V]; initial_state: [B, H, M, V+1] or None (zeros).
    Returns o [B, T, H, V] in v.dtype and, if output_final_state, the state [B, H, M, V+1] (float32, or float64
    for float64 inputs), else None. normalize=False returns [num, den] [B, T, H, V+1] in the compute dtype instead
    of o (for callers that combine the linear part with other attention mass, e.g. `ops.window`).
    log_decay: [H] (≤ 0) or None: each head's state decays by exp(log_decay) per token (module docstring).
    log_gate: [B, T, H] (≤ 0) or None: the state decays by exp(log_gate_t) before token t (module docstring).
    """
    check_inputs(phi_q, phi_k, v, initial_state, log_decay, log_gate)
    dtype = compute_dtype(phi_q, phi_k, v, initial_state)
    q, k = phi_q.to(dtype), phi_k.to(dtype)                           # [B, T, H, M]
    v_aug = augment_values(v, dtype)                                   # [B, T, H, V+1]
    T = q.shape[1]

    A = torch.einsum("bthm,bshm->bhts", q, k)                         # [B, H, T, T]
    causal = torch.ones(A.shape[-2:], dtype=torch.bool, device=A.device).tril()   # s ≤ t
    A = A.masked_fill(~causal, 0.0)
    if log_decay is not None:
        log_decay = decay_log(log_decay, dtype)
        steps = torch.arange(T + 1, device=q.device)
        A = A * decay_matrix(log_decay, T)                             # γ^(t-s)
    if log_gate is not None:
        x = gate_log(log_gate, dtype)                                  # [B, H, T]
        A = A * torch.exp(segment_sums(x))                             # exp(Σ_{s<j≤t} x_j)
    o_aug = torch.einsum("bhts,bshv->bthv", A, v_aug)                 # [B, T, H, V+1]
    if initial_state is not None:
        S0 = initial_state.to(dtype)                                   # [B, H, M, V+1]
        q0 = q if log_decay is None else q * decay_factors(log_decay, steps[1:])[..., None]      # γ^(t+1)
        if log_gate is not None:
            q0 = q * torch.exp(x.cumsum(-1)).transpose(1, 2)[..., None]                          # exp(Σ_{j≤t} x_j)
        o_aug = o_aug + torch.einsum("bthm,bhmv->bthv", q0, S0)

    final_state = None
    if output_final_state:
        k_last = k if log_decay is None else k * decay_factors(log_decay, steps[:T].flip(0))[..., None]  # γ^(T-1-j)
        if log_gate is not None:
            k_last = k * torch.exp(suffix_sums(x)).transpose(1, 2)[..., None]                    # exp(Σ_{j<i<T} x_i)
        final_state = torch.einsum("bthm,bthv->bhmv", k_last, v_aug)  # [B, H, M, V+1]
        if initial_state is not None:
            S0 = initial_state.to(dtype)
            if log_decay is not None:
                S0 = torch.exp(log_decay * T)[:, None, None] * S0
            if log_gate is not None:
                S0 = torch.exp(x.sum(-1))[..., None, None] * S0
            final_state = final_state + S0
    return (normalise(o_aug, v.dtype) if normalize else o_aug), final_state


def valid_and(key_valid: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """The keys both valid (`key_valid` [B, Tk], None: all) and in `mask`."""
    return mask if key_valid is None else key_valid & mask


def delayed_keys(phi_q, phi_k, v, key_valid, window: int, dtype: torch.dtype):
    """The linear part's inputs: (φq, φk with padding keys zeroed and delayed by W, v delayed by W), the keys and
    values over the same Tk positions (key s arrives at position s + W). The features keep their dtype when φq, φk
    and v share one, since the linear ops sum in float32 whatever it is (16-bit dots on CUDA are faster); else
    all go to `dtype`."""
    feat = phi_k.dtype if phi_k.dtype == phi_q.dtype == v.dtype else dtype
    phi_k = phi_k.to(feat)
    if key_valid is not None:
        phi_k = phi_k * key_valid[:, :, None, None].to(feat)
    Tk = phi_k.shape[1]
    delayed_k = F.pad(phi_k, (0, 0, 0, 0, window, 0))[:, :Tk]
    delayed_v = F.pad(v.to(feat), (0, 0, 0, 0, window, 0))[:, :Tk]
    return phi_q.to(feat), delayed_k, delayed_v
