"""The linear attention layer, in parts: one `LinearAttention` per linearized layer, and its cache slots.

A linearized layer keeps its HF attention module (projections, RoPE, output projection all untouched) and gains a
child module (`model.attach`) whose attention runs in place of softmax (`model.install`: the "dofattn" attention
implementation). Generation: a linear layer needs no KV cache, only its recurrent state [B, H, M, V+1]: its slot in
the HF `Cache` becomes a `LinearStateLayer`, which stores the state and the token count (plus, for a window hybrid,
the last W keys and values, and with a short convolution its last K-1 inputs), so memory stays flat in context
length. `model.generate()` needs nothing special.

Modules, by part:
    part      `Part`: what a layer asks of each of its parts (inputs, its effect as op arguments, a padding rule,
              the fast forms it says it runs in, its cache state), each with a default that adds nothing
    layer     `LinearAttention`: builds its parts from its `spec.Attention` (`PARTS`), asks them, runs a call
              through its forms, and holds its attention the quadratic way composed from every part (`naive`)
    linear    pure linear attention's forms (`LinearForms`: prefill, cached call, one-kernel step, naive)
    hybrid    the window hybrid: its parts `Window` (the last W keys exact, the linear part's gain) and `Sink` (the
              first S), their cache states, and its forms (`WindowForms`: prefill, cached call, lean decode step,
              static ring step, naive, the gain's calibration)
    decay     `Decay` (per head, or per token: a gate), and a decay's padding rules
    conv      `ShortConv`, on q, k and v
    cache     the cache slots: `LinearStateLayer` with a `PartState` per part that keeps one, `StaticStateLayer`
              its static form (each part's state frozen: a window's as a ring), `StaticKVLayer` for a kept layer

Adding a part. Files it touches: its own module, a key of `spec.Attention`, one row of `layer.PARTS`, its tests;
and `ops/` if it changes the arithmetic (tests/test_new_part.py adds a stateful part to a copy of the package with
those three alone, and a student with it then trains, generates, saves, loads and exports). In order:
1. `spec.py`: a field of `Attention` (the decay's `decay`), whose help is the recipe key's documentation
   (`student.decay`, `dofattn recipes --keys`); its rules against the other parts in `Attention.__post_init__` (a
   gate is for pure linear attention only), each a one-line UserError; a word in `Attention.describe` and a line
   in `StudentSpec.describe` (layer reprs, the export's model card, `generate`).
2. `ops/`, if it changes the arithmetic: the op's argument (`log_decay` of `linear_attention` and
   `window_linear_attention`) in its naive reference first (`ops/naive.py`: `log_decay_matrix`), then each fast
   form, and its rows in tests/test_ops.py and tests/test_triton_*.py against the reference on odd shapes, states
   and gradients included.
3. `attention/<part>.py`: a `Part` subclass that owns its parameters and reads nothing of its layer: `name`,
   `build` (from the config; None when it is off), and what it adds: `op_arguments` (its effect, stated once: the
   decay's `log_decay`, which every form passes to its op, and `naive` and the l2 loss read as a factor on each
   pair: `ops.naive.log_pair_factors`), `inputs` (a convolution's filtered q, k, v: applied before every form and
   in `naive`), `check_padding`, `kernels` (the fast forms that compute it; none by default, so that the general
   call runs instead, or static decoding refuses), `layerwise` (False: the layerwise stage leaves it out of its
   optimizer), `rate` (a key of its own learning rate), and a `State` (a `PartState` subclass)
   if it keeps cache state: the slot then makes, reorders, batches, moves, counts and freezes it (`frozen`). To be
   served by vLLM (`dofattn.serve`) the state must reach a fixed size, and all zeros must mean "nothing seen yet"
   (vLLM hands a new sequence a zeroed block; tests/test_serve.py serves a window, a sink and a convolution so).
4. `layer.PARTS`: its class, in the order its `inputs` apply.
5. tests/test_attention.py: a row of `LAYERS` (alone and beside the parts it combines with) and its term in
   `reference`, which composes the ops' naive forms itself; every path of the layer and `naive` are then checked
   against it: prefill with gradients, a cached prefill continued by steps and a chunk, the static ring.
Nothing else changes: the recipe key, the saved spec (`dofattn.json`), export, the dry run's plan, the layerwise
and end-to-end stages and every command take the config whole. A recipe that uses it sets the key in its TOML. (A
part with its own learning rate, as the convolution's `end_to_end.conv_lr`, adds that key to `recipe.py` and
names it in `rate`.)
"""

from dofattn.attention.cache import (CACHE_ARGUMENTS, LinearStateLayer, StaticKVLayer, StaticStateLayer, keep_buffer,
                                     state_layer)
from dofattn.attention.conv import CONV_NAMES
from dofattn.attention.decay import DECAY_START, GATE_FLOOR, check_decay_padding, check_left_padding
from dofattn.attention.layer import PARTS, LinearAttention
from dofattn.attention.part import Part

__all__ = ["LinearAttention", "Part", "PARTS", "LinearStateLayer", "StaticStateLayer", "StaticKVLayer", "state_layer",
           "keep_buffer", "CACHE_ARGUMENTS",
           "CONV_NAMES", "DECAY_START", "GATE_FLOOR", "check_decay_padding",
           "check_left_padding"]
