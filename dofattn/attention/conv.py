"""The short convolution part: before anything else, q, k and v (after RoPE) each pass through a causal
convolution over the last K tokens, one learned filter per channel (`ops.conv`), started as the identity.

It lets a layer mix a token's neighbours into its query, key and value (with a decay, a head can then reach the
token before, say, which plain linear attention cannot single out). Its cache state is the last K-1 inputs of q, k
and v (a `ConvState` in the slot's parts).
"""

from __future__ import annotations

import torch
from torch import nn

from dofattn.attention.cache import LinearStateLayer, PartState, keep_buffer
from dofattn.attention.part import KERNELS, Part
from dofattn.ops.conv import short_conv
from dofattn.ops.softmax import expand_kv

CONV_NAMES = ("conv_q", "conv_k", "conv_v")    # the filters of q, k and v: parameters and cache tensors


class ConvState(PartState):
    """A short convolution's last K-1 inputs of q, k and v ([B, K-1, heads, D]; zeros before the first token)."""

    NAMES = ("q", "k", "v")


class ShortConv(Part):
    """Filters [K, heads, D] for q, k and v, weight[j] on the token j back: the identity to start. It acts on the
    layer's inputs only: the layerwise stage, which fits a layer on the teacher's q, k and v, leaves it at the
    identity, and it trains end to end."""

    name, State, layerwise = "conv", ConvState, False
    kernels = KERNELS          # it acts on the inputs, before any form runs
    rate = "conv_lr"           # end_to_end.conv_lr: its filters' learning rate

    @classmethod
    def build(cls, attention, num_heads: int, num_kv_heads: int, head_dim: int) -> ShortConv | None:
        return cls(attention.conv, num_heads, num_kv_heads, head_dim) if attention.conv else None

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.width = int(width)
        for name, heads in zip(CONV_NAMES, (num_heads, num_kv_heads, num_kv_heads)):
            weight = torch.zeros(self.width, heads, head_dim)
            weight[0] = 1
            self.register_parameter(name, nn.Parameter(weight))

    def inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
               cache: LinearStateLayer | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v through their filters, shapes kept (k and v on kv heads, or on query heads: each kv head's
        filter serves its group). A padding token's inputs count as zeros, so left padding looks like the start of a
        sequence. With a `cache`, its last K-1 inputs of each come first, and this call's last K-1 take their
        place."""
        if key_valid is not None:
            keep = key_valid[:, :, None, None]
            q, k, v = (x * keep.to(x.dtype) for x in (q, k, v))
        state = None if cache is None else cache.part("conv")
        out = []
        for name, x in zip(CONV_NAMES, (q, k, v)):
            if x is None:                                                # the naive form without values
                out.append(x)
                continue
            stream = name[-1]                                            # the state's q, k or v
            weight = expand_kv(getattr(self, name), x.shape[2], dim=1)  # [K, heads, D]
            y, tail = short_conv(x, weight, None if state is None else getattr(state, stream))
            if state is not None:
                keep_buffer(state, stream, tail)
            out.append(y)
        return tuple(out)

    def extra_repr(self) -> str:
        return f"width={self.width}"
