"""What a part of a linear layer is: one mechanism (a window, a sink, a decay, a convolution) as a module that owns its
parameters, made from the layer's config, and asked by the layer for what it adds, never named by it.

    class Echo(Part):                      # a new part, in its own module
        name = "echo"                      # the layer's attribute and its cache state's key
        State = EchoState                  # what it keeps in a generation cache (a `PartState`), or None
        @classmethod
        def build(cls, attention, num_heads, num_kv_heads, head_dim): ...   # None where the config leaves it out

What the layer asks of each of its parts (`LinearAttention.parts()`), each with a default that adds nothing:
    inputs(q, k, v, key_valid, cache)        q, k, v before the attention (a convolution mixes neighbours in)
    op_arguments(v)                          its effect on the attention, stated once: keyword arguments of the ops (a
                                             decay's `log_decay`), which every form reads, the naive form and the l2
                                             loss as a factor on each pair (`ops.naive.log_pair_factors`); an op
                                             that does not know an argument refuses it
    check_padding(key_valid, state)          a rule of its own on padded keys (a decay: padding on the left only)
    kernels                                  the fast forms that compute it (`KERNELS`): none by default, so a fast
                                             form runs only where every part has said it can (else the general call,
                                             or a refusal where there is none: static decoding)
    layerwise                                whether the layerwise stage fits it on the teacher's q/k/v (a part that
                                             only acts through its inputs trains end to end)
    rate                                     the end-to-end key of its own learning rate, if it has one (`conv_lr`)
    reads_values                             whether its op arguments read the values (a gate); those of the others
                                             are made once while the layer's tensors stay (`step_arguments`)
A `State` is registered for the cache slot under `name` (`cache.PART_STATES`) when the class is made: the slot
makes, reorders, batches, moves, counts and freezes it for static decoding whatever the part.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dofattn.attention.cache import PART_STATES, PartState

# The fast forms, which run a part only where it says so (`Part.kernels`; the general call, on the ops with every
# part's `op_arguments`, runs every part): a pure linear layer's Triton decode step, a window hybrid's static ring
# step (`ring_step`: fixed shapes, no general call to fall back on) and its Triton form, its steady decode step
# (`lean_step`: `fold_key` and `window_decode_step`) and that step's PRF form.
KERNELS = frozenset({"prf_decode_step", "ring_step", "prf_ring_step", "lean_step", "prf_window_step"})


class Part(nn.Module):
    """One mechanism of a `LinearAttention` (see the module's docstring for what the layer asks of it)."""

    name: ClassVar[str] = ""
    State: ClassVar[type[PartState] | None] = None
    layerwise: ClassVar[bool] = True
    kernels: frozenset[str] = frozenset()        # the fast forms that compute it (`KERNELS`): none unless it says
    rate: ClassVar[str | None] = None            # a key of `end_to_end` that gives it a learning rate of its own
    reads_values: bool = False                   # its op arguments read the values (a gate); else made once a step

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

    def op_arguments(self, v: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Its effect, as keyword arguments of the ops (`ops.linear_attention`, `ops.window`, the decode steps), from
        the values v [B, T, H, D] on query heads: none by default."""
        return {}

    def check_padding(self, key_valid: torch.Tensor, state: torch.Tensor | None = None) -> None:
        """UserError where these keys' padding flags [B, Tk] (after a chunk's `state`, if one) cannot be exact for
        this part: any padding by default."""

    def runs(self, kernel: str) -> bool:
        """Whether the fast form `kernel` (one of `KERNELS`) computes this part (`kernels`)."""
        return kernel in self.kernels
