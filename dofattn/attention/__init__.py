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
    layer     `LinearAttention`: composes the parts its `spec.Attention` names and dispatches a call to their forms
    linear    the linear branch's forms (prefill, cached call) and a decay's padding rules
    exact     the exact keys: `Window` (the last W, mixed with the linear branch) and `Sink` (the first S)
    decay     `Decay` (per head) and `Gate` (per token)
    conv      `ShortConv`, on q, k and v
    delta     `DeltaRule`
    cache     the cache slots: `LinearStateLayer`, for static decoding `StaticStateLayer` and `RingWindowLayer`
              (and `StaticKVLayer` for a kept softmax layer), `state_layer`
    install   the AttentionInterface function, `install`, the cache-binding hooks
"""

from dofattn.attention.cache import (LinearStateLayer, RingWindowLayer, StaticKVLayer, StaticStateLayer, keep_buffer,
                                     state_layer)
from dofattn.attention.conv import CONV_NAMES
from dofattn.attention.decay import DECAY_START, GATE_FLOOR
from dofattn.attention.delta import DELTA_NAMES, DELTA_START
from dofattn.attention.install import CACHE_ARGUMENTS, IMPLEMENTATION, IMPLEMENTATIONS, attention_forward, install
from dofattn.attention.layer import LinearAttention
from dofattn.attention.linear import check_decay_padding, check_left_padding

__all__ = ["LinearAttention", "LinearStateLayer", "StaticStateLayer", "RingWindowLayer", "StaticKVLayer", "state_layer",
           "keep_buffer", "install", "attention_forward", "IMPLEMENTATION", "IMPLEMENTATIONS", "CACHE_ARGUMENTS",
           "CONV_NAMES", "DELTA_NAMES", "DECAY_START", "DELTA_START", "GATE_FLOOR", "check_decay_padding",
           "check_left_padding"]
