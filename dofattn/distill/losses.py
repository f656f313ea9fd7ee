"""The layerwise losses: how far one layer's linear attention is from the teacher's softmax attention, on the
teacher's own queries and keys.

- softmax: the mean KL(teacher row ‖ student row) over causal attention rows. Beside a window the student's row is
  the hybrid's: exact weights on the last W keys (and the sink), linear beyond.
- l2: the squared error of kernel values on causal pairs, each query's row scaled by its largest exact kernel value
  (raw values reach e^15 and would swamp the mean); beside a window only the pairs the features produce.
With a decay (per head or per token) the student's weight of a pair carries the decay too.
"""

from __future__ import annotations

import math

import torch

from dofattn.attention import LinearAttention
from dofattn.errors import UserError
from dofattn.features import PositiveRandomFeatures
from dofattn.ops.naive import gate_log, log_decay_matrix, segment_sums
from dofattn.ops.softmax import attention_logits
from dofattn.ops.window import first_keys, window_logits

TINY = torch.finfo(torch.float32).tiny


def _causal(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def log_pair_decay(linear: LinearAttention, v: torch.Tensor) -> torch.Tensor:
    """The log of the decay a layer's linear part puts on the pair (t, s), 0 for s ≥ t, for values v [B, T, H, D]:
    with a gate Σ_{s<j≤t} log g_j ([B, H, T, T]); else (t - s) log γ_h, beside a window (t - W - s) log γ_h counted
    from its edge, and 0 inside it ([H, T, T])."""
    if linear.decay.per_token:
        return segment_sums(gate_log(linear.decay.log_gates(v), torch.float32))
    return log_decay_matrix(linear.log_decay(), v.shape[1], offset=-linear.attention.window)[0]


def softmax_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """Mean KL(teacher row ‖ student row) over causal attention rows. q, k, v [B, T, H, D] (v unused).

    For a window hybrid the student's row is the hybrid's: exact weights on the last W keys, linear beyond.
    """
    if linear.window is not None:
        return _window_softmax_loss(linear, q, k, scaling)
    fmap = linear.feature_map
    phi_q, phi_k = fmap(q, "query"), fmap(k, "key")                               # [B, T, H, M]
    mask = _causal(q.shape[1], q.device)
    scores = torch.einsum("bthm,bshm->bhts", phi_q, phi_k).masked_fill(~mask, 0)  # [B, H, T, T]
    log_scores = torch.log(scores.clamp_min(TINY))
    if linear.decay is not None:  # a pair's weight is its score times its decay, in log space for far pairs
        log_factor = log_pair_decay(linear, v)
        log_scores = log_scores + log_factor
        scores = scores * log_factor.exp()                                        # scores are 0 above it already
    log_student = log_scores - torch.log(scores.sum(-1, keepdim=True).clamp_min(TINY))
    log_teacher = torch.log_softmax(attention_logits(q, k, scaling), -1)
    teacher = log_teacher.exp()
    kl = (teacher * (log_teacher - log_student)).masked_fill(~mask, 0).sum(-1)    # [B, H, T]
    return kl.mean()


def _window_softmax_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    phi_q, q_scale = linear.feature_map.features(q, "query")
    phi_k, k_scale = linear.feature_map.features(k, "key")
    a = linear.attention
    sink = first_keys(None, k.shape[0], k.shape[1], a.sink, k.device) if a.sink else None
    logits, _ = window_logits(q, k, phi_q, phi_k, q_scale, k_scale + linear.window.log_gain, scaling, a.window,
                              log_decay=linear.log_decay(), sink_mask=sink)
    mask = _causal(q.shape[1], q.device)
    log_student = torch.log_softmax(logits, -1).clamp_min(math.log(TINY))       # [B, H, T, T]
    log_teacher = torch.log_softmax(attention_logits(q, k, scaling), -1)
    kl = (log_teacher.exp() * (log_teacher - log_student)).masked_fill(~mask, 0).sum(-1)
    return kl.mean()


def l2_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scaling: float) -> torch.Tensor:
    """Mean squared kernel error on causal pairs, each row scaled by its largest exact kernel value (PRF only)."""
    fmap = linear.feature_map
    if not isinstance(fmap, PositiveRandomFeatures):
        raise UserError("layerwise.loss = 'l2' compares kernel values and needs prf or performer features")
    e_q, e_k = fmap.exponent(q), fmap.exponent(k)                                 # [B, T, H, M]
    c_q = e_q.amax(-1, keepdim=True).detach()
    c_k = e_k.amax(dim=(0, 1, 3), keepdim=True).detach()
    dot = torch.einsum("bthm,bshm->bhts", torch.exp(e_q - c_q), torch.exp(e_k - c_k))
    log_kernel_hat = (torch.log(dot.clamp_min(TINY)) + c_q.squeeze(-1).permute(0, 2, 1)[..., None]
                      + c_k.reshape(1, -1, 1, 1) - fmap.log_dims.reshape(1, -1, 1, 1))   # [B, H, T, T]
    if linear.decay is not None:  # the student's weight of a pair is its kernel estimate times its decay
        log_kernel_hat = log_kernel_hat + log_pair_decay(linear, v)
    mask = linear.attention.linear_pairs(q.shape[1], q.device)   # the pairs the features see
    if not mask.any():
        raise UserError(f"layerwise.loss = 'l2' beside a {linear.attention.window}-token window needs "
                        f"layerwise.seq_len > {linear.attention.window}")
    log_kernel = attention_logits(q, k, scaling).masked_fill(~mask, -math.inf)
    row_max = log_kernel.amax(-1, keepdim=True).clamp_min(-1e30)                    # rows with no pair: finite
    log_kernel_hat = log_kernel_hat.masked_fill(~mask, -math.inf)
    diff = torch.exp(log_kernel - row_max) - torch.exp(log_kernel_hat - row_max)   # 0 off the mask
    return diff.square().sum() / (mask.sum() * q.shape[0] * q.shape[2])


LOSSES = {"softmax": softmax_loss, "l2": l2_loss}
