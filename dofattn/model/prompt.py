"""Reading a long prompt in chunks, so that a student's memory stays bounded while it reads, not only after.

A student's forward (`PromptReader`, a base of the class dofattn makes a model with: `hf.causal_lm_class`, an
export's class; `install` sets its chunk) splits a call that reads more than `chunk` tokens
into a cache into consecutive calls of `chunk` tokens on that cache: linear layers carry their state, windows their
last keys, sinks their first; a kept softmax layer holds the prompt's keys and, with a bounded cache, chooses what
it keeps when the last chunk is read (`bounded.PromptKVLayer`), as it would after one call. The outputs are those of
one call (tests/test_prompt.py); the read's peak is one chunk's activations beside the kept layers' keys instead of
the whole prompt's activations. It applies wherever a prompt meets a cache: HF `generate` (its prefill), `dofattn
generate`, `dofattn eval --recall` and a user's forward with `use_cache=True`.

A call is read in one piece when it is not a prompt read into a cache (no cache and no `use_cache=True`), when
gradients are on (training), or when it asks for what chunks do not give back whole (`labels`, hidden states or
attentions, a 4D mask, `logits_to_keep` as indices). The chunk size is the model's `prompt_chunk`
(`set_prompt_chunk`; 0 reads every call in one piece); HF's `prefill_chunk_size`, given to `generate`, sets it for
that call.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect

import torch
from torch import nn

from dofattn.attention.cache import CACHE_ARGUMENTS, cache_argument
from dofattn.memory import trim_heap

PROMPT_CHUNK = 512        # tokens a chunk: 0.30 GiB above the model at 8 K, 0.95 at 32 K (docs/RESULTS.md)

_PROGRESS: contextvars.ContextVar = contextvars.ContextVar("dofattn_prompt_progress", default=None)


@contextlib.contextmanager
def reading_progress(report):
    """While active, a prompt read in chunks calls `report(tokens read, tokens in all)` after each chunk (a command's
    progress bar: a long prompt takes minutes on a small CPU)."""
    token = _PROGRESS.set(report)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


class PromptReader:
    """What a student's class gains (`read_in_chunks`): a forward that reads a long prompt in chunks (the module's
    docstring says when) and a `generate` that takes HF's `prefill_chunk_size` as the chunk for its call.
    `prompt_chunk` is the chunk in tokens (0, until the model holds a student: every call in one piece)."""

    prompt_chunk: int = 0

    def read_prompt(self, forward, *args, **kwargs):
        """The call of `forward` (the model class's own), read in chunks where the module's docstring says."""
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if tokens is None or tokens.shape[1] <= self.prompt_chunk:             # a decode step, a short prompt
            return forward(*args, **kwargs)
        call = inspect.signature(forward).bind_partial(*args, **kwargs).arguments
        call.update(call.pop("kwargs", {}))
        pieces = _pieces(self, call)
        if pieces is None:
            return forward(*args, **kwargs)
        return _read(self, forward, call, pieces)

    def generate(self, *args, **kwargs):
        """HF `generate`, with HF's `prefill_chunk_size` (an argument, or in the generation config) read as this
        model's chunk for the call: HF's own chunked prefill would make each chunk a prompt of its own."""
        given = kwargs.get("generation_config")
        config = given or self.generation_config
        chunk = kwargs.pop("prefill_chunk_size", None) or getattr(config, "prefill_chunk_size", None)
        if not chunk:
            return super().generate(*args, **kwargs)
        if given is not None:                     # the caller's config, without the chunk (HF would chunk too)
            kwargs["generation_config"] = copy.deepcopy(given)
            kwargs["generation_config"].prefill_chunk_size = None
        before, held = self.prompt_chunk, getattr(self.generation_config, "prefill_chunk_size", None)
        set_prompt_chunk(self, chunk)
        self.generation_config.prefill_chunk_size = None
        try:
            return super().generate(*args, **kwargs)
        finally:
            set_prompt_chunk(self, before)
            self.generation_config.prefill_chunk_size = held


def set_prompt_chunk(model: PromptReader, chunk: int) -> None:
    """Read `model`'s prompts in chunks of `chunk` tokens (0: in one call)."""
    if not isinstance(model, PromptReader):
        raise ValueError(f"{type(model).__name__} does not read prompts in chunks: a student's model does")
    if chunk < 0:
        raise ValueError(f"a prompt chunk is a number of tokens >= 0, got {chunk}")
    model.prompt_chunk = int(chunk)


def reading_forward(base: type):
    """The forward of a `PromptReader` subclass of `base` (a causal LM's class): `base`'s own, read in chunks, with
    its signature (HF's generate reads it)."""
    def forward(self, *args, **kwargs):
        return self.read_prompt(base.forward.__get__(self), *args, **kwargs)

    return functools.update_wrapper(forward, base.forward)


@functools.cache
def reading_class(cls: type) -> type:
    """`cls` with a `PromptReader` before it, under the same name (what `save_pretrained` records)."""
    return type(cls.__name__, (PromptReader, cls), {"forward": reading_forward(cls), "__module__": cls.__module__})


def read_in_chunks(model: nn.Module) -> None:
    """Make a student read long prompts in chunks of `PROMPT_CHUNK` tokens, unless a chunk was set already: a model
    made of a `PromptReader` class (`hf.causal_lm_class`, an export's class). A model of transformers' own class
    reads each call in one piece (the same outputs; the whole prompt's activations at once)."""
    if isinstance(model, PromptReader) and "prompt_chunk" not in vars(model):
        model.prompt_chunk = PROMPT_CHUNK


def _pieces(model: nn.Module, call: dict) -> list[tuple[int, int]] | None:
    """[(start, end)] of the call's tokens read a chunk at a time, or None: in one piece."""
    chunk = model.prompt_chunk
    tokens = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    cache = cache_argument(call)
    mask = call.get("attention_mask")
    if (not chunk or tokens is None or tokens.shape[1] <= chunk or torch.is_grad_enabled()
            or (cache is None and call.get("use_cache") is not True) or call.get("use_cache") is False
            or call.get("labels") is not None or call.get("output_hidden_states") or call.get("output_attentions")
            or (mask is not None and mask.dim() != 2) or not isinstance(call.get("logits_to_keep", 0), int)):
        return None
    T = tokens.shape[1]
    return [(start, min(start + chunk, T)) for start in range(0, T, chunk)]


def announce(model: nn.Module, cache, length: int) -> None:
    """Tell each kept layer with a bounded cache (and each linear layer's exact heads) that a prompt of `length`
    tokens is coming in chunks: its fresh slot becomes a `bounded.PromptKVLayer` of that length, which holds the keys
    until the last chunk and then chooses. In `evaluate.teacher_mode` (the model's attention its base model's SDPA)
    nothing is announced: every layer's slot stays a plain KV cache."""
    from transformers.cache_utils import DynamicLayer

    from dofattn.attention.cache import state_layer
    from dofattn.model.attach import bounded_of, linear_of
    from dofattn.model.bounded import PromptKVLayer
    from dofattn.model.install import is_base

    if is_base(model):
        return
    layers = getattr(cache, "self_attention_cache", cache).layers
    for module in model.modules():
        if bounded_of(module) is None:
            continue
        if linear_of(module) is not None:          # a linear layer's exact heads: their slot nested in its own
            slot = state_layer(cache, module.layer_idx)
            if slot.exact is None and slot.get_seq_length() == 0:
                slot.exact = PromptKVLayer(length)
            continue
        while len(layers) <= module.layer_idx:
            layers.append(DynamicLayer())
        slot = layers[module.layer_idx]
        if type(slot) is DynamicLayer and slot.get_seq_length() == 0:     # a sequence's first call: its prompt
            layers[module.layer_idx] = PromptKVLayer(length)


def _read(model: nn.Module, forward, call: dict, pieces: list[tuple[int, int]]):
    """The call's outputs, its tokens read piece by piece into one cache (made here if the call brings none)."""
    from transformers import DynamicCache

    from dofattn.attention.cache import cache_kwargs

    name = "input_ids" if call.get("input_ids") is not None else "inputs_embeds"
    tokens, mask, positions = call.pop(name), call.pop("attention_mask", None), call.pop("position_ids", None)
    cache_positions = call.pop("cache_position", None)            # transformers before 5.24 passes them
    cache = cache_argument(call)
    for n in CACHE_ARGUMENTS:
        call.pop(n, None)
    cache = DynamicCache(config=model.config) if cache is None else cache
    T, keep = tokens.shape[1], call.pop("logits_to_keep", 0)          # keep: the last `keep` positions, 0 all
    as_tuple = call.pop("return_dict", None) is False
    past = cache.get_seq_length()
    announce(model, cache, T)
    takes_keep = "logits_to_keep" in inspect.signature(forward).parameters
    logits = []
    for start, end in pieces:
        piece = {**call, name: tokens[:, start:end], **cache_kwargs(model, cache), "use_cache": True,
                 "return_dict": True}
        if mask is not None:
            piece["attention_mask"] = mask[:, :past + end]
        if positions is not None:
            piece["position_ids"] = positions[..., start:end]
        if cache_positions is not None:
            piece["cache_position"] = cache_positions[start:end]
        wanted = end - start if not keep else min(max(keep - (T - end), 0), end - start)
        if takes_keep:
            piece["logits_to_keep"] = max(wanted, 1)       # 0 would be every position
        out = forward(**piece)
        if tokens.device.type == "cpu":
            trim_heap()                    # what the chunk freed goes back: the peak stays near what is alive
        if wanted:
            logits.append(out.logits[:, out.logits.shape[1] - wanted:])
        if (report := _PROGRESS.get()) is not None:
            report(end, T)
    out.logits = torch.cat(logits, 1) if len(logits) > 1 else logits[0]
    return out.to_tuple() if as_tuple else out
