"""The balance part: before anything else, a linear layer's queries are multiplied and its keys divided by one
constant c per key/value head. Every logit q·k stays what it was (the exact keys of the window and the sink read the
teacher's kernel unchanged); what changes is what the feature map reads: queries and keys of one size.

A positive random feature map estimates exp(u_q·u_k) with a variance that grows as exp(‖u_q + u_k‖²), and the
features of every key of a head share one shift (`features.PositiveRandomFeatures.key_shift`). Where a model's
QK-norm leaves the keys far larger than the queries (Gemma 3 270M's global layer 11: s‖k‖² ≈ 1,150 against
s‖q‖² ≈ 21), the keys' exponents fall about 250 nats below that shift and every key feature is 0 in float32: the
linear branch reads nothing and cannot train (docs/log/experiments.md, 2026-12-04). With
c⁴ = median ‖k‖² / median ‖q‖² both medians become √(‖q‖²·‖k‖²) (about 155 there).

c is measured once, on the first queries and keys the part sees (the layerwise stage's first batch; an untrained
student's first prompt), over their real tokens, and saved with the student (`log_scale`, NaN until then).
"""

from __future__ import annotations

import math

import torch

from dofattn.attention.part import KERNELS, Part


class Balance(Part):
    """log c per key/value head (`log_scale` [Hkv], a buffer: measured, not trained)."""

    name, layerwise = "balance", False
    kernels = KERNELS          # it acts on the inputs, before any form runs

    @classmethod
    def build(cls, attention, num_heads: int, num_kv_heads: int, head_dim: int) -> Balance | None:
        return cls(num_heads, num_kv_heads) if attention.balance else None

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.register_buffer("log_scale", torch.full((num_kv_heads,), math.nan))
        self._measured: tuple | None = None        # (the buffer's storage and version, whether it is finite)

    def measured(self) -> bool:
        """Whether c is set: read from the device once per change of the buffer (a load, a move, `measure`)."""
        key = (self.log_scale.data_ptr(), self.log_scale._version)
        if self._measured is None or self._measured[0] != key:
            self._measured = (key, bool(torch.isfinite(self.log_scale).all()))
        return self._measured[1]

    def measure(self, q: torch.Tensor, k: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """log c [Hkv] of queries [B, T, H, D] and keys [B, T, Hkv or H, D] over their real tokens (`key_valid`
        [B, T]): (log median ‖k‖² − log median ‖q‖²) / 4 per kv head, the query heads of a group pooled. Shapes
        alone decide the work (no data-dependent shapes: a plan runs it on fake tensors)."""
        group = self.num_heads // self.num_kv_heads
        qn = q.detach().float().square().sum(-1)                                    # [B, T, H]
        kn = k.detach().float().square().sum(-1)                                    # [B, T, Hkv or H]
        if kn.shape[-1] != self.num_kv_heads:                                       # keys on query heads (naive)
            kn = kn[..., ::group]
        if key_valid is not None:                                                   # padding left out of the medians
            qn = qn.masked_fill(~key_valid.bool()[..., None], math.nan)
            kn = kn.masked_fill(~key_valid.bool()[..., None], math.nan)
        qn = qn.reshape(-1, self.num_kv_heads, group).transpose(0, 1).reshape(self.num_kv_heads, -1)
        kn = kn.reshape(-1, self.num_kv_heads).transpose(0, 1)
        tiny = torch.finfo(torch.float32).tiny
        return (kn.nanmedian(-1).values.clamp_min(tiny).log() - qn.nanmedian(-1).values.clamp_min(tiny).log()) / 4

    def inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
               cache=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q·c and k/c (k on kv heads, or on query heads in the layer's naive form), v as it is; c measured on this
        call where it is not yet (in training mode without reading it back: no sync, and a plan's fake tensors
        have no values to read; in eval mode checked once per change of the buffer)."""
        with torch.no_grad():
            if self.training:
                self.log_scale.copy_(torch.where(torch.isfinite(self.log_scale), self.log_scale,
                                                 self.measure(q, k, key_valid).to(self.log_scale)))
            elif not self.measured():
                self.log_scale.copy_(self.measure(q, k, key_valid).to(self.log_scale))
        c = self.log_scale.exp()
        on_queries = c.repeat_interleave(self.num_heads // self.num_kv_heads)
        on_keys = c if k.shape[2] == self.num_kv_heads else on_queries
        return q * on_queries[:, None].to(q.dtype), k / on_keys[:, None].to(k.dtype), v

    def extra_repr(self) -> str:
        return f"kv_heads={self.num_kv_heads}"
