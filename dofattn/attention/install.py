"""Plugging `LinearAttention` into Hugging Face models: the "dofattn" attention implementation and cache binding.

The model's attention implementation is set to "dofattn", an `AttentionInterface` function that runs a module's
`LinearAttention` (its child `dofattn`) where it has one and SDPA otherwise. A forward pre-hook on each linearized
module finds the HF `Cache` it is called with and binds the layer's `LinearStateLayer` slot (`cache.state_layer`)
for the duration of the call.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dofattn.attention.cache import state_layer
from dofattn.attention.layer import LinearAttention
from dofattn.errors import UserError

IMPLEMENTATION = "dofattn"

# What an HF attention module's forward calls its cache: `cache` from transformers 5.24 on, `past_key_values` before,
# `layer_past` in older GPT-NeoX code.
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def _bind_cache(module: nn.Module, args, kwargs) -> None:
    linear = getattr(module, "dofattn", None)       # None: the linear part taken off, softmax again
    config = getattr(module, "config", None)        # in `teacher_mode` (SDPA) the slot stays a KV cache
    if linear is not None and getattr(config, "_attn_implementation", IMPLEMENTATION) == IMPLEMENTATION:
        cache = next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
        linear.cache_layer = None if cache is None else state_layer(cache, module.layer_idx)


def _unbind_cache(module: nn.Module, args, kwargs, output) -> None:
    linear = getattr(module, "dofattn", None)
    if linear is not None:
        linear.cache_layer = None


def _key_padding(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """[B, T] True where a key is a real token, from the 4D mask the mask interface built (None: no padding)."""
    if attention_mask is None:
        return None
    last_row = attention_mask[:, 0, -1, -length:]          # the last query sees every real key before it
    return last_row if last_row.dtype == torch.bool else last_row == 0


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: q [B, H, T, D], k/v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    linear = getattr(module, "dofattn", None)
    if linear is None:
        static = getattr(module, "dofattn_static_kv", None)
        if static is not None:    # a kept softmax layer in static decoding: the slots written so far
            attention_mask = static.slot_mask()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if key.shape[2] != query.shape[2]:
        raise UserError(f"layer {module.layer_idx} is linear attention but received {key.shape[2]} keys for "
                        f"{query.shape[2]} queries: a KV cache of past tokens; use the default DynamicCache")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    key_valid = _key_padding(attention_mask, k.shape[1])
    return linear(q, k, v, key_valid, cache=linear.cache_layer), None


def install(model: nn.Module) -> None:
    """Route `model`'s attention through dofattn and hook the linearized modules' cache handling."""
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
    for module in model.modules():
        if isinstance(getattr(module, "dofattn", None), LinearAttention) and not getattr(module, "_dofattn_hooked",
                                                                                          False):
            module.register_forward_pre_hook(_bind_cache, with_kwargs=True)
            module.register_forward_hook(_unbind_cache, with_kwargs=True)
            module._dofattn_hooked = True
