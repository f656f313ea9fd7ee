"""Token-by-token causal linear attention: the decode path (T = 1 is the common case; any T is looped over).

    o, state = recurrent_linear_attention(phi_q, phi_k, v, initial_state=state, output_final_state=True)

Same layout, math and precision as `naive.py` (the spec): phi_q, phi_k [B, T, H, M], v [B, T, H, V],
state [B, H, M, V+1] (float32), o [B, T, H, V] in v.dtype. Each step is the recurrence itself:
S_t = γ_t S_{t-1} + φk_t ⊗ [v_t, 1] (γ_t = exp(log_decay) or exp(log_gate_t), 1 without either), [num_t, den_t] = φq_t · S_t. O(T·M·V) work in T small kernels, so for
prefill use `chunk_linear_attention`.
"""

from __future__ import annotations

import torch

from dofattn.ops.naive import augment_values, check_inputs, compute_dtype, decay_log, gate_log, normalise


def recurrent_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                               initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False,
                               normalize: bool = True,
                               log_decay: torch.Tensor | None = None,
                               log_gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention, one token at a time: equal to `naive_linear_attention` up to float rounding.

    phi_q, phi_k: [B, T, H, M]; v: [B, T, H, V]; initial_state: [B, H, M, V+1] or None (zeros).
    Returns o [B, T, H, V] in v.dtype and the final state [B, H, M, V+1] if output_final_state, else None.
    log_decay: [H] (≤ 0) or None, log_gate: [B, T, H] (≤ 0) or None, as in `naive_linear_attention`.
    """
    check_inputs(phi_q, phi_k, v, initial_state, log_decay, log_gate)
    dtype = compute_dtype(phi_q, phi_k, v, initial_state)
    B, T, H, M = phi_q.shape
    q, k = phi_q.to(dtype), phi_k.to(dtype)                           # [B, T, H, M]
    v_aug = augment_values(v, dtype)                                   # [B, T, H, V+1]
    if initial_state is None:
        S = q.new_zeros(B, H, M, v_aug.shape[-1])                      # [B, H, M, V+1]
    else:
        S = initial_state.to(dtype)

    gamma = None if log_decay is None else torch.exp(decay_log(log_decay, dtype))[:, None, None]   # [H, 1, 1]
    gates = None if log_gate is None else torch.exp(gate_log(log_gate, dtype))[..., None, None]   # [B, H, T, 1, 1]
    outputs = []
    for t in range(T):
        if gamma is not None:
            S = gamma * S
        if gates is not None:
            S = gates[:, :, t] * S
        S = S + k[:, t, :, :, None] * v_aug[:, t, :, None, :]          # [B, H, M, V+1]
        outputs.append(torch.einsum("bhm,bhmv->bhv", q[:, t], S))     # [B, H, V+1]
    o_aug = torch.stack(outputs, dim=1)                                # [B, T, H, V+1]
    return (normalise(o_aug, v.dtype) if normalize else o_aug), (S if output_final_state else None)
