"""`LinearAttention`: one layer's linear attention, its parameters and the dispatch to its mechanisms.

The mechanisms live beside it: pure linear attention with its decay, gate, convolution and delta rule in
`attention.linear`, the window/sink hybrid in `attention.hybrid`, the cache slots in `attention.cache`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dofattn.attention.cache import LinearStateLayer, StaticStateLayer
from dofattn.attention.hybrid import WindowHybrid
from dofattn.attention.linear import CONV_NAMES, DECAY_START, DELTA_START, LinearMechanisms
from dofattn.errors import UserError
from dofattn.spec import check_attention
from dofattn.features import FeatureMap
from dofattn.ops.softmax import expand_kv


class LinearAttention(WindowHybrid, LinearMechanisms, nn.Module):
    """One layer's causal linear attention with a learned (or fixed) feature map, optionally beside a softmax window.

    window = 0: pure linear attention. window = W > 0: exact softmax over the last W keys and linear attention
    beyond, in one normalisation (`ops.window`); `log_gain` [H] (learned, init 0) scales the linear part's mass.
    decay: each head's state decays by a learned γ_h per token, so the pair (t, s) weighs γ_h^(t-s) φq_t·φk_s; beside
    a window, the linear part's pairs weigh γ_h^(t-W-s) (counted from the window's edge; the exact part is the
    teacher's kernel). γ_h = exp(-exp(decay_rate_h)), started weak: half-lives from about 180 to 1400 tokens across
    the heads (log γ from -2^-8 to -2^-11); training shortens those that need it.
    sink = S > 0 (beside a window, without a decay): the first S real tokens of a sequence stay exact for every later
    query as well, and never enter the linear part (an attention sink; `ops.window`). Generation keeps their keys.
    gate (pure linear attention only; implies decay): the decay depends on each token, read off its value vector.
    Before token t head h's state is multiplied by exp(log g_th), log g_th = -exp(decay_rate_h + w_h·v_t/√D),
    at least GATE_FLOOR. With w = 0 (the start) that is the decay above; training lets a token clear the state
    (a large w·v) or keep it (a small one). `head_dim` (D) sizes w [H, D].
    conv = K >= 2: before anything else, q, k and v (after RoPE) each pass through a short causal convolution over
    the last K tokens, one learned filter per channel (`ops.conv`), started as the identity. It lets a layer mix a
    token's neighbours into its query, key and value (with a decay, a head can then reach the token before, say,
    which plain linear attention cannot single out). Generation keeps the last K-1 q, k and v beside the state.
    delta (pure linear attention): the state is written by the delta rule (`ops.delta`): before token t adds
    φk_t ⊗ v_t, it removes the fraction β_t of what the state holds along φk_t's direction, so a key can replace
    what an earlier, similar key stored instead of piling onto it. β_t = sigmoid(delta_bias_h + u_h·v_t/√D), read
    off the value like the gate, started at sigmoid(DELTA_START) for every token (u = 0): a student trained without
    it moves only a little, and the end-to-end phase learns where to erase. Combines with a decay or a gate (as in
    gated DeltaNet). The layerwise softmax and L2 losses score the kernel's rows, which the erasures do not change,
    so the delta rule trains in the end-to-end phase (and in the layerwise output loss).
    """

    def __init__(self, feature_map: FeatureMap, num_heads: int, num_kv_heads: int, window: int = 0,
                 decay: bool = False, sink: int = 0, gate: bool = False, head_dim: int = 0, conv: int = 0,
                 delta: bool = False):
        super().__init__()
        check_attention(window=window, sink=sink, decay="gate" if gate else "head" if decay else "none", conv=conv,
                        delta=delta)
        if delta and head_dim < 1:
            raise UserError(f"the delta rule reads the values: give the head dimension (head_dim >= 1), got {head_dim}")
        if conv and head_dim < 1:
            raise UserError(f"a convolution filters every channel: give the head dimension (head_dim >= 1), "
                            f"got {head_dim}")
        if gate and head_dim < 1:
            raise UserError(f"a gate reads the values: give the head dimension (head_dim >= 1), got {head_dim}")
        decay = decay or gate
        self.sink = int(sink)
        self.feature_map = feature_map
        self.num_heads, self.num_kv_heads, self.window = num_heads, num_kv_heads, int(window)
        if self.window:
            self.log_gain = nn.Parameter(torch.zeros(num_heads))                       # [H]
        self.decay = bool(decay)
        if self.decay:   # log γ_h = -exp(rate_h): always < 0; rates spread over the heads, -8 ln 2 to -11 ln 2
            self.decay_rate = nn.Parameter(-math.log(2) * torch.linspace(*DECAY_START, num_heads))   # [H]
        self.gate = bool(gate)
        if self.gate:
            self.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim))                    # [H, D]
        self.delta = bool(delta)
        if self.delta:
            self.delta_bias = nn.Parameter(torch.full((num_heads,), DELTA_START))                # [H]
            self.delta_weight = nn.Parameter(torch.zeros(num_heads, head_dim))                   # [H, D]
        self.conv = int(conv)
        if self.conv:   # [K, heads, D] each, weight[j] on the token j back: the identity to start
            for name, heads in (("conv_q", num_heads), ("conv_k", num_kv_heads), ("conv_v", num_kv_heads)):
                weight = torch.zeros(self.conv, heads, head_dim)
                weight[0] = 1
                self.register_parameter(name, nn.Parameter(weight))
        self.cache_layer: LinearStateLayer | None = None  # set by the pre-hook for the duration of one call

    def extra_repr(self) -> str:
        return ", ".join(([f"window={self.window}"] if self.window else [])
                         + (["gate"] if self.gate else ["decay"] if self.decay else [])
                         + ([f"sink={self.sink}"] if self.sink else [])
                         + ([f"conv={self.conv}"] if self.conv else [])
                         + (["delta"] if self.delta else []))


    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
                cache: LinearStateLayer | None = None, backend: str = "auto") -> torch.Tensor:
        """q [B, T, H, D], k and v [B, T, Hkv, D], key_valid [B, T] -> o [B, T, H, D].

        With a `cache` (generation), the call continues from its state (and window of past keys) and updates it. A
        static decode step's (`StaticStateLayer`) token is a generated one, never padding: its mask, which HF builds
        as a tensor while a CUDA graph is captured or a step compiled, is dropped, so that no padding check syncs.
        """
        if isinstance(cache, StaticStateLayer):
            key_valid = None
        if self.conv:
            q, k, v = self.convolve(q, k, v, key_valid, cache)
        if cache is None:
            return self.attend(q, self.expand_kv(k), self.expand_kv(v), key_valid, backend=backend)[0]
        if self.window:
            return self.hybrid_step(q, k, v, key_valid, cache, backend)
        return self.linear_step(q, k, v, key_valid, cache, backend)

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, Hkv, D] -> [B, T, H, D]: each kv head repeated for its group of query heads (`ops.softmax`)."""
        return expand_kv(x, self.num_heads)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
               state: torch.Tensor | None = None, output_final_state: bool = False,
               backend: str = "auto", sink_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention on query-head layout: q [B, T, H, D], k and v [B, Tk, H, D] (Tk > T only for a window
        hybrid's cached keys), key_valid [B, Tk] -> (o [B, T, H, D], state or None). With a sink and no
        `sink_mask`, the call starts a sequence: its first S real keys are the sink."""
        if self.window:
            return self.hybrid_attend(q, k, v, key_valid, state, output_final_state, backend, sink_mask)
        return self.linear_attend(q, k, v, key_valid, state, output_final_state, backend)
