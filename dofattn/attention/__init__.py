"""The drop-in linear attention: a layer of parts per linearized layer, plugged into Hugging Face attention modules.

A linearized layer keeps its HF attention module (projections, RoPE, output projection all untouched) and gains a
child module `dofattn` (a `LinearAttention`). The model's attention implementation is set to "dofattn", an
`AttentionInterface` function that runs `LinearAttention` for modules that have one and SDPA for the others.

Generation: a linear layer needs no KV cache, only its recurrent state [B, H, M, V+1]. A forward pre-hook on each
linearized module finds the HF `Cache` it is called with (`cache`; `past_key_values` or `layer_past` before
transformers 5.24) and puts a `LinearStateLayer` in that layer's slot: it stores only the state and the token count
(plus, for a window hybrid, the last W keys and values, and with a short convolution its last K-1 inputs), so memory
stays flat in context length. `model.generate()` needs nothing special.

Modules, by part:
    layer     `LinearAttention`: composes the parts its `spec.Attention` names, dispatches a call to their forms,
              and holds its attention the quadratic way (`naive`), the reference of every fast form
    linear    pure linear attention's forms (prefill, cached call) and a decay's padding rules
    hybrid    the window hybrid's forms: prefill, cached call, lean decode step, static ring step
    exact     the exact keys' parts: `Window` (the last W, and the linear part's gain) and `Sink` (the first S)
    decay     `Decay` (per head) and `Gate` (per token)
    conv      `ShortConv`, on q, k and v
    cache     the cache slots: `LinearStateLayer` with a `PartState` per part that keeps one, for static decoding
              `StaticStateLayer` and `RingWindowLayer` (and `StaticKVLayer` for a kept softmax layer)
    bounded   a kept softmax layer's cache bounded after the prompt (`spec.Kept`): `BoundedSoftmax`
    install   the AttentionInterface function, `install`, the cache-binding hooks

Adding a mechanism, the per-head decay as the worked example (`student.decay = "head"`). In order:
1. `spec.py`: a field of `Attention` (`decay`), whose help is the recipe key's documentation (`student.decay`,
   `dofattn recipes --keys`); its rules against the other parts in `Attention.__post_init__` (a gate is for pure
   linear attention only), each a one-line UserError; a word in `Attention.describe` and a line in
   `StudentSpec.describe` (layer reprs, the export's model card, `generate`).
2. `ops/`, if it changes the arithmetic: the op's argument (`log_decay` of `linear_attention` and
   `window_linear_attention`) in its naive reference first (`ops/naive.py`: `log_decay_matrix`), then each fast
   form (chunked, recurrent, Triton), and its rows in tests/test_ops.py and tests/test_triton_*.py against the
   reference on odd shapes, states and gradients included.
3. `attention/<part>.py`: the part as a module that owns its parameters (`decay.Decay`: `decay_rate` [H], with
   `log_decay()` and `op_arguments()`), reading nothing of its layer.
4. `attention/layer.py`: built in `LinearAttention.__init__` from the config (None when it is off), and in `naive`
   (the decay's factor on each pair, `log_pair_decay`), the layer's attention matrix of the q and k it is given:
   the layerwise softmax loss and the gain calibration read it there; the l2 loss reads its kernel estimate and
   `log_pair_decay`. A part that acts on q, k and v before the attention (the short convolution) is not in
   `naive`: the layerwise stage fits a layer on the teacher's q/k/v, and the part trains end to end.
5. The forms that pass it to the op: `linear.py` (`linear_attend`: `self.decay.op_arguments`) and `hybrid.py`
   (`window_attend`, `fold`: `self.log_decay()`, and the ring kernel's `decay_rate`), with any rule of its own on
   the inputs (padding only on the left, `check_decay_padding`).
6. `attention/cache.py`, only for a part that keeps cache state (the window's last keys, the sink's, a
   convolution's last inputs; the decay keeps none): a `PartState` subclass in `PART_STATES`. The slot reorders,
   batches, moves, counts and freezes it for static decoding whatever the part (`PartState.frozen`).
7. tests/test_attention.py: a row of `LAYERS` (alone and beside the parts it combines with: "decay",
   "window+decay", "window+sink+decay") and its term in `reference`, which composes the ops' naive forms itself;
   every path of the layer is then checked against it: prefill with gradients, a cached prefill continued by steps
   and a chunk, the static ring (a slot's static form: its `to_static`).
Nothing else changes: the recipe key, the saved spec (`dofattn.json`), export, the dry run's plan, the layerwise
and end-to-end stages and every command take the config whole. A recipe that uses it sets the key in its TOML.
"""

from dofattn.attention.cache import (CACHE_ARGUMENTS, LinearStateLayer, StaticKVLayer, StaticStateLayer, keep_buffer,
                                     state_layer)
from dofattn.attention.conv import CONV_NAMES
from dofattn.attention.decay import DECAY_START, GATE_FLOOR, check_decay_padding, check_left_padding
from dofattn.attention.install import IMPLEMENTATION, IMPLEMENTATIONS, attention_forward, install
from dofattn.attention.layer import PARTS, LinearAttention
from dofattn.attention.part import Part

__all__ = ["LinearAttention", "Part", "PARTS", "LinearStateLayer", "StaticStateLayer", "StaticKVLayer", "state_layer",
           "keep_buffer", "install", "attention_forward", "IMPLEMENTATION", "IMPLEMENTATIONS", "CACHE_ARGUMENTS",
           "CONV_NAMES", "DECAY_START", "GATE_FLOOR", "check_decay_padding",
           "check_left_padding"]
