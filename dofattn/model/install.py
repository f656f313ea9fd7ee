"""Plugging `LinearAttention` into Hugging Face models: the "dofattn" attention implementation and cache binding.

The model's attention implementation is set to "dofattn", an `AttentionInterface` function that runs a module's
`LinearAttention` (its child `dofattn`) where it has one and SDPA otherwise; or, for a family whose softmax logits
are soft-capped (Gemma 2), to "dofattn_eager", the same with the family's eager attention and its additive masks.
A forward pre-hook on each attention module hands the HF `Cache` it is called with on to the attention function
(`dofattn_cache`), which reads the layer's slot there: a linear layer's `LinearStateLayer` (`cache.state_layer`),
a kept layer's KV cache, static or bounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from dofattn.model.attach import bounded_of, linear_of
from dofattn.attention.cache import cache_argument, state_layer
from dofattn.model.prompt import read_in_chunks
from dofattn.model.capture import base_attention
from dofattn.errors import UserError
from dofattn.model.hf import attention_modules, softmax_implementation

IMPLEMENTATION = "dofattn"               # softmax layers on SDPA
EAGER_IMPLEMENTATION = "dofattn_eager"   # softmax layers on the family's eager attention
IMPLEMENTATIONS = (IMPLEMENTATION, EAGER_IMPLEMENTATION)


def is_base(model: nn.Module) -> bool:
    """Whether `model` runs no attention of dofattn's: a base model, its own teacher, or a student in
    `evaluate.teacher_mode`."""
    return model.config._attn_implementation not in IMPLEMENTATIONS


CACHE_KWARG = "dofattn_cache"   # the call's HF cache, as the pre-hook hands it to the attention function


def _hand_cache(module: nn.Module, args, kwargs):
    """Forward pre-hook of a student's attention modules: the HF `Cache` the call brings (under any of its names)
    goes on to the attention function as `dofattn_cache` (the family's attention passes its keyword arguments on);
    a linear layer's slot becomes its `LinearStateLayer` first (`cache.state_layer`), before HF updates it. In
    `teacher_mode` (SDPA) nothing changes: the slot stays a KV cache."""
    config = getattr(module, "config", None)
    cache = cache_argument(kwargs)
    if cache is None or getattr(config, "_attn_implementation", IMPLEMENTATION) not in IMPLEMENTATIONS:
        return None
    if linear_of(module) is not None:                  # None: the linear part taken off, softmax again
        state_layer(cache, module.layer_idx)
    return args, {**kwargs, CACHE_KWARG: cache}


def _slot(module: nn.Module, cache):
    """The call's cache slot of this module's layer (an encoder-decoder cache: its self-attention cache's), or None."""
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", [])
    return layers[module.layer_idx] if module.layer_idx < len(layers) else None


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


def _attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            mask: torch.Tensor | None, eager: bool, bounded_own: bool, **kwargs) -> tuple[torch.Tensor, None]:
    """The family's softmax: SDPA, or its eager attention (mask bool [B, H|1, T, P], or HF's own). `bounded_own`: the
    mask is a bounded slot's own, after the prompt."""
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


def _softmax(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, eager: bool, cache=None,
             **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A softmax layer's attention: SDPA, or the family's eager attention. A static slot (`engine.StaticDecoder`)
    masks its own unwritten slots (`slot_mask`), in place of HF's mask; a kept layer with a bounded cache
    (`dofattn_bounded`) reads what its cache keeps after the prompt, and bounds the cache after the prompt."""
    slot = None if cache is None else _slot(module, cache)
    static = getattr(slot, "slot_mask", None)          # HF's own slots have none
    bounded = bounded_of(module)
    own = static() if static is not None else bounded.mask(slot) if bounded is not None else None
    new_valid = _key_padding(attention_mask, query.shape[2]) if bounded is not None and own is None else None
    out = _attend(module, query, key, value, own if own is not None else attention_mask, eager,
                  own is not None and static is None, **kwargs)
    if bounded is not None and cache is not None:    # after a prompt, the cache keeps what it bounds
        bounded.after(cache, module.layer_idx, query, key, value, new_valid)
    return out


def _exact_heads(module: nn.Module, bounded, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, eager: bool, slot, **kwargs) -> torch.Tensor:
    """A linear layer's exact heads (query [B, He, T, D], key and value [B, Hkv_e, T, D], this call's): without a
    cache, softmax under HF's mask; with one, their own slot nested in the layer's (`slot.exact`): while the prompt
    is read a `PromptKVLayer` that holds its keys (made here on a sequence's first call, or announced by the prompt
    reader), under a causal mask of their own over the real keys (each query sees itself, so no row is empty); after
    it the bounded slot the prompt chose (`BoundedSoftmax.observed`), or its static form. -> [B, T, He, D]."""
    from dofattn.model.bounded import PromptKVLayer

    if slot is None:
        return _attend(module, query, key, value, attention_mask, eager, False, **kwargs)[0]
    B, T = query.shape[0], query.shape[2]
    inner = slot.exact
    if inner is not None and not isinstance(inner, PromptKVLayer):        # after the prompt: its bounded slot
        keys, values = inner.update(key, value)
        own = inner.slot_mask() if slot.static else inner.mask()
        return _attend(module, query, keys, values, own, eager, not slot.static, **kwargs)[0]
    if inner is None:                                                      # a sequence's first call: its prompt
        inner = slot.exact = PromptKVLayer(T)
    past = inner.keys.shape[2] if inner.is_initialized else 0
    keys, values = inner.update(key, value)
    new_valid = _key_padding(attention_mask, T)
    new_valid = torch.ones(B, T, dtype=torch.bool, device=key.device) if new_valid is None else new_valid
    valid = new_valid if inner.valid is None else torch.cat([inner.valid, new_valid], 1)        # [B, P]
    key_at = torch.arange(past + T, device=key.device)
    query_at = torch.arange(past, past + T, device=key.device)[:, None]                        # [T, 1]
    mask = ((key_at <= query_at) & valid[:, None, :]) | (key_at == query_at)                     # [B, T, P]
    out = _attend(module, query, keys, values, mask[:, None], eager, False, **kwargs)[0]
    chosen = bounded.observed(inner, query, new_valid)
    if chosen is not None:
        slot.exact = chosen
    return out


def _mixed(module: nn.Module, linear, bounded, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, eager: bool, cache, **kwargs) -> tuple[torch.Tensor, None]:
    """A linear layer that keeps some key/value heads exact (`bounded.heads`, a `HeadSplit`): those heads and their
    query heads as softmax attention (`_exact_heads`), the rest as the layer's `LinearAttention`; each head's output
    is its own, so the layer's is theirs side by side."""
    (qe, ke, ve), (ql, kl, vl) = bounded.heads.split(query, key, value, dim=1)
    slot = None if cache is None else _slot(module, cache)
    key_valid = _key_padding(attention_mask, key.shape[2])
    linear_out = linear(ql.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2), key_valid, cache=slot)
    exact_out = _exact_heads(module, bounded, qe, ke, ve, attention_mask, eager, slot, **kwargs)
    return bounded.heads.merge(exact_out, linear_out, dim=2), None


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, eager: bool = False,
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AttentionInterface function: q [B, H, T, D], k/v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    linear, cache = linear_of(module), kwargs.pop(CACHE_KWARG, None)
    if linear is None:
        return _softmax(module, query, key, value, attention_mask, eager, cache, **kwargs)
    if key.shape[2] != query.shape[2]:
        raise UserError(f"layer {module.layer_idx} is linear attention but received {key.shape[2]} keys for "
                        f"{query.shape[2]} queries: a KV cache of past tokens; use the default DynamicCache")
    bounded = bounded_of(module)
    if bounded is not None:                  # exact heads beside the linear ones
        return _mixed(module, linear, bounded, query, key, value, attention_mask, eager, cache, **kwargs)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    key_valid = _key_padding(attention_mask, k.shape[1])
    return linear(q, k, v, key_valid, cache=None if cache is None else _slot(module, cache)), None


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
    for module in attention_modules(model):
        if _hand_cache not in module._forward_pre_hooks.values():      # once, however often installed
            module.register_forward_pre_hook(_hand_cache, with_kwargs=True)
