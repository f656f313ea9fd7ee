"""The exact parts: keys a linear layer reads with the teacher's own softmax kernel beside its linear branch, in one
normalisation. A `Window` (the last W keys, and the linear branch's gain against them) and a `Sink` (the first S
real tokens of a sequence) each own their parameters and their cache state; the forms that mix them with the linear
branch are the layer's (`attention.hybrid`), on the op `ops.window`.
"""

from __future__ import annotations

import torch
from torch import nn

from dofattn.attention.cache import LinearStateLayer, PartState, in_ring, last_keys
from dofattn.attention.part import KERNELS, Part
from dofattn.errors import UserError
from dofattn.ops.window import first_keys


class WindowState(PartState):
    """A window's last W keys and values (after RoPE, kv heads: [B, ≤W, Hkv, D]) and whether each is a real token
    ([B, ≤W] bool); for static decoding (`frozen`) a ring of W slots, the key at position p in slot p mod W."""

    NAMES = ("keys", "values", "valid")
    width = 0          # W: how many it keeps (its `Window` says, on its first call)

    def frozen(self, seen: int) -> WindowState:
        """The ring of W slots after `seen` tokens (its last ≤ W keys in order), written in place a step at a time."""
        ring = type(self)()
        ring.width = self.width
        for name in self.NAMES:
            setattr(ring, name, in_ring(getattr(self, name), seen, self.width))
        return ring


class SinkState(PartState):
    """A sink's first S real tokens' keys and values ([B, S, Hkv, D]) in S slots, which slots are filled ([B, S]),
    and `full`: every row's slots filled (checked until they are)."""

    NAMES = ("keys", "values", "valid")
    full = False

    def frozen(self, seen: int) -> SinkState:
        """Static decoding reads S filled slots: after a prompt of at least S real tokens."""
        if self.valid is not None and not self.valid.all():
            raise UserError(f"static decoding with a sink of {self.valid.shape[1]} tokens needs prompts of at least "
                            f"that many real tokens; use a longer prompt or HF generate")
        copy = super().frozen(seen)
        copy.full = self.valid is not None
        return copy


class Window(Part):
    """Exact softmax over the last W keys, the linear branch beyond; `log_gain` [H] (learned, init 0) scales the
    linear part's mass against the window's. Its cache state is the last W keys (`keep`)."""

    name, State = "window", WindowState
    kernels = KERNELS          # the hybrid's fast forms are its own

    @classmethod
    def build(cls, attention, num_heads: int, num_kv_heads: int, head_dim: int) -> Window | None:
        return cls(attention.window, num_heads) if attention.window else None

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.width = int(width)
        self.log_gain = nn.Parameter(torch.zeros(num_heads))                       # [H]

    def extra_repr(self) -> str:
        return f"width={self.width}"

    def keep(self, cache: LinearStateLayer, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor) -> None:
        """The last W of these keys (kv heads), values and flags stay in the cache for the next call."""
        last = cache.part("window")
        last.keys, last.values, last.valid = (last_keys(x, self.width) for x in (k, v, key_valid))
        last.width = self.width


class Sink(Part):
    """The first S real tokens of a sequence stay exact for every later query, however far back, and never enter the
    linear branch (an attention sink; `ops.window`). Beside a window only; with a decay the sink is not decayed.
    Generation keeps their keys in S slots of the cache (a `SinkState`), which a cached call puts before the
    window's keys (the op's `lead`: an exact key's weight does not depend on its distance)."""

    name, State = "sink", SinkState
    kernels = KERNELS          # every hybrid form reads its slots beside the window's

    @classmethod
    def build(cls, attention, num_heads: int, num_kv_heads: int, head_dim: int) -> Sink | None:
        return cls(attention.sink) if attention.sink else None

    def __init__(self, count: int):
        super().__init__()
        self.count = int(count)

    def extra_repr(self) -> str:
        return f"count={self.count}"

    def ready(self, cache: LinearStateLayer) -> bool:
        """Whether every row's S slots are filled (checked, with a GPU sync, until they are)."""
        sink = cache.part("sink")
        if not sink.full:
            sink.full = sink.valid is not None and bool(sink.valid.all())
        return sink.full

    def take(self, cache: LinearStateLayer, key_valid: torch.Tensor) -> torch.Tensor:
        """The first S real tokens ever seen: a row's slots fill over calls if its first calls were shorter."""
        sink = cache.part("sink")
        had = 0 if sink.valid is None else sink.valid.sum(1, keepdim=True)         # [B, 1]
        return first_keys(key_valid, *key_valid.shape, self.count, key_valid.device, had)

    def store(self, cache: LinearStateLayer, k: torch.Tensor, v: torch.Tensor, taken: torch.Tensor) -> None:
        B, T = taken.shape
        S, sink = self.count, cache.part("sink")
        if sink.keys is None:
            sink.keys, sink.values = k.new_zeros(B, S, *k.shape[2:]), v.new_zeros(B, S, *v.shape[2:])
            sink.valid = taken.new_zeros(B, S)
        rank = sink.valid.sum(1, keepdim=True) + taken.cumsum(1)                   # [B, T]: 1-based among taken
        slot = torch.where(taken, rank - 1, S)                                      # slot S: a spare, dropped
        for name, new in (("keys", k), ("values", v)):
            buffer = torch.cat([getattr(sink, name), new.new_zeros(B, 1, *new.shape[2:])], 1)
            index = slot.reshape(B, T, *[1] * (new.dim() - 2)).expand_as(new)
            setattr(sink, name, buffer.scatter(1, index, new)[:, :S])
        sink.valid = torch.cat([sink.valid, taken.new_zeros(B, 1)], 1).scatter(1, slot, taken)[:, :S]
