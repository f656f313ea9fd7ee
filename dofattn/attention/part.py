"""What a part of a linear layer is: one mechanism (a window, a sink, a decay, a convolution) as a module that owns its
parameters, made from the layer's config, and asked by the layer for what it adds, never named by it.

    class Echo(Part):                      # a new part, in its own module
        name = "echo"                      # the layer's attribute and its cache state's key
        State = EchoState                  # what it keeps in a generation cache (a `PartState`), or None
        @classmethod
        def build(cls, attention, num_heads, num_kv_heads, head_dim): ...   # None where the config leaves it out

What the layer asks of each of its parts (`LinearAttention.parts()`), each with a default that adds nothing:
    inputs(q, k, v, key_valid, cache)        q, k, v before the attention (a convolution mixes neighbours in)
    op_arguments(v)                          keyword arguments the linear op takes for it (a decay's `log_decay`)
    log_pair_factor(v, length, offset, at)   its log factor on the linear pairs of the layer's attention matrix
    check_padding(key_valid, state)          a rule of its own on padded keys (a decay: padding on the left only)
    runs(kernel)                             whether a fast form can run it (`KERNELS`)
    layerwise                                whether the layerwise stage fits it on the teacher's q/k/v (a part that
                                             only acts through its inputs trains end to end)
A `State` is registered for the cache slot under `name` (`cache.PART_STATES`) when the class is made: the slot
makes, reorders, batches, moves, counts and freezes it for static decoding whatever the part.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dofattn.attention.cache import PART_STATES, PartState

# The fast forms that name what they compute, which a part may not run in (`runs`; the general call, on the ops with
# every part's `op_arguments`, runs every part): a pure linear layer's Triton decode step, a window hybrid's Triton
# ring step, its steady decode step (`lean_step`: `fold_key` and `window_decode_step`) and that step's PRF form.
KERNELS = ("prf_decode_step", "prf_ring_step", "lean_step", "prf_window_step")


class Part(nn.Module):
    """One mechanism of a `LinearAttention` (see the module's docstring for what the layer asks of it)."""

    name: ClassVar[str] = ""
    State: ClassVar[type[PartState] | None] = None
    layerwise: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.State is not None:
            PART_STATES[cls.name] = cls.State

    @classmethod
    def build(cls, attention, num_heads: int, num_kv_heads: int, head_dim: int) -> Part | None:
        """This part for a layer of this config (`spec.Attention`) and shape, or None where the config leaves it out."""
        raise NotImplementedError

    def inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
               cache=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k and v [B, T, Hkv or H, D] as the attention reads them (k and v on query heads in the
        layer's naive form): the same by default."""
        return q, k, v

    def op_arguments(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword arguments of the linear op for this part (`ops.linear_attention`), from the values v [B, T, H, D]:
        none by default."""
        return {}

    def log_pair_factor(self, v: torch.Tensor, length: int, offset: int = 0,
                        at: torch.Tensor | None = None) -> torch.Tensor | None:
        """Its log factor on the pair (query t, key s) of a sequence of `length` ([B or 1, H, T or R, T], 0 where it
        does not act), the linear pairs counted from `offset` (beside a window, -W: from its edge), only the rows
        `at` if given; None: it puts no factor on pairs."""
        return None

    def check_padding(self, key_valid: torch.Tensor, state: torch.Tensor | None = None) -> None:
        """UserError where these keys' padding flags [B, Tk] (after a chunk's `state`, if one) cannot be exact for
        this part: any padding by default."""

    def runs(self, kernel: str) -> bool:
        """Whether the one-kernel form `kernel` (one of `KERNELS`) computes this part: yes by default."""
        return True
