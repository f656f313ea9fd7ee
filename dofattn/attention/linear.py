"""The linear branch's forms, as a mixin of `LinearAttention`: a prefill (`linear_attend`) and a cached call
(`linear_step`) of pure linear attention, with whatever decay or gate (`attention.decay`) the layer has, on the op
`ops.linear_attention`, and for a one-token PRF step on CUDA the Triton kernel `ops.triton.prf.prf_decode_step`.
"""

from __future__ import annotations

import torch

from dofattn.attention.cache import LinearStateLayer, keep_buffer
from dofattn.features import MAX_KEY_EXCESS, in_model_dtype
from dofattn.ops import linear_attention


class LinearBranch:
    """The forms of a `LinearAttention` without a window (see its docstring)."""

    def linear_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                    cache: LinearStateLayer, backend: str) -> torch.Tensor:
        """A cached call of pure linear attention: continue from the cache's state and keep the new one. q [B, T, H,
        D], k and v [B, T, Hkv, D] -> o [B, T, H, D]."""
        if self.one_kernel_step(q, cache, backend):
            from dofattn.ops import load_triton
            return load_triton()[0].prf.prf_decode_step(self.feature_map.prf(), q, k, v, cache.state, MAX_KEY_EXCESS,
                                                        key_valid, **self.step_arguments(v))
        o, state = self.attend(q, self.expand_kv(k), self.expand_kv(v), key_valid, cache.state, True, backend)
        keep_buffer(cache, "state", state)
        return o

    def one_kernel_step(self, q: torch.Tensor, cache: LinearStateLayer, backend: str) -> bool:
        """True when this generation step can run as one Triton kernel (`ops.triton.prf.prf_decode_step`): one token,
        CUDA, no autograd, a PRF map with a calibrated key shift, no window, every part one the kernel runs (`runs`),
        a float32 state.
        (A padding token is handled inside the kernel: nothing here reads GPU values, so nothing syncs.)"""
        fmap = self.feature_map
        return (backend == "auto" and self.window is None and self.runs("prf_decode_step")
                and q.shape[1] == 1 and q.is_cuda and fmap.fused_ok(q, "key") and cache.state is not None
                and cache.state.dtype == torch.float32 and cache.state.is_contiguous())

    def linear_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                      state: torch.Tensor | None, output_final_state: bool,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`LinearAttention.attend` without a window: q, k, v [B, T, H, D] -> (o [B, T, H, D], state or None)."""
        phi_q = self.feature_map(q, "query")                                       # [B, T, H, M]
        phi_k = self.feature_map(k, "key")                                         # [B, T, H, M]
        phi_q, phi_k = in_model_dtype(phi_q, q.dtype), in_model_dtype(phi_k, q.dtype)
        if key_valid is not None:
            phi_k = phi_k * key_valid[:, :, None, None].to(phi_k.dtype)           # padding keys add nothing
            self.check_padding(key_valid, state)
        return linear_attention(phi_q, phi_k, v, initial_state=state, output_final_state=output_final_state,
                                backend=backend, **self.op_arguments(v))

