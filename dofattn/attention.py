"""The drop-in linear attention: a feature map per layer, plugged into Hugging Face attention modules.

A linearized layer keeps its HF attention module (projections, RoPE, output projection all untouched) and gains a
child module `dofattn` (a `LinearAttention`). The model's attention implementation is set to "dofattn", an
`AttentionInterface` function that runs `LinearAttention` for modules that have one and SDPA for the others.

Generation: a linear layer needs no KV cache, only its recurrent state [B, H, M, V+1]. A forward pre-hook on each
linearized module finds the HF `Cache` it is called with (`cache`; `past_key_values` or `layer_past` before
transformers 5.24) and puts a `LinearStateLayer` in that layer's slot: it stores only the state and the token count
(plus, for a window hybrid, the last W keys and values, and with a short convolution its last K-1 inputs), so memory
stays flat in context length. `model.generate()` needs nothing special.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dofattn.errors import UserError
from dofattn.features import MAX_KEY_EXCESS, FeatureMap, PositiveRandomFeatures
from dofattn.ops import linear_attention
from dofattn.ops.conv import short_conv
from dofattn.ops.delta import delta_attention
from dofattn.ops.naive import TINY, augment_values, needs_grad
from dofattn.ops.window import first_keys, window_linear_attention, window_logits

IMPLEMENTATION = "dofattn"
DECAY_START = (8, 11)   # a decay starts at log γ_h from -2^-8 to -2^-11 over the heads (half-lives 180-1400 tokens)
GATE_FLOOR = -30.0      # a gate's log factor per token is at least this (e^-30: the state all but cleared)
DELTA_START = -6.0      # a delta rule's erase strength starts at sigmoid(-6) = 0.0025 for every token


CONV_NAMES = ("conv_q", "conv_k", "conv_v")    # the --conv filters of q, k and v: parameters and cache tensors
DELTA_NAMES = (".delta_bias", ".delta_weight")  # the delta rule's parameters


class LinearAttention(nn.Module):
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
        if delta and window:
            raise UserError(f"the delta rule is for pure linear attention: drop it or the {window}-token window")
        if delta and head_dim < 1:
            raise UserError(f"the delta rule reads the values: give the head dimension (head_dim >= 1), got {head_dim}")
        if conv < 0 or conv == 1:
            raise UserError(f"conv is a filter width of at least 2 tokens (0: none), got {conv}")
        if conv and head_dim < 1:
            raise UserError(f"a convolution filters every channel: give the head dimension (head_dim >= 1), "
                            f"got {head_dim}")
        if gate and window:
            raise UserError(f"a gate is for pure linear attention: drop it or the {window}-token window")
        if gate and head_dim < 1:
            raise UserError(f"a gate reads the values: give the head dimension (head_dim >= 1), got {head_dim}")
        decay = decay or gate
        if window < 0:
            raise UserError(f"window must be >= 0 tokens (0: no softmax window), got {window}")
        if sink < 0:
            raise UserError(f"sink must be >= 0 tokens (0: none), got {sink}")
        if sink and not window:
            raise UserError(f"a sink of {sink} tokens sits beside a softmax window: give a window >= 1 as well")
        if sink and decay:
            raise UserError("a sink and a decay do not combine: drop one of them")
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

    @staticmethod
    def read_values(v: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """v [B, T, H, D] (on query heads) -> [B, T, H] float32: bias_h + weight_h·v_t/√D, a number per token and
        head read off its value (the gate's log rate, the delta rule's erase logit)."""
        w = weight.float()
        return bias.float() + torch.einsum("bthd,hd->bth", v.float(), w) / math.sqrt(w.shape[1])

    def log_gates(self, v: torch.Tensor) -> torch.Tensor:
        """v [B, T, H, D] (on query heads) -> [B, T, H] float32: each token's log factor, in [GATE_FLOOR, 0]."""
        rate = self.read_values(v, self.decay_rate, self.gate_weight)
        return -torch.exp(rate.clamp_max(math.log(-GATE_FLOOR))).clamp_max(-GATE_FLOOR)   # exp first: no inf·0

    def betas(self, v: torch.Tensor) -> torch.Tensor:
        """v [B, T, H, D] (on query heads) -> [B, T, H] float32: each token's erase strength β in (0, 1)."""
        return torch.sigmoid(self.read_values(v, self.delta_bias, self.delta_weight))

    def log_decay(self) -> torch.Tensor | None:
        """[H] float32: log γ_h of each head (< 0, at least -1e4), or None without a decay."""
        return -torch.exp(self.decay_rate.float()).clamp_max(1e4) if self.decay else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
                cache: LinearStateLayer | None = None, backend: str = "auto") -> torch.Tensor:
        """q [B, T, H, D], k and v [B, T, Hkv, D], key_valid [B, T] -> o [B, T, H, D].

        With a `cache` (generation), the call continues from its state (and window of past keys) and updates it.
        """
        if self.conv:
            q, k, v = self.convolve(q, k, v, key_valid, cache)
        if cache is None:
            return self.attend(q, self.expand_kv(k), self.expand_kv(v), key_valid, backend=backend)[0]
        if isinstance(cache, RingWindowLayer):
            return self.ring_step(q, k, v, cache, backend)
        if self.one_kernel_step(q, cache, backend):
            from dofattn.ops import load_triton
            return load_triton()[0].prf.prf_decode_step(self.feature_map, q, k, v, cache.state, MAX_KEY_EXCESS,
                                                        key_valid, self.log_decay())
        if self.sink:
            return self.sink_step(q, k, v, key_valid, cache, backend)
        if self.window:  # the cache keeps each key's padding flag beside it
            if key_valid is None:
                key_valid = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)
            if cache.keys is not None:  # past keys still inside the window come first
                k, v = torch.cat([cache.keys, k], 1), torch.cat([cache.values, v], 1)
                key_valid = torch.cat([cache.key_valid, key_valid], 1)
        o, state = self.attend(q, self.expand_kv(k), self.expand_kv(v), key_valid, cache.state, True, backend)
        keep_buffer(cache, "state", state)
        if self.window:
            keep = slice(max(k.shape[1] - self.window, 0), None)
            cache.keys, cache.values, cache.key_valid = k[:, keep], v[:, keep], key_valid[:, keep]
        return o

    def convolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                 cache: LinearStateLayer | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v through their short convolutions (`ops.conv`), shapes kept. A padding token's inputs count as
        zeros, so left padding looks like the start of a sequence. With a `cache`, its last K-1 inputs of each come
        first, and this call's last K-1 take their place."""
        if key_valid is not None:
            keep = key_valid[:, :, None, None]
            q, k, v = (x * keep.to(x.dtype) for x in (q, k, v))
        out = []
        for name, x in zip(CONV_NAMES, (q, k, v)):
            y, tail = short_conv(x, getattr(self, name), None if cache is None else getattr(cache, name))
            if cache is not None:
                keep_buffer(cache, name, tail)
            out.append(y)
        return tuple(out)

    def sink_step(self, q, k, v, key_valid, cache: LinearStateLayer, backend: str) -> torch.Tensor:
        """A cached call of a hybrid with a sink: the keys go in as [sink slots, cached window keys, new keys]. The
        first S real tokens ever seen fill the S sink slots (a row's slots fill over calls if its first calls were
        shorter); they are exact for every query and marked as padding in the window cache, so no key counts twice.
        An exact key's weight does not depend on its distance, so putting the sinks first changes nothing. The
        first call (an empty cache) has no slots to put first: its keys are its own, as many as its queries, so a
        CUDA prefill takes the Triton hybrid."""
        B, T = k.shape[:2]
        S = self.sink
        if key_valid is None:
            key_valid = torch.ones(B, T, dtype=torch.bool, device=k.device)
        first = cache.sink_keys is None
        if first:
            cache.sink_keys, cache.sink_values = k.new_zeros(B, S, *k.shape[2:]), v.new_zeros(B, S, *v.shape[2:])
            cache.sink_valid = key_valid.new_zeros(B, S)
        have = cache.sink_valid.sum(1, keepdim=True)                                # [B, 1]
        rank = have + key_valid.cumsum(1)                                           # [B, T]: 1-based among real
        new_sink = key_valid & (rank <= S)
        lead = 0 if first else S                                                    # sink slots put first
        keys, values, valid = ([], [], []) if first else ([cache.sink_keys], [cache.sink_values], [cache.sink_valid])
        if cache.keys is not None:
            keys, values, valid = keys + [cache.keys], values + [cache.values], valid + [cache.key_valid]
        keys, values, valid = torch.cat(keys + [k], 1), torch.cat(values + [v], 1), torch.cat(valid + [key_valid], 1)
        sinks = torch.cat(([] if first else [cache.sink_valid])
                          + [valid.new_zeros(B, keys.shape[1] - lead - T), new_sink], 1)
        o, cache.state = self.attend(q, self.expand_kv(keys), self.expand_kv(values), valid, cache.state, True,
                                     backend, sink_mask=sinks)
        slot = torch.where(new_sink, rank - 1, S)                                   # slot S: a spare, dropped
        for name, new in (("sink_keys", k), ("sink_values", v)):
            buffer = torch.cat([getattr(cache, name), new.new_zeros(B, 1, *new.shape[2:])], 1)
            index = slot.reshape(B, T, *[1] * (new.dim() - 2)).expand_as(new)
            setattr(cache, name, buffer.scatter(1, index, new)[:, :S])
        cache.sink_valid = torch.cat([cache.sink_valid, new_sink.new_zeros(B, 1)], 1).scatter(1, slot, new_sink)[:, :S]
        window_valid = valid[:, lead:].clone()
        window_valid[:, -T:] &= ~new_sink                                           # a sink is not a window key
        keep = slice(max(keys.shape[1] - lead - self.window, 0) + lead, None)
        cache.keys, cache.values = keys[:, keep], values[:, keep]
        cache.key_valid = window_valid[:, keep.start - lead:]
        return o

    def one_kernel_step(self, q: torch.Tensor, cache: LinearStateLayer, backend: str) -> bool:
        """True when this generation step can run as one Triton kernel (`ops.triton.prf.prf_decode_step`): one token,
        CUDA, no autograd, a PRF map with a calibrated key shift, no window, a float32 state (with or without a decay).
        (A padding token is handled inside the kernel: nothing here reads GPU values, so nothing syncs.)"""
        fmap = self.feature_map
        return (backend == "auto" and not self.window and not self.gate and not self.delta and q.shape[1] == 1
                and q.is_cuda and isinstance(fmap, PositiveRandomFeatures) and fmap.fused_ok(q, "key")
                and cache.state is not None and cache.state.dtype == torch.float32 and cache.state.is_contiguous())

    def one_kernel_ring(self, q: torch.Tensor, cache: RingWindowLayer, backend: str) -> bool:
        """True when this ring step runs as one Triton kernel (`ops.triton.window.prf_ring_step`): backend auto on
        CUDA, or backend triton (on CPU: Triton's interpreter, for tests); a PRF map with a calibrated key shift, in
        eval mode, no autograd, a contiguous float32 state. Reads nothing from the GPU per step (the calibration
        once)."""
        fmap = self.feature_map
        if not (backend == "triton" or (backend == "auto" and q.is_cuda)) or self.gate:
            return False
        if needs_grad(q, *self.parameters()):
            return False
        from dofattn.ops import load_triton
        return (isinstance(fmap, PositiveRandomFeatures) and not fmap.training and fmap.shift_calibrated()
                and cache.state is not None and cache.state.dtype == torch.float32 and cache.state.is_contiguous()
                and load_triton()[0] is not None)

    def ring_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: RingWindowLayer,
                  backend: str = "auto") -> torch.Tensor:
        """One static decode step of a window hybrid (the `naive_window_linear_attention` row for one query) on a ring
        of W key slots: the key leaving the window is folded into the state, the new key takes its slot. Fixed shapes
        and in-place updates only, with the position read from the cache's tensor, so a CUDA graph can replay it.
        q [B, 1, H, D], k and v [B, 1, Hkv, D] -> o [B, 1, H, D]. On CUDA (or with backend triton) a PRF map runs
        it as one kernel (`one_kernel_ring`); the PyTorch below is its reference, and the path for the other maps."""
        fmap, W = self.feature_map, self.window
        if self.one_kernel_ring(q, cache, backend):
            from dofattn.ops import load_triton
            if cache.arrivals is None or cache.arrivals.shape[0] != q.shape[0]:
                cache.arrivals = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
            return load_triton()[0].window.prf_ring_step(
                fmap, q, k, v, cache.state, cache.keys, cache.values, cache.key_valid, cache.position, self.log_gain,
                MAX_KEY_EXCESS, self.decay_rate if self.decay else None, cache.sink_keys, cache.sink_values,
                cache.sink_valid, cache.arrivals)
        slot = cache.position.remainder(W)                                         # [1]
        old_k, old_v = cache.keys.index_select(1, slot), cache.values.index_select(1, slot)   # [B, 1, Hkv, D]
        old_valid = cache.key_valid.index_select(1, slot).float()                 # [B, 1]
        phi_old, k_scale = fmap.features(self.expand_kv(old_k), "key")             # [B, 1, H, M], [H]
        v_old = augment_values(self.expand_kv(old_v), torch.float32)               # [B, 1, H, V+1]
        if self.decay:  # the state moves on by one step (as of the key now leaving the window)
            cache.state.mul_(torch.exp(self.log_decay())[None, :, None, None])
        cache.state.add_(torch.einsum("bthm,bthv->bhmv", phi_old.float() * old_valid[..., None, None], v_old))
        cache.keys.index_copy_(1, slot, k)
        cache.values.index_copy_(1, slot, v)
        cache.key_valid.index_fill_(1, slot, True)

        keys, values, valid = cache.keys, cache.values, cache.key_valid
        if self.sink:    # the sink's slots sit beside the ring: exact, never folded
            keys, values = torch.cat([cache.sink_keys, keys], 1), torch.cat([cache.sink_values, values], 1)
            valid = torch.cat([cache.sink_valid, valid], 1)
        keys, values = self.expand_kv(keys).float(), self.expand_kv(values).float()             # [B, S+W, H, D]
        logits = fmap.scaling * torch.einsum("bqhd,bshd->bhqs", q.float(), keys)                # [B, H, 1, S+W]
        logits = logits.masked_fill(~valid[:, None, None, :], -torch.inf)
        phi_q, q_scale = fmap.features(q, "query")                                              # [B, 1, H, M]
        shift = (q_scale + k_scale + self.log_gain).float().permute(0, 2, 1)                    # [B, H, 1]
        num = torch.einsum("bqhm,bhmv->bhqv", phi_q.float(), cache.state[..., :-1])            # [B, H, 1, V]
        den = torch.einsum("bqhm,bhm->bhq", phi_q.float(), cache.state[..., -1])                # [B, H, 1]
        lam = torch.where(den > 0, torch.log(den.clamp_min(TINY)) + shift, -torch.inf)
        m = torch.maximum(logits.amax(-1), lam)
        m = torch.where(torch.isfinite(m), m, 0)
        p = torch.exp(logits - m[..., None])                                                    # [B, H, 1, W]
        w_lin = torch.where(den > 0, torch.exp(lam - m), 0)                                     # [B, H, 1]
        o = torch.einsum("bhqs,bshv->bhqv", p, values) + (w_lin / den.clamp_min(TINY))[..., None] * num
        o = o / (p.sum(-1) + w_lin).clamp_min(TINY)[..., None]
        return o.transpose(1, 2).to(q.dtype)                                                    # [B, 1, H, V]

    @torch.no_grad()
    def calibrate_gain(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Set `log_gain` so that, per head, the linear part's mass beyond the window matches the exact kernel's on
        average (in log space) over these queries and keys [B, T, H, D] (k on query heads). For maps whose scale is
        not the kernel's own (hedgehog, dijiang), whose estimate can be off by e^50 at the start; PRF needs none."""
        if not self.window or q.shape[1] <= self.window:
            return
        phi_q, q_scale = self.feature_map.features(q, "query")
        phi_k, k_scale = self.feature_map.features(k, "key")
        sink = first_keys(None, k.shape[0], k.shape[1], self.sink, k.device) if self.sink else None
        logits, _ = window_logits(q, k, phi_q, phi_k, q_scale, k_scale, self.feature_map.scaling, self.window,
                                  log_decay=self.log_decay(), sink_mask=sink)
        T = q.shape[1]
        far = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-self.window)         # s <= t - W
        far = far & (torch.arange(T, device=q.device) >= self.sink)                            # not a sink
        exact = (self.feature_map.scaling * torch.einsum("bthd,bshd->bhts", q.float(), k.float()))
        exact_mass = torch.logsumexp(exact.masked_fill(~far, -torch.inf), -1)                  # [B, H, T]
        linear_mass = torch.logsumexp(logits.masked_fill(~far, -torch.inf), -1)
        rows = torch.isfinite(exact_mass) & torch.isfinite(linear_mass)
        gap = torch.where(rows, exact_mass - linear_mass, 0).sum((0, 2)) / rows.sum((0, 2)).clamp_min(1)
        self.log_gain.copy_(gap)

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, Hkv, D] -> [B, T, H, D]: each kv head repeated for its group of query heads."""
        group = self.num_heads // self.num_kv_heads
        return x.repeat_interleave(group, dim=2) if group > 1 else x

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
               state: torch.Tensor | None = None, output_final_state: bool = False,
               backend: str = "auto", sink_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention on query-head layout: q [B, T, H, D], k and v [B, Tk, H, D] (Tk > T only for a window
        hybrid's cached keys), key_valid [B, Tk] -> (o [B, T, H, D], state or None). With a sink and no
        `sink_mask`, the call starts a sequence: its first S real keys are the sink."""
        if self.window:
            if self.sink and sink_mask is None:
                sink_mask = first_keys(key_valid, k.shape[0], k.shape[1], self.sink, k.device)
            phi_q, q_scale = self.feature_map.features(q, "query")                 # [B, T, H, M], [B, T, H]
            phi_k, k_scale = self.feature_map.features(k, "key")                   # [B, Tk, H, M], [H]
            if q.dtype in (torch.bfloat16, torch.float16):
                phi_q, phi_k = phi_q.to(q.dtype), phi_k.to(q.dtype)
            if self.decay and key_valid is not None:   # the cached keys come first: left padding stays exact
                check_left_padding(key_valid)
            return window_linear_attention(q, k, v, phi_q, phi_k, q_scale, k_scale + self.log_gain,
                                           self.feature_map.scaling, self.window, key_valid, state,
                                           output_final_state=output_final_state, backend=backend,
                                           log_decay=self.log_decay(), sink_mask=sink_mask)
        phi_q = self.feature_map(q, "query")                                       # [B, T, H, M]
        phi_k = self.feature_map(k, "key")                                         # [B, T, H, M]
        if q.dtype in (torch.bfloat16, torch.float16):   # 16-bit model: 16-bit features, float32 sums in the op
            phi_q, phi_k = phi_q.to(q.dtype), phi_k.to(q.dtype)
        if key_valid is not None:
            phi_k = phi_k * key_valid[:, :, None, None].to(phi_k.dtype)           # padding keys add nothing
            if self.decay:
                check_decay_padding(key_valid, state)
        if self.delta:
            return self.delta_attend(phi_q, phi_k, v, state, output_final_state, backend)
        decay = {"log_gate": self.log_gates(v)} if self.gate else {"log_decay": self.log_decay()}
        return linear_attention(phi_q, phi_k, v, initial_state=state, output_final_state=output_final_state,
                                backend=backend, **decay)

    def delta_attend(self, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, state: torch.Tensor | None,
                     output_final_state: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attend` with the delta rule, on features [B, T, H, M] and values [B, T, H, D]. The op has a recurrent
        and a chunked form (`ops.delta`): backends naive and recurrent run the first, chunk the second, and the
        others (triton, fla: no delta-rule kernels) run auto, the same numbers within rounding."""
        if self.gate:
            log_gate = self.log_gates(v)
        elif self.decay:
            log_gate = self.log_decay()[None, None].expand(*v.shape[:3])
        else:
            log_gate = None
        name = {"naive": "recurrent", "recurrent": "recurrent", "chunk": "chunk"}.get(backend, "auto")
        return delta_attention(phi_q, phi_k, v, self.betas(v), log_gate, state, output_final_state, name)


def keep_buffer(cache: LinearStateLayer, name: str, value: torch.Tensor) -> None:
    """Store `value` as the cache's tensor `name`. While a CUDA graph is being captured (`engine.StaticDecoder`) it
    is copied into the tensor already there, so that every replay reads and writes the same buffer."""
    old = getattr(cache, name)
    if (old is not None and value.is_cuda and torch.cuda.is_current_stream_capturing()
            and value.shape == old.shape and value.dtype == old.dtype):
        old.copy_(value)
    else:
        setattr(cache, name, value)


def check_left_padding(key_valid: torch.Tensor) -> None:
    """A decay counts every position, padding included, so padding is exact only where it precedes every real token
    (the state before it holds nothing). UserError for a padding token after a real one among these keys (for a
    window hybrid: the cached keys and the new ones)."""
    if not key_valid.all() and (key_valid.int().diff(dim=1) < 0).any():
        raise UserError("a layer with a decay needs left padding: a padding token after a real one would still "
                        "decay the state; pad on the left (tokenizer.padding_side = 'left')")


def check_decay_padding(key_valid: torch.Tensor, state: torch.Tensor | None) -> None:
    """A decay counts every position, padding included: padding is exact only on the left of a first chunk (the
    state is still zero while it passes). UserError for padding after a real token or in a continued chunk."""
    if key_valid.all():
        return
    if state is not None:
        raise UserError("a layer with a decay cannot continue its state through padding tokens (each would still "
                        "decay it); continue with unpadded chunks, or pad only the first chunk, on the left")
    check_left_padding(key_valid)


class LinearStateLayer(CacheLayerMixin):
    """A cache slot for a linear layer: the recurrent state and the number of tokens seen, no keys or values."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.state: torch.Tensor | None = None   # [B, H, M, V+1], float32
        self.seen = 0
        # Window hybrids only: the last W keys and values (after RoPE, kv heads) and whether each is a real token.
        self.keys: torch.Tensor | None = None        # [B, ≤W, Hkv, D]
        self.values: torch.Tensor | None = None      # [B, ≤W, Hkv, D]
        self.key_valid: torch.Tensor | None = None   # [B, ≤W] bool
        # With a sink: the first S real tokens' keys and values, in S slots, and which slots are filled.
        self.sink_keys: torch.Tensor | None = None    # [B, S, Hkv, D]
        self.sink_values: torch.Tensor | None = None  # [B, S, Hkv, D]
        self.sink_valid: torch.Tensor | None = None   # [B, S] bool
        # With a short convolution: the last K-1 inputs of q, k and v (zeros before the first token).
        self.conv_q: torch.Tensor | None = None       # [B, K-1, H, D]
        self.conv_k: torch.Tensor | None = None       # [B, K-1, Hkv, D]
        self.conv_v: torch.Tensor | None = None       # [B, K-1, Hkv, D]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}

    TENSORS = ("state", "keys", "values", "key_valid", "sink_keys", "sink_values", "sink_valid", "conv_q", "conv_k",
               "conv_v")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states  # the attention sees only the new tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        for name, t in self.tensors().items():
            setattr(self, name, t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized:
            for name, t in self.tensors().items():
                if t.device != self.device:
                    setattr(self, name, t.to(self.device, non_blocking=True))

    def reset(self) -> None:
        self.state = self.keys = self.values = self.key_valid = None
        self.sink_keys = self.sink_values = self.sink_valid = None
        self.conv_q = self.conv_k = self.conv_v = None
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for name, t in self.tensors().items():
            setattr(self, name, t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for name, t in self.tensors().items():
            setattr(self, name, t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for name, t in self.tensors().items():
            setattr(self, name, t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a linear attention state cannot drop tokens (no assisted or speculative decoding)")


class RingWindowLayer(LinearStateLayer):
    """A window hybrid's cache slot for static decoding (`engine.StaticDecoder`): the last W keys and values in a ring
    of W slots (the key at position p in slot p mod W) instead of a growing-then-sliding list, and `position`, a
    [1] tensor the decoder advances in place: the position of the token being decoded. `arrivals` [B] int32 (zeros
    between steps) is the one-kernel step's count of the programs that have read a row's ring slot."""

    arrivals: torch.Tensor | None = None

    @classmethod
    def from_layer(cls, layer: LinearStateLayer, window: int, position: torch.Tensor) -> RingWindowLayer:
        """The ring for `layer` after a prefill of `layer.seen` tokens (it holds their last ≤ W keys in order)."""
        ring = cls()
        ring.is_initialized = layer.is_initialized
        ring.dtype, ring.device = getattr(layer, "dtype", None), getattr(layer, "device", None)
        ring.seen, ring.state, ring.position = layer.seen, layer.state.float().contiguous(), position
        ring.conv_q, ring.conv_k, ring.conv_v = layer.conv_q, layer.conv_k, layer.conv_v
        B, n, Hkv, D = layer.keys.shape
        slots = torch.arange(layer.seen - n, layer.seen, device=layer.keys.device) % window
        ring.keys = layer.keys.new_zeros(B, window, Hkv, D).index_copy_(1, slots, layer.keys)
        ring.values = layer.values.new_zeros(B, window, Hkv, layer.values.shape[-1]).index_copy_(1, slots,
                                                                                                 layer.values)
        ring.key_valid = layer.key_valid.new_zeros(B, window).index_copy_(1, slots, layer.key_valid)
        ring.arrivals = torch.zeros(B, dtype=torch.int32, device=layer.keys.device)
        if layer.sink_keys is not None:   # a sink: its slots are full after a prompt of at least S real tokens
            if not layer.sink_valid.all():
                raise UserError(f"static decoding with a sink of {layer.sink_valid.shape[1]} tokens needs prompts of "
                                f"at least that many real tokens; use a longer prompt or HF generate")
            ring.sink_keys, ring.sink_values, ring.sink_valid = (x.contiguous() for x in (
                layer.sink_keys, layer.sink_values, layer.sink_valid))   # slices of a longer buffer: the kernel's rows
        return ring


def state_layer(cache: Cache, layer_idx: int) -> LinearStateLayer:
    """The `LinearStateLayer` in `cache`'s slot `layer_idx`, put there if the slot is a fresh dynamic layer."""
    cache = getattr(cache, "self_attention_cache", cache)  # EncoderDecoderCache
    if not isinstance(cache, Cache):
        raise UserError(f"linearized layers need a transformers Cache, got {type(cache).__name__}")
    while len(cache.layers) <= layer_idx:
        cache.layers.append(DynamicLayer())
    slot = cache.layers[layer_idx]
    if isinstance(slot, LinearStateLayer):
        return slot
    if type(slot) is not DynamicLayer or slot.get_seq_length() > 0:
        raise UserError(f"layer {layer_idx} is linear attention and cannot continue a {type(slot).__name__} cache "
                        f"with {slot.get_seq_length()} tokens; let generate() create the cache (DynamicCache)")
    cache.layers[layer_idx] = LinearStateLayer()
    return cache.layers[layer_idx]


# What an HF attention module's forward calls its cache: `cache` from transformers 5.24 on, `past_key_values` before,
# `layer_past` in older GPT-NeoX code.
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def _bind_cache(module: nn.Module, args, kwargs) -> None:
    linear = getattr(module, "dofattn", None)       # None: the linear part taken off, softmax again
    if linear is not None:
        cache = next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
        linear.cache_layer = None if cache is None else state_layer(cache, module.layer_idx)


def _unbind_cache(module: nn.Module, args, kwargs, output) -> None:
    linear = getattr(module, "dofattn", None)
    if linear is not None:
        linear.cache_layer = None


def _key_padding(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """[B, T] True where a key is a real token, from the 4D mask the mask interface built (None: no padding)."""
    if attention_mask is None:
        return None
    last_row = attention_mask[:, 0, -1, -length:]          # the last query sees every real key before it
    return last_row if last_row.dtype == torch.bool else last_row == 0


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: q [B, H, T, D], k/v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    linear = getattr(module, "dofattn", None)
    if linear is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if key.shape[2] != query.shape[2]:
        raise UserError(f"layer {module.layer_idx} is linear attention but received {key.shape[2]} keys for "
                        f"{query.shape[2]} queries: a KV cache of past tokens; use the default DynamicCache")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    key_valid = _key_padding(attention_mask, k.shape[1])
    return linear(q, k, v, key_valid, cache=linear.cache_layer), None


def install(model: nn.Module) -> None:
    """Route `model`'s attention through dofattn and hook the linearized modules' cache handling."""
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
    for module in model.modules():
        if isinstance(getattr(module, "dofattn", None), LinearAttention) and not getattr(module, "_dofattn_hooked",
                                                                                          False):
            module.register_forward_pre_hook(_bind_cache, with_kwargs=True)
            module.register_forward_hook(_unbind_cache, with_kwargs=True)
            module._dofattn_hooked = True
