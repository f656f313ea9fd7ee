"""Pure linear attention's mechanisms, as a mixin of `LinearAttention`: a decay (per head) or a gate (per token),
a short convolution on q, k and v, and the delta rule.

Each reads its parameters off the layer (`decay_rate`, `gate_weight`, `conv_q`/`conv_k`/`conv_v`, `delta_bias` and
`delta_weight`, made in `LinearAttention.__init__`) and runs the ops: `ops.linear_attention` (with its decay or
gate), `ops.conv.short_conv`, `ops.delta.delta_attention`, and for a one-token PRF step on CUDA the Triton kernel
`ops.triton.prf.prf_decode_step`.
"""

from __future__ import annotations

import math

import torch

from dofattn.attention.cache import LinearStateLayer, keep_buffer
from dofattn.errors import UserError
from dofattn.features import MAX_KEY_EXCESS, PositiveRandomFeatures, in_model_dtype
from dofattn.ops import linear_attention
from dofattn.ops.conv import short_conv
from dofattn.ops.delta import delta_attention

DECAY_START = (8, 11)   # a decay starts at log γ_h from -2^-8 to -2^-11 over the heads (half-lives 180-1400 tokens)
GATE_FLOOR = -30.0      # a gate's log factor per token is at least this (e^-30: the state all but cleared)
DELTA_START = -6.0      # a delta rule's erase strength starts at sigmoid(-6) = 0.0025 for every token

CONV_NAMES = ("conv_q", "conv_k", "conv_v")    # the convolution filters of q, k and v: parameters and cache tensors
DELTA_NAMES = (".delta_bias", ".delta_weight")  # the delta rule's parameters


class LinearMechanisms:
    """Decay, gate, convolution and delta rule of a `LinearAttention` (see its docstring for the maths)."""

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

    def linear_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                    cache: LinearStateLayer, backend: str) -> torch.Tensor:
        """A cached call of pure linear attention: continue from the cache's state and keep the new one. q [B, T, H,
        D], k and v [B, T, Hkv, D] -> o [B, T, H, D]."""
        if self.one_kernel_step(q, cache, backend):
            from dofattn.ops import load_triton
            return load_triton()[0].prf.prf_decode_step(self.feature_map, q, k, v, cache.state, MAX_KEY_EXCESS,
                                                        key_valid, self.log_decay())
        o, state = self.attend(q, self.expand_kv(k), self.expand_kv(v), key_valid, cache.state, True, backend)
        keep_buffer(cache, "state", state)
        return o

    def one_kernel_step(self, q: torch.Tensor, cache: LinearStateLayer, backend: str) -> bool:
        """True when this generation step can run as one Triton kernel (`ops.triton.prf.prf_decode_step`): one token,
        CUDA, no autograd, a PRF map with a calibrated key shift, no window, a float32 state (with or without a decay).
        (A padding token is handled inside the kernel: nothing here reads GPU values, so nothing syncs.)"""
        fmap = self.feature_map
        return (backend == "auto" and not self.window and not self.gate and not self.delta and q.shape[1] == 1
                and q.is_cuda and isinstance(fmap, PositiveRandomFeatures) and fmap.fused_ok(q, "key")
                and cache.state is not None and cache.state.dtype == torch.float32 and cache.state.is_contiguous())

    def linear_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                      state: torch.Tensor | None, output_final_state: bool,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`LinearAttention.attend` without a window: q, k, v [B, T, H, D] -> (o [B, T, H, D], state or None)."""
        phi_q = self.feature_map(q, "query")                                       # [B, T, H, M]
        phi_k = self.feature_map(k, "key")                                         # [B, T, H, M]
        phi_q, phi_k = in_model_dtype(phi_q, q.dtype), in_model_dtype(phi_k, q.dtype)
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
