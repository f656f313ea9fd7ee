"""Choosing the keys a bounded exact cache holds: the keys that a prompt's last queries attend to (SnapKV-style).

    index, valid = select_keys(q, k, scaling, candidates, count=256, observe=8, pool=15)

q [B, Tq, H, D] and k [B, T, Hkv, D] are one prompt's last Tq ≤ T queries (at least its last `observe`: a prompt
read in chunks keeps no more) and all its keys (after RoPE; a grouped-query model's kv heads as they are);
candidates [B, T] bool marks the keys that may be chosen (real keys outside the sink and the final window). Each
of the last `observe` real queries attends to all its causal keys with the teacher's softmax kernel (scaling·q·k);
a key's score is its attention summed over those queries and over its kv head's query heads, then max-pooled over
`pool` neighbouring keys (so a fact's neighbours come with it: a number is several tokens). Per row
and kv head the `count` best candidates are chosen: index [B, Hkv, count] (positions in the prompt), valid [B, count]
(False for the slots beyond a row's candidates, whose index points at an arbitrary key).

When the question is the prompt's end (ask after a long context), its queries point at the keys the answer needs,
so a small cache of them answers where the linear branch's soft average does not.

    select_keys         the fast form: one batched product per kv head group
    naive_select_keys   the spec: a loop over rows, kv heads and queries
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["select_keys", "naive_select_keys", "check_select_inputs", "prompt_candidates"]


def prompt_candidates(key_valid: torch.Tensor, exact: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T] bool: the keys of a prompt (key_valid [B, T]) that may be chosen: real, not already exact (`exact`
    [B, T]: a sink's), and not among the last `window` positions, which stay exact in the window anyway."""
    candidates = key_valid & ~exact
    candidates[:, max(key_valid.shape[1] - window, 0):] = False
    return candidates


def check_select_inputs(q, k, candidates, count: int, observe: int, pool: int) -> None:
    """ValueError saying what is wrong unless the shapes and sizes are as the module docstring says."""
    if (q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[1] > k.shape[1]
            or q.shape[-1] != k.shape[-1]):
        raise ValueError(f"q must be [B, Tq, H, D] and k [B, T, Hkv, D] with Tq <= T, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads cannot share {k.shape[2]} kv heads evenly")
    if candidates.shape != k.shape[:2] or candidates.dtype != torch.bool:
        raise ValueError(f"candidates must be bool [B, T] = {tuple(k.shape[:2])}, got {candidates.dtype} "
                         f"{tuple(candidates.shape)}")
    if count < 1 or observe < 1 or pool < 1 or pool % 2 == 0:
        raise ValueError(f"count and observe must be >= 1 and pool odd, got {count}, {observe}, {pool}")
    if q.shape[1] < min(observe, k.shape[1]):
        raise ValueError(f"the last {observe} queries observe, but q holds {q.shape[1]}")


def _observers(key_valid: torch.Tensor, observe: int) -> torch.Tensor:
    """[B, T] bool: each row's last `observe` real positions."""
    from_end = key_valid.flip(1).cumsum(1).flip(1)                          # real keys at or after each position
    return key_valid & (from_end <= observe)


def select_keys(q, k, scaling: float, candidates, count: int, observe: int = 8, pool: int = 15,
                key_valid=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast form (see the module docstring). key_valid [B, T] (None: all real) marks padding, which no query
    attends to and no observer is."""
    check_select_inputs(q, k, candidates, count, observe, pool)
    B, T, Hkv, D = k.shape
    G = q.shape[2] // Hkv
    key_valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_valid is None else key_valid
    first = max(T - observe, 0)           # with left padding, a row's last real queries are the last positions
    watch = _observers(key_valid, observe)[:, first:]                           # [B, O]
    qo = q[:, q.shape[1] - (T - first):].float().reshape(B, T - first, Hkv, G, D)
    logits = scaling * torch.einsum("bokgd,bskd->bkgos", qo, k.float())         # [B, Hkv, G, O, T]
    future = torch.ones(T - first, T, dtype=torch.bool, device=q.device).triu(first + 1)
    logits = logits.masked_fill(future | ~key_valid[:, None, None, None, :], -torch.inf)
    attn = torch.softmax(logits, -1).nan_to_num(0.0) * watch[:, None, None, :, None]
    scores = attn.sum((2, 3))                                                   # [B, Hkv, T]
    scores = F.max_pool1d(scores, pool, stride=1, padding=pool // 2)
    return _top(scores, candidates, count)


def _top(scores: torch.Tensor, candidates: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` best candidates per row and kv head (ties: the earlier key), and which slots are real."""
    B, Hkv, T = scores.shape
    scores = scores.masked_fill(~candidates[:, None, :], -torch.inf)
    # stable order: among equal scores the earlier key wins (topk's tie order is unspecified)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    if order.shape[-1] < count:
        order = torch.cat([order, order.new_zeros(B, Hkv, count - T)], -1)
    index = order[..., :count]
    valid = torch.arange(count, device=scores.device) < candidates.sum(1, keepdim=True)      # [B, count]
    return index, valid


@torch.no_grad()
def naive_select_keys(q, k, scaling: float, candidates, count: int, observe: int = 8, pool: int = 15,
                      key_valid=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, one row, kv head and observer at a time, in float64."""
    check_select_inputs(q, k, candidates, count, observe, pool)
    B, T, Hkv, D = k.shape
    H, G, lead = q.shape[2], q.shape[2] // Hkv, T - q.shape[1]          # q[:, t - lead] is position t's query
    key_valid = torch.ones(B, T, dtype=torch.bool) if key_valid is None else key_valid.cpu()
    q, k, candidates = q.double().cpu(), k.double().cpu(), candidates.cpu()
    scores = torch.zeros(B, Hkv, T, dtype=torch.float64)
    for b in range(B):
        real = [t for t in range(T) if key_valid[b, t]]
        for t in real[-observe:]:
            keys = [s for s in real if s <= t]
            for h in range(H):
                logits = torch.stack([scaling * q[b, t - lead, h] @ k[b, s, h // G] for s in keys])
                for s, p in zip(keys, torch.softmax(logits, 0)):
                    scores[b, h // G, s] += p
    pooled = torch.full_like(scores, -torch.inf)
    for s in range(T):
        lo, hi = max(s - pool // 2, 0), min(s + pool // 2 + 1, T)
        pooled[..., s] = scores[..., lo:hi].amax(-1)
    index = torch.zeros(B, Hkv, count, dtype=torch.long)
    for b in range(B):
        for j in range(Hkv):
            ranked = sorted((s for s in range(T) if candidates[b, s]), key=lambda s: (-pooled[b, j, s].item(), s))
            index[b, j, :len(ranked[:count])] = torch.tensor(ranked[:count], dtype=torch.long)
    valid = torch.arange(count) < candidates.sum(1, keepdim=True)
    return index, valid
