"""`LinearAttention`: one layer's linear attention, composed of parts from its `spec.Attention` config.

    layer = LinearAttention(Attention(window=64, sink=4), feature_map, num_kv_heads=3)   # heads and size: the map's

The parts, each a module that owns its parameters and its forms (`attention.exact`, `.decay`, `.conv`):
    feature_map   φ of queries and keys (`features`)
    window        exact softmax over the last W keys, the linear branch beyond, one normalisation (`exact.Window`);
                  the linear branch's weight per head
    sink          the first S real tokens exact for every later query (`exact.Sink`)
    decay         a learned decay of the linear state per head or per token (a gate) (`decay.Decay`)
    conv          a short causal convolution of q, k and v (`conv.ShortConv`)
A part the config leaves out is None. Every rule on how the parts combine is the config's (`Attention`), checked
when it is made. The layer dispatches a call to its forms: pure linear attention's (`linear.LinearBranch`), the
window hybrid's (`hybrid.WindowBranch`); `naive` is its attention matrix the quadratic way, which the layerwise
loss, the gain calibration and the tests read.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dofattn.attention.cache import LinearStateLayer, StaticStateLayer
from dofattn.attention.conv import ShortConv
from dofattn.attention.decay import Decay
from dofattn.attention.exact import Sink, Window
from dofattn.attention.hybrid import WindowBranch
from dofattn.attention.linear import LinearBranch
from dofattn.attention.part import Part
from dofattn.errors import UserError
from dofattn.features import FeatureMap
from dofattn.ops.naive import log_pair_factors
from dofattn.ops.softmax import attention_logits, expand_kv
from dofattn.ops.window import first_keys, window_logits
from dofattn.spec import Attention

TINY = torch.finfo(torch.float32).tiny

# The parts a layer may have, each made from the config (`Part.build`) in this order, which is also the order their
# `inputs` apply; each a child module under its own name.
PARTS: tuple[type[Part], ...] = (Window, Sink, Decay, ShortConv)


class LinearAttention(WindowBranch, LinearBranch, nn.Module):
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
        for part in PARTS:            # each a child module under its name (None where the config leaves it out)
            setattr(self, part.name, part.build(attention, num_heads, num_kv_heads, head_dim))
        self._step_constants = None   # (what they were made from, the PRF step's constants): `step_constants`
        self._step_arguments = None   # (what they were made from, the parts' op arguments): `step_arguments`

    def parts(self) -> list[Part]:
        """The parts this layer has, in the order it was built with them (`PARTS`')."""
        return [child for child in self.children() if isinstance(child, Part)]

    def op_arguments(self, v: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Every part's keyword arguments of the ops (`Part.op_arguments`: its effect), from the values v [B, T, H, D]
        on query heads; every form passes them whole, so an op that does not take one refuses it."""
        return {key: value for part in self.parts() for key, value in part.op_arguments(v).items()}

    def tensor_versions(self) -> tuple:
        """The storage and version of every tensor of the layer: it changes with an optimizer step, a load, a move."""
        return tuple((t.data_ptr(), t._version) for t in (*self.parameters(), *self.buffers()))

    def step_arguments(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts' op arguments for a decode step whose values are v [B, 1, Hkv, D]: made again only when a tensor
        of the layer changed (a decode step is launch-bound); made each call with autograd on, while a step is
        compiled (the compiled graph holds them), or where a part reads the values."""
        if (torch.is_grad_enabled() or torch.compiler.is_compiling()
                or any(part.reads_values for part in self.parts())):
            return self.op_arguments(self.expand_kv(v))
        key = self.tensor_versions()
        if self._step_arguments is None or self._step_arguments[0] != key:
            self._step_arguments = key, self.op_arguments(None)
        return self._step_arguments[1]

    def check_padding(self, key_valid: torch.Tensor, state: torch.Tensor | None = None) -> None:
        """Every part's rule on padded keys (`Part.check_padding`)."""
        for part in self.parts():
            part.check_padding(key_valid, state)

    def runs(self, kernel: str) -> bool:
        """Whether every part runs in the one-kernel form `kernel` (`part.KERNELS`)."""
        return all(part.runs(kernel) for part in self.parts())

    def extra_repr(self) -> str:
        return self.attention.describe()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None,
                cache: LinearStateLayer | None = None, backend: str = "auto") -> torch.Tensor:
        """q [B, T, H, D], k and v [B, T, Hkv, D], key_valid [B, T] -> o [B, T, H, D].

        With a `cache` (generation), the call continues from its state (and window of past keys) and updates it. A
        static decode step's (`StaticStateLayer`) token is a generated one, never padding: its mask, which HF builds
        as a tensor while a CUDA graph is captured or a step compiled, is dropped, so that no padding check syncs.
        """
        if isinstance(cache, StaticStateLayer):
            key_valid = None
        for part in self.parts():
            q, k, v = part.inputs(q, k, v, key_valid, cache)
        if cache is None:
            return self.attend(q, self.expand_kv(k), self.expand_kv(v), key_valid, backend=backend)[0]
        if self.window is not None:
            return self.window_step(q, k, v, key_valid, cache, backend)
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
            return self.window_attend(q, k, v, key_valid, state, output_final_state, backend, sink_mask)
        return self.linear_attend(q, k, v, key_valid, state, output_final_state, backend)

    # --- the naive form: the layer's attention matrix, which every fast form above computes without ---------------

    def naive(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *, rows: bool = True,
              gain: bool = True, at: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's attention the quadratic way, composed from every part: [B, H, T, T] float32 log weights of the
        causal pairs (query t, key s) of q, k [B, T, H, D] on query heads (v, on query heads, for a part that reads
        the values), a sequence from position 0 without padding. First each part's `inputs` (a convolution's
        filters), then the pairs' logits: beside a window the exact keys (the last W, the first S) weigh as the
        teacher's kernel and the linear pairs as the features' (`ops.window.window_logits`, with the parts' op
        arguments); pure linear attention, φq·φk times the pair factors of the parts' op arguments
        (`log_pair_factor`). `rows`: each row normalised,
        the attention matrix that the layerwise loss holds against the teacher's; else the log weights before it
        (log TINY above the diagonal), whose masses the gain calibration compares. `gain`: with the window's learned
        gain on the linear part. `at` [R]: only the rows of these query positions ([B, H, R, T]: a long sequence's
        sampled rows cost R·T; a gate still builds T × T)."""
        for part in self.parts():
            q, k, v = part.inputs(q, k, v, None)
        fmap = self.feature_map
        q_rows = q if at is None else q[:, at]
        if self.window is not None:
            a = self.attention
            phi_q, q_scale = fmap.features(q_rows, "query")
            phi_k, k_scale = fmap.features(k, "key")
            sink = first_keys(None, k.shape[0], k.shape[1], a.sink, k.device) if a.sink else None
            logits, _ = window_logits(q_rows, k, phi_q, phi_k, q_scale,
                                      k_scale + self.window.log_gain if gain else k_scale, fmap.scaling, a.window,
                                      sink_mask=sink, query_at=at, **self.op_arguments(v))
            return torch.log_softmax(logits, -1).clamp_min(math.log(TINY)) if rows else logits
        phi_q, phi_k = fmap(q_rows, "query"), fmap(k, "key")                             # [B, R, H, M], [B, T, H, M]
        T = k.shape[1]
        pos = torch.arange(T, device=q.device) if at is None else at
        mask = torch.arange(T, device=q.device)[None, :] <= pos[:, None]                  # [R, T]
        scores = torch.einsum("bthm,bshm->bhts", phi_q, phi_k).masked_fill(~mask, 0)      # [B, H, R, T]
        log_scores = torch.log(scores.clamp_min(TINY))
        log_factor = self.log_pair_factor(v, T, at)
        if log_factor is not None:  # a pair's weight is its score times its factor, in log space for far pairs
            log_scores = log_scores + log_factor
            scores = scores * log_factor.exp()                                            # 0 above the diagonal
        return log_scores - torch.log(scores.sum(-1, keepdim=True).clamp_min(TINY)) if rows else log_scores

    def log_pair_factor(self, v: torch.Tensor | None, length: int,
                        at: torch.Tensor | None = None) -> torch.Tensor | None:
        """The parts' op arguments as a log factor on the linear part's pairs (`ops.naive.log_pair_factors`; beside a
        window counted from its edge), [B or 1, H, T or R, T], or None where no part puts one."""
        return log_pair_factors(length, -self.attention.window, at, **self.op_arguments(v))

    def needs_gain_calibration(self) -> bool:
        """Whether the linear part's mass must be put on the exact keys' scale before training (`calibrate_gain`):
        beside a window, for a map that does not estimate the kernel itself."""
        return self.window is not None and not self.feature_map.estimates_kernel

    @torch.no_grad()
    def calibrate_gain(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Set the window's `log_gain` so that, per head, the linear part's mass beyond the window matches the exact
        kernel's on average (in log space) over these queries and keys [B, T, H, D] (k on query heads). For maps
        whose scale is not the kernel's own (hedgehog, dijiang), whose estimate can be off by e^50 at the start;
        PRF needs none."""
        if self.window is None or q.shape[1] <= self.window.width:
            return
        logits = self.naive(q, k, rows=False, gain=False)
        far = self.attention.linear_pairs(q.shape[1], q.device)                           # the linear pairs
        exact = attention_logits(q, k, self.feature_map.scaling)
        exact_mass = torch.logsumexp(exact.masked_fill(~far, -torch.inf), -1)              # [B, H, T]
        linear_mass = torch.logsumexp(logits.masked_fill(~far, -torch.inf), -1)
        rows = torch.isfinite(exact_mass) & torch.isfinite(linear_mass)
        gap = torch.where(rows, exact_mass - linear_mass, 0).sum((0, 2)) / rows.sum((0, 2)).clamp_min(1)
        self.window.log_gain.copy_(gap)
