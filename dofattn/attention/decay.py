"""The decay part of a linear branch: its state fades by a learned factor per head, or per token (a gate).

    decay = Decay(num_heads, head_dim)                  # log γ_h = -exp(decay_rate_h), started weak
    decay.op_arguments(v)                               # {"log_decay": [H] float32}, as the ops take it
    gate = Decay(num_heads, head_dim, per_token=True)   # log g_th = -exp(decay_rate_h + w_h·v_t/√D) ≥ GATE_FLOOR
    gate.op_arguments(v)                                # {"log_gate": [B, T, H] float32}

Beside a window (and a sink) a `Decay` weighs the linear part's pair (t, s) by γ_h^(t − W − s), counted from the
window's edge, so a key enters the linear branch at full weight; the exact keys are never decayed (`ops.window`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dofattn.attention.part import KERNELS, Part
from dofattn.errors import UserError

DECAY_START = (8, 11)   # a decay starts at log γ_h from -2^-8 to -2^-11 over the heads (half-lives 180-1400 tokens)
GATE_FLOOR = -30.0      # a gate's log factor per token is at least this (e^-30: the state all but cleared)


def read_values(v: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """v [B, T, H, D] (on query heads) -> [B, T, H] float32: bias_h + weight_h·v_t/√D, a number per token and head
    read off its value (a gate's log rate)."""
    w = weight.float()
    return bias.float() + torch.einsum("bthd,hd->bth", v.float(), w) / math.sqrt(w.shape[1])


class Decay(Part):
    """A learned decay of the linear state: per head, γ_h = exp(-exp(decay_rate_h)), started weak (half-lives from
    about 180 to 1400 tokens across the heads: log γ from -2^-8 to -2^-11), training shortening those that need it;
    or per token (`per_token`, a gate; pure linear attention only), read off its value: before token t head h's
    state is multiplied by exp(log g_th), log g_th = -exp(decay_rate_h + w_h·v_t/√D), at least GATE_FLOOR. With
    w = 0 (the start) the gate is the decay per head; training lets a token clear the state (a large w·v) or keep it
    (a small one). Its effect is its op argument (`log_decay` [H] or `log_gate` [B, T, H]), which every form reads;
    the fast forms run the decay per head, the gate only the general call."""

    name = "decay"

    @classmethod
    def build(cls, attention, num_heads: int, num_kv_heads: int, head_dim: int) -> Decay | None:
        return cls(num_heads, head_dim, per_token=attention.decay == "gate") if attention.decays else None

    def __init__(self, num_heads: int, head_dim: int, per_token: bool = False):
        super().__init__()
        self.per_token = bool(per_token)
        self.decay_rate = nn.Parameter(-math.log(2) * torch.linspace(*DECAY_START, num_heads))   # [H]
        if self.per_token:
            self.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim))                    # [H, D]
        self.kernels = frozenset() if self.per_token else KERNELS
        self.reads_values = self.per_token

    def extra_repr(self) -> str:
        return "per token (gate)" if self.per_token else "per head"

    def log_decay(self) -> torch.Tensor:
        """[H] float32: log γ_h of each head (< 0, at least -1e4); a gate's rate before its tokens."""
        return -torch.exp(self.decay_rate.float()).clamp_max(1e4)

    def log_gates(self, v: torch.Tensor) -> torch.Tensor:
        """A gate's log factors: v [B, T, H, D] (on query heads) -> [B, T, H] float32, in [GATE_FLOOR, 0]."""
        rate = read_values(v, self.decay_rate, self.gate_weight)
        return -torch.exp(rate.clamp_max(math.log(-GATE_FLOOR))).clamp_max(-GATE_FLOOR)   # exp first: no inf·0

    def op_arguments(self, v: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """As the linear op takes it (`ops.linear_attention`): `log_gate` [B, T, H] from the values v [B, T, H, D] (on
        query heads), or `log_decay` [H]."""
        return {"log_gate": self.log_gates(v)} if self.per_token else {"log_decay": self.log_decay()}

    def check_padding(self, key_valid: torch.Tensor, state: torch.Tensor | None = None) -> None:
        """A decay counts every position, padding included: padding only on the left (`check_decay_padding`)."""
        check_decay_padding(key_valid, state)


def check_left_padding(key_valid: torch.Tensor) -> None:
    """A decay counts every position, padding included, so padding is exact only where it precedes every real token
    (the state before it holds nothing). UserError for a padding token after a real one among these keys (for a
    window hybrid: the cached keys and the new ones)."""
    if not key_valid.all() and (key_valid.int().diff(dim=1) < 0).any():
        raise UserError("a layer with a decay needs left padding: a padding token after a real one would still "
                        "decay the state; pad on the left (tokenizer.padding_side = 'left')")


def check_decay_padding(key_valid: torch.Tensor, state: torch.Tensor | None) -> None:
    """A decay counts every position, padding included: padding is exact only before a row's first real token (the
    state is still zero while it passes), in the first chunk or, for a prompt read in chunks, a later one. UserError
    for padding after a real token, in this chunk or an earlier one (the row's state is not zero)."""
    if key_valid.all():
        return
    check_left_padding(key_valid)
    if state is not None and state[~key_valid[:, 0]].any():
        raise UserError("a layer with a decay cannot continue its state through padding tokens (each would still "
                        "decay it); continue with unpadded chunks, or pad only the first chunk, on the left")
