"""A short causal convolution over tokens, one filter per channel (depthwise), continued across calls.

    y, tail = short_conv(x, weight)                 # prefill: the tokens before the first count as zeros
    y1, tail = short_conv(x1, weight, tail)         # decode: the last K-1 inputs of the earlier calls come first

Layout: x [B, T, C, D] (C heads of D channels), weight [K, C, D], tail [B, K-1, C, D].
y_t = Σ_{j<K} weight[j] ⊙ x_{t-j}, so weight[0] weighs the token itself and weight[0] = 1, weight[1:] = 0 is the
identity. Sums are float32 (float64 for float64 x); y comes back in x's dtype. The tail is the inputs themselves (in x's
dtype), so a sequence fed in pieces gives the same y as in one call.
"""

from __future__ import annotations

import torch


def short_conv(x: torch.Tensor, weight: torch.Tensor,
               tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C, D], weight [K, C, D], tail [B, K-1, C, D] or None (zeros) -> (y [B, T, C, D], tail)."""
    K, T = weight.shape[0], x.shape[1]
    if weight.shape[1:] != x.shape[2:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}: expected [K, C, D]")
    if tail is None:
        tail = x.new_zeros(x.shape[0], K - 1, *x.shape[2:])
    full = torch.cat([tail.to(x.dtype), x], 1)                                      # [B, K-1+T, C, D]
    acc = torch.promote_types(x.dtype, torch.float32)                               # float32, or float64
    w = weight.to(acc)
    y = sum(w[j] * full[:, K - 1 - j:K - 1 - j + T].to(acc) for j in range(K))      # [B, T, C, D]
    return y.to(x.dtype), full[:, full.shape[1] - (K - 1):]
