"""Capture of what each attention layer really computes with: queries and keys after RoPE, and values.

dofattn plugs into transformers through its `AttentionInterface`: while a capture is active, the model's
attention implementation is a thin wrapper that hands the layer's inputs to a callback and then runs the
implementation the model had (sdpa, eager, ...), with the same mask function. Nothing in the modeling files is
forked or patched, and the model's outputs are unchanged.

    def sink(inputs: AttentionInputs) -> None:
        keep(inputs.query[:, 1:, 0])                     # [B, T-1, D], head 0, position 0 skipped

    with capture(model, sink, layers=[0, 1]):            # stops the forward after layer 1
        run_forward(model, input_ids)

Layouts are frozen for the whole package: `[B, T, H, D]` for queries, `[B, T, Hkv, D]` for keys and values.
Grouped-query attention: query head h reads kv head `h // (H // Hkv)` (`AttentionInputs.kv_head`).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


@dataclass
class AttentionInputs:
    """One attention call's inputs. Tensors are views of the model's own activations: copy what you keep."""

    layer: int
    query: torch.Tensor  # [B, T, H, D]   after RoPE
    key: torch.Tensor    # [B, T, Hkv, D] after RoPE
    value: torch.Tensor  # [B, T, Hkv, D]
    scaling: float       # softmax(scaling · q·k): 1/√D, or GPT-2's 1/(√D·(layer+1)) where configured

    @property
    def num_heads(self) -> int:
        return self.query.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[2]

    def kv_head(self, head: int) -> int:
        """The kv head that query head `head` attends with (grouped-query attention)."""
        return head // (self.num_heads // self.num_kv_heads)


class _StopForward(Exception):
    """Raised after the last requested layer so that the rest of the model is not computed."""


def base_attention(name: str, module: torch.nn.Module) -> Callable:
    """The attention function of HF implementation `name` for `module`."""
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    # "eager" is not registered: each modeling file has its own eager_attention_forward.
    return sys.modules[type(module).__module__].eager_attention_forward


@contextlib.contextmanager
def capture(model: PreTrainedModel, sink: Callable[[AttentionInputs], None],
            layers: Iterable[int] | None = None) -> Iterator[None]:
    """While active, every forward of `model` calls `sink` once per attention layer in `layers` (all if None).

    After the last requested layer the forward is cut short; use `run_forward` to call the model.
    """
    wanted = None if layers is None else set(layers)
    last = None if wanted is None else max(wanted)
    base = model.config._attn_implementation
    name = f"dofattn_capture_{uuid.uuid4().hex[:8]}"

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if wanted is None or layer in wanted:
            sink(AttentionInputs(layer, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                 float(kwargs["scaling"])))
            if layer == last:
                raise _StopForward
        return base_attention(base, module)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(base)
        del AttentionInterface._global_mapping[name]
        del AttentionMaskInterface._global_mapping[name]


@torch.no_grad()
def run_forward(model: PreTrainedModel, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, logits: bool = False) -> torch.Tensor | None:
    """Forward `input_ids` [B, T] for what a capture sees; returns the last position's logits only, where the model
    takes `logits_to_keep` (`logits`: every position's [B, T, vocab], which a capture does not need: on Gemma 3's
    vocabulary 0.5 GB a block of 1,024 tokens in bfloat16, and as much LM-head work as its 18 layers), or None
    when a capture cut the forward short."""
    keep = {} if logits or "logits_to_keep" not in inspect.signature(model.forward).parameters else {
        "logits_to_keep": 1}
    try:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **keep).logits
    except _StopForward:
        return None
