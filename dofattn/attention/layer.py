"""`LinearAttention`: one layer's linear attention, composed of parts from its `spec.Attention` config.

    layer = LinearAttention(Attention(window=64, sink=4), feature_map, num_kv_heads=3)   # heads and size: the map's

The parts, each a module that owns its parameters and its forms (`attention.exact`, `.decay`, `.conv`, `.delta`):
    feature_map   φ of queries and keys (`features`)
    window        exact softmax over the last W keys, the linear branch beyond, one normalisation (`exact.Window`);
                  the linear branch's weight per head
    sink          the first S real tokens exact for every later query (`exact.Sink`)
    decay         a learned decay of the linear state per head (`decay.Decay`) or per token (`decay.Gate`)
    conv          a short causal convolution of q, k and v (`conv.ShortConv`)
    delta         the delta rule writing the state (`delta.DeltaRule`)
A part the config leaves out is None. Every rule on how the parts combine is the config's (`Attention`), checked
when it is made; the layer only dispatches a call to the forms.
"""

from __future__ import annotations

import torch
from torch import nn

from dofattn.attention.cache import LinearStateLayer, StaticStateLayer
from dofattn.attention.conv import ShortConv
from dofattn.attention.decay import Decay, Gate
from dofattn.attention.delta import DeltaRule
from dofattn.attention.exact import Sink, Window
from dofattn.attention.linear import LinearBranch
from dofattn.errors import UserError
from dofattn.features import FeatureMap
from dofattn.ops.softmax import expand_kv
from dofattn.spec import Attention


class LinearAttention(LinearBranch, nn.Module):
    """One layer's causal linear attention with a learned (or fixed) feature map, its parts as `attention` says.

    window = 0: pure linear attention. window = W > 0: exact softmax over the last W keys and linear attention
    beyond, in one normalisation (`ops.window`); `window.log_gain` [H] (learned, init 0) scales the linear part's mass.
    decay: each head's state decays by a learned γ_h per token, so the pair (t, s) weighs γ_h^(t-s) φq_t·φk_s; beside
    a window, the linear part's pairs weigh γ_h^(t-W-s) (counted from the window's edge; the exact keys, the window
    and the sink, are the teacher's kernel, undecayed).
    """

    def __init__(self, attention: Attention, feature_map: FeatureMap, *, num_kv_heads: int | None = None):
        """`num_kv_heads` None: as many as the query heads; the heads and their size are the feature map's."""
        super().__init__()
        if not isinstance(attention, Attention):
            raise TypeError(f"LinearAttention takes a dofattn.spec.Attention, got {type(attention).__name__}")
        num_heads, head_dim = feature_map.num_heads, feature_map.head_dim
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise UserError(f"{num_heads} query heads do not share {num_kv_heads} kv heads evenly")
        self.attention = attention
        self.feature_map = feature_map
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.window = Window(attention.window, num_heads) if attention.window else None
        self.sink = Sink(attention.sink) if attention.sink else None
        self.decay = (Decay(num_heads) if attention.decay == "head" else Gate(num_heads, head_dim)
                      if attention.decay == "gate" else None)
        self.delta = DeltaRule(num_heads, head_dim) if attention.delta else None
        self.conv = ShortConv(attention.conv, num_heads, num_kv_heads, head_dim) if attention.conv else None
        self.cache_layer: LinearStateLayer | None = None  # set by the pre-hook for the duration of one call

    def extra_repr(self) -> str:
        return self.attention.describe()

    def log_decay(self) -> torch.Tensor | None:
        """[H] float32: log γ_h of each head (< 0), or None without a decay (a gate's rate without its tokens)."""
        return None if self.decay is None else self.decay.log_decay()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
                cache: LinearStateLayer | None = None, backend: str = "auto") -> torch.Tensor:
        """q [B, T, H, D], k and v [B, T, Hkv, D], key_valid [B, T] -> o [B, T, H, D].

        With a `cache` (generation), the call continues from its state (and window of past keys) and updates it. A
        static decode step's (`StaticStateLayer`) token is a generated one, never padding: its mask, which HF builds
        as a tensor while a CUDA graph is captured or a step compiled, is dropped, so that no padding check syncs.
        """
        if isinstance(cache, StaticStateLayer):
            key_valid = None
        if self.conv is not None:
            q, k, v = self.conv(q, k, v, key_valid, cache)
        if cache is None:
            return self.attend(q, self.expand_kv(k), self.expand_kv(v), key_valid, backend=backend)[0]
        if self.window is not None:
            return self.window.step(self, q, k, v, key_valid, cache, backend)
        return self.linear_step(q, k, v, key_valid, cache, backend)

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, Hkv, D] -> [B, T, H, D]: each kv head repeated for its group of query heads (`ops.softmax`)."""
        return expand_kv(x, self.num_heads)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
               state: torch.Tensor | None = None, output_final_state: bool = False,
               backend: str = "auto",
               sink_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention on query-head layout: q [B, T, H, D], k and v [B, Tk, H, D] (Tk > T only for a window
        hybrid's cached keys), key_valid [B, Tk] -> (o [B, T, H, D], state or None). With a sink and no
        `sink_mask`, the call starts a sequence: its first S real keys are the sink."""
        if self.window is not None:
            return self.window.attend(self, q, k, v, key_valid, state, output_final_state, backend, sink_mask)
        return self.linear_attend(q, k, v, key_valid, state, output_final_state, backend)
