"""The delta-rule part (pure linear attention): the state is written by the delta rule (`ops.delta`).

Before token t adds φk_t ⊗ v_t, it removes the fraction β_t of what the state holds along φk_t's direction, so a key
can replace what an earlier, similar key stored instead of piling onto it. β_t = sigmoid(delta_bias_h + u_h·v_t/√D),
read off the value like a gate, started at sigmoid(DELTA_START) for every token (u = 0): a student trained without
it moves only a little, and the end-to-end phase learns where to erase. Combines with a decay or a gate (as in gated
DeltaNet). The layerwise softmax and L2 losses score the kernel's rows, which the erasures do not change, so the
delta rule trains in the end-to-end phase (and in the layerwise output loss).
"""

from __future__ import annotations

import torch
from torch import nn

from dofattn.attention.decay import Decay, read_values
from dofattn.ops.delta import delta_attention

DELTA_START = -6.0      # the erase strength starts at sigmoid(-6) = 0.0025 for every token
DELTA_NAMES = (".delta_bias", ".delta_weight")  # the delta rule's parameters


class DeltaRule(nn.Module):
    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.delta_bias = nn.Parameter(torch.full((num_heads,), DELTA_START))                # [H]
        self.delta_weight = nn.Parameter(torch.zeros(num_heads, head_dim))                   # [H, D]

    def betas(self, v: torch.Tensor) -> torch.Tensor:
        """v [B, T, H, D] (on query heads) -> [B, T, H] float32: each token's erase strength β in (0, 1)."""
        return torch.sigmoid(read_values(v, self.delta_bias, self.delta_weight))

    def attend(self, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, decay: Decay | None,
               state: torch.Tensor | None, output_final_state: bool,
               backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The linear branch with the delta rule, on features [B, T, H, M] and values [B, T, H, D]. The op has a
        recurrent and a chunked form (`ops.delta`): backends naive and recurrent run the first, chunk the second, and
        the others (triton, fla: no delta-rule kernels) run auto, the same numbers within rounding."""
        log_gate = None if decay is None else decay.log_gates_or_decay(v)
        name = {"naive": "recurrent", "recurrent": "recurrent", "chunk": "chunk"}.get(backend, "auto")
        return delta_attention(phi_q, phi_k, v, self.betas(v), log_gate, state, output_final_state, name)
