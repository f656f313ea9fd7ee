"""The teacher's exact softmax attention on the package's layout: the reference a linear layer is scored against.

    k = expand_kv(k, num_heads)                       # [B, T, Hkv, D] -> [B, T, H, D]
    logits = attention_logits(q, k, scaling)          # [B, H, T, T]: scaling·q·k, −inf on future keys
    o = softmax_attention(q, k, v, scaling)           # [B, T, H, V]: softmax(logits) @ v

q [B, T, H, D] and k, v on the query heads (`expand_kv` repeats each kv head of a grouped-query model for its group
of query heads), as in `ops.naive`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expand_kv(x: torch.Tensor, num_heads: int, dim: int = 2) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, T, H, D] (heads on axis `dim`): each kv head repeated for its group of H/Hkv query heads,
    the kv head j serving query heads j·H/Hkv to (j+1)·H/Hkv − 1. x itself when Hkv = H."""
    kv_heads = x.shape[dim]
    if kv_heads == num_heads:
        return x
    if kv_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {kv_heads} kv heads evenly")
    return x.repeat_interleave(num_heads // kv_heads, dim=dim)


def attention_logits(q: torch.Tensor, k: torch.Tensor, scaling: float,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [B, T, H, D], k [B, Tk, H, D] with Tk ≥ T (the queries are the last T positions) -> [B, H, T, Tk] in
    `dtype`: the causal softmax's logits scaling·q_t·k_s, −inf where the key s comes after the query t."""
    T, Tk = q.shape[1], k.shape[1]
    if Tk < T:
        raise ValueError(f"attention_logits needs at least as many keys as queries, got {Tk} keys for {T} queries")
    logits = scaling * torch.einsum("bthd,bshd->bhts", q.to(dtype), k.to(dtype))
    future = torch.ones(T, Tk, dtype=torch.bool, device=q.device).triu(Tk - T + 1)
    return logits.masked_fill(future, -torch.inf)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact causal softmax attention in float32: q, k [B, T, H, D], v [B, T, H, V] -> o [B, T, H, V] (PyTorch's
    SDPA, softmax(`attention_logits`) @ v)."""
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"softmax_attention needs as many keys and values as queries, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    heads = (x.transpose(1, 2).float() for x in (q, k, v))
    return F.scaled_dot_product_attention(*heads, is_causal=True, scale=scaling).transpose(1, 2)
