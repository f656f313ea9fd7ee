"""The decay part of a linear branch: its state fades by a learned factor per head (`Decay`) or per token (`Gate`).

    decay = Decay(num_heads)              # log γ_h = -exp(decay_rate_h), started weak
    decay.log_decay()                     # [H] float32, passed to the ops as `log_decay`
    gate = Gate(num_heads, head_dim)      # log g_th = -exp(decay_rate_h + w_h·v_t/√D), at least GATE_FLOOR
    gate.log_gates(v)                     # [B, T, H] float32, passed to the ops as `log_gate`

Beside a window (and a sink) a `Decay` weighs the linear part's pair (t, s) by γ_h^(t − W − s), counted from the
window's edge, so a key enters the linear branch at full weight; the exact keys are never decayed (`ops.window`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

DECAY_START = (8, 11)   # a decay starts at log γ_h from -2^-8 to -2^-11 over the heads (half-lives 180-1400 tokens)
GATE_FLOOR = -30.0      # a gate's log factor per token is at least this (e^-30: the state all but cleared)


def read_values(v: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """v [B, T, H, D] (on query heads) -> [B, T, H] float32: bias_h + weight_h·v_t/√D, a number per token and head
    read off its value (a gate's log rate)."""
    w = weight.float()
    return bias.float() + torch.einsum("bthd,hd->bth", v.float(), w) / math.sqrt(w.shape[1])


class Decay(nn.Module):
    """A learned decay per head: γ_h = exp(-exp(decay_rate_h)), started weak (half-lives from about 180 to 1400
    tokens across the heads: log γ from -2^-8 to -2^-11); training shortens those that need it."""

    per_token = False

    def __init__(self, num_heads: int):
        super().__init__()
        self.decay_rate = nn.Parameter(-math.log(2) * torch.linspace(*DECAY_START, num_heads))   # [H]

    def log_decay(self) -> torch.Tensor:
        """[H] float32: log γ_h of each head (< 0, at least -1e4)."""
        return -torch.exp(self.decay_rate.float()).clamp_max(1e4)

    def op_arguments(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decay as the linear op takes it (`ops.linear_attention`): `log_decay` [H]."""
        return {"log_decay": self.log_decay()}


class Gate(Decay):
    """A decay per token, read off its value (pure linear attention only): before token t head h's state is
    multiplied by exp(log g_th), log g_th = -exp(decay_rate_h + w_h·v_t/√D), at least GATE_FLOOR. With w = 0 (the
    start) that is `Decay`; training lets a token clear the state (a large w·v) or keep it (a small one)."""

    per_token = True

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__(num_heads)
        self.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim))                    # [H, D]

    def log_gates(self, v: torch.Tensor) -> torch.Tensor:
        """v [B, T, H, D] (on query heads) -> [B, T, H] float32: each token's log factor, in [GATE_FLOOR, 0]."""
        rate = read_values(v, self.decay_rate, self.gate_weight)
        return -torch.exp(rate.clamp_max(math.log(-GATE_FLOOR))).clamp_max(-GATE_FLOOR)   # exp first: no inf·0

    def op_arguments(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"log_gate": self.log_gates(v)}
