"""`LinearAttention`: one layer's linear attention, composed of parts from its `spec.Attention` config.

    layer = LinearAttention(Attention(window=64, sink=4), feature_map, num_kv_heads=3)   # heads and size: the map's

The parts, each a module that owns its parameters and its cache state (`attention.hybrid`, `.decay`, `.conv`):
    feature_map   φ of queries and keys (`features`)
    window        exact softmax over the last W keys, the linear branch beyond, one normalisation; the linear
                  branch's weight per head (`hybrid.Window`)
    sink          the first S real tokens exact for every later query (`hybrid.Sink`)
    decay         a learned decay of the linear state per head or per token (a gate) (`decay.Decay`)
    conv          a short causal convolution of q, k and v (`conv.ShortConv`)
A part the config leaves out is None. Every rule on how the parts combine is the config's (`Attention`), checked
when it is made. The layer asks its parts (`parts()`: their inputs, op arguments, padding rules, fast forms) and runs
each call through its forms (`forms`, as its config says: pure linear attention's `linear.LinearForms`, the window
hybrid's `hybrid.WindowForms`), which take the layer whole; `naive` is its attention matrix the quadratic way, which
the layerwise loss, the gain calibration and the tests read.
"""

from __future__ import annotations

import torch
from torch import nn

from dofattn.attention.cache import LinearStateLayer
from dofattn.attention.conv import ShortConv
from dofattn.attention.decay import Decay
from dofattn.attention.hybrid import Sink, Window, WindowForms
from dofattn.attention.linear import LinearForms
from dofattn.attention.part import Part
from dofattn.errors import UserError
from dofattn.features import FeatureMap
from dofattn.ops.naive import log_pair_factors
from dofattn.ops.softmax import expand_kv
from dofattn.spec import Attention

# The parts a layer may have, each made from the config (`Part.build`) in this order, which is also the order their
# `inputs` apply; each a child module under its own name.
PARTS: tuple[type[Part], ...] = (Window, Sink, Decay, ShortConv)


class LinearAttention(nn.Module):
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
        self.forms = WindowForms if attention.window else LinearForms     # how a call runs, as the config says
        self._held = {}               # name -> (what it was made from, a decode step's constants): `held`

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

    def held(self, name: str, make):
        """`make()`, kept under `name` and made again only when a tensor of the layer changed (`tensor_versions`): a
        decode step's constants (a decode step is launch-bound)."""
        key = self.tensor_versions()
        kept = self._held.get(name)
        if kept is None or kept[0] != key:
            kept = self._held[name] = key, make()
        return kept[1]

    def step_arguments(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts' op arguments for a decode step whose values are v [B, 1, Hkv, D]: made again only when a tensor
        of the layer changed (`held`); made each call with autograd on, while a step is compiled (the compiled graph
        holds them), or where a part reads the values."""
        if (torch.is_grad_enabled() or torch.compiler.is_compiling()
                or any(part.reads_values for part in self.parts())):
            return self.op_arguments(self.expand_kv(v))
        return self.held("step_arguments", lambda: self.op_arguments(None))

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
        if cache is not None and cache.static:
            key_valid = None
        for part in self.parts():
            q, k, v = part.inputs(q, k, v, key_valid, cache)
        if cache is None:
            return self.attend(q, self.expand_kv(k), self.expand_kv(v), key_valid, backend=backend)[0]
        return self.forms.step(self, q, k, v, key_valid, cache, backend)

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
        return self.forms.attend(self, q, k, v, key_valid, state, output_final_state, backend, sink_mask)

    def naive(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *, rows: bool = True,
              gain: bool = True, at: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's attention the quadratic way, composed from every part: [B, H, T, T] float32 log weights of the
        causal pairs (query t, key s) of q, k [B, T, H, D] on query heads (v, on query heads, for a part that reads
        the values), a sequence from position 0 without padding. First each part's `inputs` (a convolution's
        filters), then the forms' pairs (`naive` of `hybrid.WindowForms`: the exact keys as the teacher's kernel,
        the linear pairs as the features'; of `linear.LinearForms`: φq·φk), with the parts' op arguments. `rows`:
        each row normalised, the attention matrix that the layerwise loss holds against the teacher's; else the log
        weights before it (log TINY above the diagonal), whose masses the gain calibration compares. `gain`: with the
        window's learned gain on the linear part. `at` [R]: only the rows of these query positions ([B, H, R, T]: a
        long sequence's sampled rows cost R·T; a gate still builds T × T)."""
        for part in self.parts():
            q, k, v = part.inputs(q, k, v, None)
        return self.forms.naive(self, q, k, v, rows, gain, at)

    def log_pair_factor(self, v: torch.Tensor | None, length: int,
                        at: torch.Tensor | None = None) -> torch.Tensor | None:
        """The parts' op arguments as a log factor on the linear part's pairs (`ops.naive.log_pair_factors`; beside a
        window counted from its edge), [B or 1, H, T or R, T], or None where no part puts one."""
        return log_pair_factors(length, -self.attention.window, at, **self.op_arguments(v))

    def needs_gain_calibration(self) -> bool:
        """Whether the linear part's mass must be put on the exact keys' scale before training (`calibrate_gain`):
        the forms say (beside a window, for a map that does not estimate the kernel itself)."""
        return self.forms.needs_calibration(self)

    def calibrate_gain(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Put the linear part's mass on the exact keys' scale over these queries and keys [B, T, H, D] (k on query
        heads), as the forms do it (`hybrid.WindowForms.calibrate`; pure linear attention: nothing)."""
        self.forms.calibrate(self, q, k)
