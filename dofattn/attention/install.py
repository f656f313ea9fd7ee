"""Plugging `LinearAttention` into Hugging Face models: the "dofattn" attention implementation and cache binding.

The model's attention implementation is set to "dofattn", an `AttentionInterface` function that runs a module's
`LinearAttention` (its child `dofattn`) where it has one and SDPA otherwise; or, for a family whose softmax logits
are soft-capped (Gemma 2), to "dofattn_eager", the same with the family's eager attention and its additive masks.
A forward pre-hook on each linearized module finds the HF `Cache` it is called with and binds the layer's
`LinearStateLayer` slot (`cache.state_layer`) for the duration of the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from dofattn.attention.cache import cache_argument, state_layer
from dofattn.attention.layer import LinearAttention
from dofattn.attention.prompt import read_in_chunks
from dofattn.capture import base_attention
from dofattn.errors import UserError
from dofattn.hf import softmax_implementation

IMPLEMENTATION = "dofattn"               # softmax layers on SDPA
EAGER_IMPLEMENTATION = "dofattn_eager"   # softmax layers on the family's eager attention
IMPLEMENTATIONS = (IMPLEMENTATION, EAGER_IMPLEMENTATION)


def _bind_cache(module: nn.Module, args, kwargs) -> None:
    linear = getattr(module, "dofattn", None)       # None: the linear part taken off, softmax again
    bounded = _bounded(module)
    config = getattr(module, "config", None)        # in `teacher_mode` (SDPA) the slot stays a KV cache
    if getattr(config, "_attn_implementation", IMPLEMENTATION) not in IMPLEMENTATIONS:
        return
    cache = cache_argument(kwargs)
    if linear is not None:
        linear.cache_layer = None if cache is None else state_layer(cache, module.layer_idx)
    elif bounded is not None:
        bounded.cache, bounded.layer_idx = cache, module.layer_idx


def _bounded(module: nn.Module):
    """A kept layer's `BoundedSoftmax`, or None."""
    return getattr(module, "dofattn_bounded", None)


def _unbind_cache(module: nn.Module, args, kwargs, output) -> None:
    linear = getattr(module, "dofattn", None)
    if linear is not None:
        linear.cache_layer = None
    bounded = getattr(module, "dofattn_bounded", None)
    if bounded is not None:
        bounded.cache = None


def _key_padding(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """[B, T] True where a key is a real token, from the 4D mask the mask interface built (None: no padding): the
    diagonal of its last T columns, since each real token sees itself (under a sliding-window mask too) and padding
    is seen by none."""
    if attention_mask is None:
        return None
    own = attention_mask[:, 0, -length:, -length:].diagonal(dim1=-2, dim2=-1)     # [B, T]
    return own if own.dtype == torch.bool else own == 0


QUERY_BLOCK = 256


def _sdpa_in_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scaling: float) -> tuple[torch.Tensor, None]:
    """SDPA for a prompt's chunk against every key so far (query [B, H, T, D], key and value [B, Hkv, P, D], mask
    bool [B, 1 or H, T, P]) -> ([B, T, H, D], None), as HF's SDPA function gives it: the kv heads shared inside the
    kernel rather than repeated (HF repeats them when there is a mask: 3 copies of 32 K keys for SmolLM2), and the
    queries in blocks of `QUERY_BLOCK`, so that the mask the kernel widens to floats is one block's."""
    blocks = [F.scaled_dot_product_attention(query[:, :, s:s + QUERY_BLOCK], key, value,
                                             attn_mask=mask[:, :, s:s + QUERY_BLOCK], scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
              for s in range(0, query.shape[2], QUERY_BLOCK)]
    return torch.cat(blocks, 2).transpose(1, 2).contiguous(), None


def _softmax(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, eager: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A softmax layer's attention: SDPA, or the family's eager attention. In static decoding a kept layer attends
    over the slots written so far (its `dofattn_static_kv`), in place of HF's mask; a kept layer with a bounded cache
    (`dofattn_bounded`) over what its cache keeps after the prompt, and it bounds the cache after the prompt."""
    static = getattr(module, "dofattn_static_kv", None)
    bounded = _bounded(module)
    own = static.slot_mask() if static is not None else bounded.mask() if bounded is not None else None
    bounded_own = own is not None and static is None

    def attend(query, key, value, mask):      # the family's softmax; mask: bool [B, H|1, T, P], or HF's own
        if eager and mask is not None and mask.dtype == torch.bool:   # eager attention adds its mask to the logits
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min)
        if eager:
            return base_attention("eager", module)(module, query, key, value, mask, **kwargs)
        if (mask is not None and mask.dtype == torch.bool and not module.training
                and (1 < query.shape[2] < key.shape[2] or (bounded_own and not query.is_cuda))):
            # a prompt's chunk after its first, or a bounded layer's call after the prompt on a CPU
            return _sdpa_in_blocks(query, key, value, mask, kwargs.get("scaling", module.scaling))
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    new_valid = _key_padding(attention_mask, query.shape[2]) if bounded is not None and own is None else None
    out = attend(query, key, value, own if own is not None else attention_mask)
    if bounded is not None and bounded.cache is not None:    # after a prompt, the cache keeps what it bounds
        bounded.after(query, key, value, new_valid)
    return out


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, eager: bool = False,
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AttentionInterface function: q [B, H, T, D], k/v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    linear = getattr(module, "dofattn", None)
    if linear is None:
        return _softmax(module, query, key, value, attention_mask, eager, **kwargs)
    if key.shape[2] != query.shape[2]:
        raise UserError(f"layer {module.layer_idx} is linear attention but received {key.shape[2]} keys for "
                        f"{query.shape[2]} queries: a KV cache of past tokens; use the default DynamicCache")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    key_valid = _key_padding(attention_mask, k.shape[1])
    return linear(q, k, v, key_valid, cache=linear.cache_layer), None


def eager_attention_forward(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    return attention_forward(*args, eager=True, **kwargs)


def install(model: nn.Module) -> None:
    """Route `model`'s attention through dofattn, hook the linearized modules' cache handling, and read long prompts
    in chunks (`prompt.read_in_chunks`)."""
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    AttentionInterface.register(EAGER_IMPLEMENTATION, eager_attention_forward)
    AttentionMaskInterface.register(EAGER_IMPLEMENTATION, eager_mask)
    read_in_chunks(model)
    eager = softmax_implementation(model.config) == "eager"
    model.set_attn_implementation(EAGER_IMPLEMENTATION if eager else IMPLEMENTATION)
    for module in model.modules():
        hooks = (isinstance(getattr(module, "dofattn", None), LinearAttention)
                 or getattr(module, "dofattn_bounded", None) is not None)
        if hooks and _bind_cache not in module._forward_pre_hooks.values():      # once, however often installed
            module.register_forward_pre_hook(_bind_cache, with_kwargs=True)
            module.register_forward_hook(_unbind_cache, with_kwargs=True)
