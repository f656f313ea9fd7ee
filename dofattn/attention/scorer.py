"""A key's score for a streaming bounded cache: how much the teacher's later queries will want it, read off the key,
its value and the few tokens before it, once, as it arrives (`KeyScorer`).

    scorer = KeyScorer(num_kv_heads=3, head_dim=64)
    score = scorer(k, v, key_valid)        # k, v [B, T, Hkv, D] (k after RoPE) -> [B, Hkv, T] float32
    scorer(k, v, key_valid, before=(k0, v0, valid0))   # a later call: the cache's last keys as the context

The features of a key do not depend on its position: its value, and the norm of each pair of its coordinates that
RoPE rotates together (the HF rotate-half layout: coordinates c and c + D/2). Per kv head, a linear map to `hidden`
channels, a causal depthwise convolution over the key and its `reach - 1` predecessors (padding and the start of a
sequence read as zeros), GELU, and a linear read-out: the key's content. Its score adds a learned rate per kv head
times its position, so that a later query's ranking of the keys, content − rate · distance, is the same for every
query (the teacher's attention to a key fades with distance). A score depends only on tokens that came before it, so
a text read in one call, in chunks or token by token gets the same scores. It is trained with the backbone frozen
(`distill.scorer`) to predict the log of the attention that the teacher's later queries pay a key.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dofattn.attention.exact import pair_norms

REACH = 8          # a score reads its key and the 7 before it
SPAN = 1000.0      # the recency rate is per this many tokens


def key_features(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [B, T, Hkv, D] -> [B, T, Hkv, D + D/2] float32: the value and the RoPE pairs' norms of the key."""
    return torch.cat([v.float(), pair_norms(k)], -1)


class KeyScorer(nn.Module):
    """Per kv head: features -> `hidden` channels -> causal depthwise conv over `reach` tokens -> GELU -> a score."""

    def __init__(self, num_kv_heads: int, head_dim: int, hidden: int = 32, reach: int = REACH):
        super().__init__()
        width = head_dim + head_dim // 2
        self.reach = int(reach)
        self.norm = nn.Parameter(torch.ones(num_kv_heads, width))                       # feature scales
        self.proj = nn.Parameter(torch.randn(num_kv_heads, width, hidden) / math.sqrt(width))
        self.conv = nn.Parameter(torch.randn(num_kv_heads, hidden, reach) / math.sqrt(reach))
        self.bias = nn.Parameter(torch.zeros(num_kv_heads, hidden))
        self.out = nn.Parameter(torch.randn(num_kv_heads, hidden) / math.sqrt(hidden))
        self.log_rate = nn.Parameter(torch.zeros(num_kv_heads))                          # rate 1 per SPAN tokens

    def rate(self) -> torch.Tensor:
        """[Hkv] float32: how much a key's content score its later queries discount per SPAN tokens of distance."""
        return self.log_rate.float().exp()

    def extra_repr(self) -> str:
        return f"reach={self.reach}"

    def forward(self, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
                before: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, start: int = 0) -> torch.Tensor:
        """k, v [B, T, Hkv, D], key_valid [B, T] (None: all real) -> scores [B, Hkv, T] float32: content + rate ·
        position / SPAN, the keys at positions start, start + 1, ... `before`: the keys, values and validity
        ([B, n, Hkv, D], [B, n]) just before these (a cache's last ones); without it the call starts the sequence."""
        at = torch.arange(start, start + k.shape[1], device=k.device, dtype=torch.float32)
        return self.content(k, v, key_valid, before) + self.rate()[:, None] * at / SPAN

    def content(self, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
                before: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The position-free part of `forward`'s scores: [B, Hkv, T] float32."""
        B, T, Hkv, _ = k.shape
        x = key_features(k, v)                                                          # [B, T, Hkv, F]
        if key_valid is not None:
            x = x * key_valid[:, :, None, None]
        lead = 0
        if before is not None and before[0].shape[1]:
            k0, v0, valid0 = before
            x0 = key_features(k0, v0) * valid0[:, :, None, None]
            x0 = x0[:, -(self.reach - 1):]
            lead = x0.shape[1]
            x = torch.cat([x0, x], 1)
        x = (x / x.shape[-1] ** 0.5) * self.norm                                          # [B, L, Hkv, F]
        h = torch.einsum("blkf,kfc->bkcl", x, self.proj.float())                        # [B, Hkv, c, L]
        h = F.pad(h, (self.reach - 1, 0)).reshape(B, Hkv * h.shape[2], -1)              # zeros before the start
        h = F.conv1d(h, self.conv.float().reshape(-1, 1, self.reach), groups=h.shape[1])
        h = F.gelu(h.reshape(B, Hkv, -1, h.shape[-1]) + self.bias.float()[..., None])    # [B, Hkv, c, L]
        return torch.einsum("bkcl,kc->bkl", h, self.out.float())[..., lead:]
