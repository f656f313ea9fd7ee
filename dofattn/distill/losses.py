"""The layerwise losses: how far one layer's linear attention is from the teacher's softmax attention, on the
teacher's own queries and keys.

- softmax: the mean KL(teacher row ‖ student row) over causal attention rows. Beside a window the student's row is
  the hybrid's: exact weights on the last W keys (and the sink), linear beyond. On long blocks it reads a sample
  of rows (`layerwise.rows`, `sample_rows`), in blocks, never the T × T matrix.
- l2: the squared error of kernel values on causal pairs, each query's row scaled by its largest exact kernel value
  (raw values reach e^15 and would swamp the mean); beside a window only the pairs the features produce.
With a decay (per head or per token) the student's weight of a pair carries the decay too.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from dofattn.attention import LinearAttention
from dofattn.ops.softmax import attention_logits
from dofattn import recipe
from dofattn.recipe import check_l2

TINY = torch.finfo(torch.float32).tiny


def softmax_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scaling: float, at: torch.Tensor | None = None) -> torch.Tensor:
    """Mean KL(teacher row ‖ student row) over causal attention rows, the student's rows its naive form
    (`LinearAttention.naive`: beside a window, exact weights on the last W keys and the sink, linear beyond). q, k, v
    [B, T, H, D] (v: a gate's decay reads it).

    `at` [R]: only the rows of these query positions (`sample_rows`), read in blocks of `ROW_BLOCK` whose weights
    are made again in the backward pass, so that memory holds B·H·ROW_BLOCK·T numbers and never T × T; each row's
    normaliser is exact (the whole row is read). With every position in `at`, the loss of every row."""
    if at is not None:
        kl = [checkpoint(_rows_kl, linear, q, k, v, scaling, rows, use_reentrant=False)
              if torch.is_grad_enabled() else _rows_kl(linear, q, k, v, scaling, rows)
              for rows in at.split(ROW_BLOCK)]
        return torch.stack(kl).sum() / (q.shape[0] * q.shape[2] * len(at))
    log_student = linear.naive(q, k, v)                                             # [B, H, T, T]
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    log_teacher = torch.log_softmax(attention_logits(q, k, scaling), -1)
    kl = (log_teacher.exp() * (log_teacher - log_student)).masked_fill(~mask, 0).sum(-1)   # [B, H, T]
    return kl.mean()


ROW_BLOCK = 128  # query rows a sampled softmax loss reads at once


def _rows_kl(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
             at: torch.Tensor) -> torch.Tensor:
    """The sum of KL(teacher row ‖ student row) over the rows of the query positions `at` [R], every batch row and
    head."""
    log_student = linear.naive(q, k, v, at=at)                                      # [B, H, R, T]
    mask = torch.arange(k.shape[1], device=q.device)[None, :] <= at[:, None]        # [R, T]
    logits = scaling * torch.einsum("bthd,bshd->bhts", q[:, at].float(), k.float())
    log_teacher = torch.log_softmax(logits.masked_fill(~mask, -torch.inf), -1)
    return (log_teacher.exp() * (log_teacher - log_student)).masked_fill(~mask, 0).sum()


def sample_rows(length: int, count: int, generator: torch.Generator, device=None, exact: int = 0) -> torch.Tensor:
    """`count` distinct query positions of a block of `length` tokens, sorted; every position if count ≥ length.
    Weight ∝ 1 / (position + 1) from position `exact` on (the leading rows whose keys the student reads exactly,
    e.g. inside its window, have nothing to learn and are never drawn), so every doubling of the context (64–127,
    …, 4–8 K) gets about the same share of rows. (Drawn ∝ position, far rows more often, the first 512 tokens got few:
    in no recipe, it left; docs/log/experiments.md, 2026-11-28.)"""
    if count >= length:
        return torch.arange(length, device=device)
    position = torch.arange(length, dtype=torch.float)
    exact = min(exact, length - count)                             # enough rows to draw from
    weights = (position + 1).reciprocal().masked_fill(position < exact, 0)
    return torch.multinomial(weights, count, generator=generator).sort().values.to(device)


def l2_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scaling: float, at: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared kernel error on causal pairs, each row scaled by its largest exact kernel value (PRF only).
    `at` [R]: only the rows of these query positions (B·H·R·T numbers, not T × T: `eval`'s per-layer errors at
    length)."""
    T = q.shape[1]
    check_l2(linear.attention, T)
    fmap = linear.feature_map
    q_rows = q if at is None else q[:, at]
    e_q, e_k = fmap.exponent(q_rows), fmap.exponent(k)                            # [B, R, H, M], [B, T, H, M]
    c_q = e_q.amax(-1, keepdim=True).detach()
    c_k = e_k.amax(dim=(0, 1, 3), keepdim=True).detach()
    dot = torch.einsum("bthm,bshm->bhts", torch.exp(e_q - c_q), torch.exp(e_k - c_k))
    log_kernel_hat = (torch.log(dot.clamp_min(TINY)) + c_q.squeeze(-1).permute(0, 2, 1)[..., None]
                      + c_k.reshape(1, -1, 1, 1) - math.log(fmap.dim))   # [B, H, R, T]
    log_factor = linear.log_pair_factor(v, T, at)
    if log_factor is not None:  # the student's weight of a pair is its kernel estimate times its parts' factors
        log_kernel_hat = log_kernel_hat + log_factor
    mask = linear.attention.linear_pairs(T, q.device)            # the pairs the features see (causal ones only)
    if at is None:
        log_kernel = attention_logits(q, k, scaling).masked_fill(~mask, -math.inf)
    else:
        mask = mask[at]
        logits = scaling * torch.einsum("bthd,bshd->bhts", q_rows.float(), k.float())
        log_kernel = logits.masked_fill(~mask, -math.inf)
    row_max = log_kernel.amax(-1, keepdim=True).clamp_min(-1e30)                    # rows with no pair: finite
    log_kernel_hat = log_kernel_hat.masked_fill(~mask, -math.inf)
    diff = torch.exp(log_kernel - row_max) - torch.exp(log_kernel_hat - row_max)   # 0 off the mask
    return diff.square().sum() / (mask.sum() * q.shape[0] * q.shape[2])


# The recipe's losses (`layerwise.loss`: their names are `recipe.LOSSES`, in this order).
LOSSES = dict(zip(recipe.LOSSES, (softmax_loss, l2_loss), strict=True))
