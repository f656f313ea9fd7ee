"""The short convolution part: before anything else, q, k and v (after RoPE) each pass through a causal
convolution over the last K tokens, one learned filter per channel (`ops.conv`), started as the identity.

It lets a layer mix a token's neighbours into its query, key and value (with a decay, a head can then reach the
token before, say, which plain linear attention cannot single out). Its cache state is the last K-1 inputs of q, k
and v (a `ConvState` in the slot's parts).
"""

from __future__ import annotations

import torch
from torch import nn

from dofattn.attention.cache import LinearStateLayer, keep_buffer
from dofattn.ops.conv import short_conv

CONV_NAMES = ("conv_q", "conv_k", "conv_v")    # the filters of q, k and v: parameters and cache tensors


class ShortConv(nn.Module):
    """Filters [K, heads, D] for q, k and v, weight[j] on the token j back: the identity to start."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.width = int(width)
        for name, heads in zip(CONV_NAMES, (num_heads, num_kv_heads, num_kv_heads)):
            weight = torch.zeros(self.width, heads, head_dim)
            weight[0] = 1
            self.register_parameter(name, nn.Parameter(weight))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                cache: LinearStateLayer | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v through their filters, shapes kept. A padding token's inputs count as zeros, so left padding
        looks like the start of a sequence. With a `cache`, its last K-1 inputs of each come first, and this call's
        last K-1 take their place."""
        if key_valid is not None:
            keep = key_valid[:, :, None, None]
            q, k, v = (x * keep.to(x.dtype) for x in (q, k, v))
        state = None if cache is None else cache.part("conv")
        out = []
        for name, x in zip(CONV_NAMES, (q, k, v)):
            stream = name[-1]                                            # the state's q, k or v
            y, tail = short_conv(x, getattr(self, name), None if state is None else getattr(state, stream))
            if state is not None:
                keep_buffer(state, stream, tail)
            out.append(y)
        return tuple(out)

    def extra_repr(self) -> str:
        return f"width={self.width}"
