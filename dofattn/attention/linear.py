"""Pure linear attention's forms (a layer without a window), each given the layer whose call it runs
(`LinearAttention.forms`): a prefill (`attend`) and a cached call (`step`), with whatever the parts put in the op's
arguments (a decay or a gate), on the op `ops.linear_attention`; a one-token PRF step on CUDA the Triton kernel
`ops.triton.prf.prf_decode_step`; and the layer's attention the quadratic way (`naive`).
"""

from __future__ import annotations

import torch
from torch import nn

from dofattn.attention.cache import LinearStateLayer, keep_buffer
from dofattn.features import MAX_KEY_EXCESS, in_model_dtype
from dofattn.ops import linear_attention

TINY = torch.finfo(torch.float32).tiny


class LinearForms:
    """The forms of a `LinearAttention` without a window (the module's docstring), each given the layer it runs."""

    @classmethod
    def attend(cls, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_valid: torch.Tensor | None, state: torch.Tensor | None, output_final_state: bool, backend: str,
               sink_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`LinearAttention.attend` without a window: q, k, v [B, T, H, D] -> (o [B, T, H, D], state or None)."""
        phi_q = layer.feature_map(q, "query")                                      # [B, T, H, M]
        phi_k = layer.feature_map(k, "key")                                        # [B, T, H, M]
        phi_q, phi_k = in_model_dtype(phi_q, q.dtype), in_model_dtype(phi_k, q.dtype)
        if key_valid is not None:
            phi_k = phi_k * key_valid[:, :, None, None].to(phi_k.dtype)           # padding keys add nothing
            layer.check_padding(key_valid, state)
        return linear_attention(phi_q, phi_k, v, initial_state=state, output_final_state=output_final_state,
                                backend=backend, **layer.op_arguments(v))

    @classmethod
    def step(cls, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             key_valid: torch.Tensor | None, cache: LinearStateLayer, backend: str) -> torch.Tensor:
        """A cached call of pure linear attention: continue from the cache's state and keep the new one. q [B, T, H,
        D], k and v [B, T, Hkv, D] -> o [B, T, H, D]."""
        if cls.one_kernel_step(layer, q, cache, backend):
            from dofattn.ops import load_triton
            return load_triton()[0].prf.prf_decode_step(layer.feature_map.prf(), q, k, v, cache.state,
                                                        MAX_KEY_EXCESS, key_valid, **layer.step_arguments(v))
        o, state = cls.attend(layer, q, layer.expand_kv(k), layer.expand_kv(v), key_valid, cache.state, True,
                              backend)
        keep_buffer(cache, "state", state)
        return o

    @classmethod
    def one_kernel_step(cls, layer: nn.Module, q: torch.Tensor, cache: LinearStateLayer, backend: str) -> bool:
        """True when this generation step can run as one Triton kernel (`ops.triton.prf.prf_decode_step`): one token,
        CUDA, no autograd, a PRF map with a calibrated key shift, every part one the kernel runs (`runs`), a float32
        state. (A padding token is handled inside the kernel: nothing here reads GPU values, so nothing syncs.)"""
        return (backend == "auto" and layer.runs("prf_decode_step")
                and q.shape[1] == 1 and q.is_cuda and layer.feature_map.fused_ok(q, "key")
                and cache.state is not None and cache.state.dtype == torch.float32 and cache.state.is_contiguous())

    @classmethod
    def naive(cls, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, rows: bool,
              gain: bool, at: torch.Tensor | None) -> torch.Tensor:
        """`LinearAttention.naive` after the parts' inputs: φq·φk times the pair factors of the parts' op arguments
        (`LinearAttention.log_pair_factor`), in log space for far pairs (`gain`: no window, no gain)."""
        fmap = layer.feature_map
        phi_q, phi_k = fmap(q if at is None else q[:, at], "query"), fmap(k, "key")      # [B, R, H, M], [B, T, H, M]
        T = k.shape[1]
        pos = torch.arange(T, device=q.device) if at is None else at
        mask = torch.arange(T, device=q.device)[None, :] <= pos[:, None]                  # [R, T]
        scores = torch.einsum("bthm,bshm->bhts", phi_q, phi_k).masked_fill(~mask, 0)      # [B, H, R, T]
        log_scores = torch.log(scores.clamp_min(TINY))
        log_factor = layer.log_pair_factor(v, T, at)
        if log_factor is not None:  # a pair's weight is its score times its factor, in log space for far pairs
            log_scores = log_scores + log_factor
            scores = scores * log_factor.exp()                                            # 0 above the diagonal
        return log_scores - torch.log(scores.sum(-1, keepdim=True).clamp_min(TINY)) if rows else log_scores

    @classmethod
    def needs_calibration(cls, layer: nn.Module) -> bool:
        """Pure linear attention has no exact keys to put its mass beside: no gain to calibrate."""
        return False

    @classmethod
    def calibrate(cls, layer: nn.Module, q: torch.Tensor, k: torch.Tensor) -> None:
        """Nothing to calibrate (`needs_calibration`)."""
