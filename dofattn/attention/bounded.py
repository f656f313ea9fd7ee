"""A kept softmax layer with a bounded cache: after the prompt, its sink, its selected keys and a sliding window.

A layer the student keeps as exact softmax attention (`keep_softmax`) holds every past key in a KV cache, which grows
with the context. With `student.select` > 0 (its `spec.Kept`) its module carries a `BoundedSoftmax`
(`dofattn_bounded`): the prompt is
read with full attention, as the teacher reads it; then the cache keeps the first S real tokens (the sink), the C keys
per kv head that the prompt's last queries attend to most (`ops.select`, SnapKV-style) and the last W keys, and drops
the rest (`BoundedKVLayer`). Every later query (the answer, the generated tokens) reads those, exactly, and a key
leaving its window is gone: memory after the prompt is (S + C + W) keys per kv head at any length.

The prompt is a sequence's first call. A long one is read in chunks (`attention.prompt`: the model's forward
splits it), and while it is read the slot holds every key so far, the key validity and the last queries
(`PromptKVLayer`); when its last chunk is read, the slot chooses, from those, exactly as after one call. So the
read holds the prompt's keys in the kept layers (1.5 KB a token and layer for SmolLM2-135M in float32), not a whole
prompt's activations. A prompt fed in chunks by a caller's own calls is bounded after its first chunk, which is
not the method: give the model the whole prompt.

    linearize(model, dims, Attention(window=64, sink=4), kept=Kept(select=128))   # every kept layer: a BoundedSoftmax
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from dofattn.attention.cache import BatchSlot, in_ring, last_keys
from dofattn.ops.select import prompt_candidates, select_keys
from dofattn.ops.window import first_keys


class PromptKVLayer(DynamicLayer):
    """A kept layer's slot while a prompt is read in chunks: every key and value so far, in buffers made once for the
    whole prompt (`length` tokens: growing them a chunk at a time would leave the allocator a trail of smaller
    freed ones), and what the choice at the prompt's end reads besides: which keys are real (`valid` [B, T]) and
    the last queries ([B, ≤ observe, H, D])."""

    @classmethod
    def from_layer(cls, layer: DynamicLayer, length: int) -> PromptKVLayer:
        prompt = cls()
        prompt.__dict__.update(vars(layer))
        B, Hkv, T, D = layer.keys.shape
        prompt.key_buffer = layer.keys.new_empty(B, Hkv, length, D)
        prompt.value_buffer = layer.values.new_empty(B, Hkv, length, layer.values.shape[-1])
        prompt.key_buffer[:, :, :T], prompt.value_buffer[:, :, :T] = layer.keys, layer.values
        prompt.keys, prompt.values = prompt.key_buffer[:, :, :T], prompt.value_buffer[:, :, :T]
        prompt.valid, prompt.queries = None, None
        return prompt

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        T, new = self.keys.shape[2], key_states.shape[2]
        if T + new > self.key_buffer.shape[2]:
            raise RuntimeError(f"a prompt read in chunks brought more than the {self.key_buffer.shape[2]} tokens "
                               f"it announced")
        self.key_buffer[:, :, T:T + new], self.value_buffer[:, :, T:T + new] = key_states, value_states
        self.keys, self.values = self.key_buffer[:, :, :T + new], self.value_buffer[:, :, :T + new]
        return self.keys, self.values


class BoundedKVLayer(BatchSlot):
    """A kept softmax layer's cache slot after a prompt: `held` keys and values [B, Hkv, S + C, D] (the sink's, then
    each kv head's C selected; slot c of a kv head is that head's own choice, without positions) and which are real
    ([B, S + C]), and the window's last keys [B, Hkv, n, D] with theirs ([B, n]). `update` appends a call's keys to
    the window (after trimming it to the last W of the calls before) and returns [held, window]; `mask` says which of
    them each new query sees. `seen` counts the tokens read; it neither restarts nor drops tokens. It hands SDPA its
    own mask, so HF sizes its causal mask on another layer (`is_sliding`)."""

    is_sliding = True
    is_compileable = False
    is_croppable = False
    NAMES = ("held_keys", "held_values", "held_valid", "keys", "values", "valid")

    def __init__(self, held_keys, held_values, held_valid, keys, values, valid, width: int, seen: int):
        super().__init__()
        self.held_keys, self.held_values, self.held_valid = held_keys, held_values, held_valid
        self.keys, self.values, self.valid = keys, values, valid
        self.width, self.seen, self.new = int(width), int(seen), 0
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def _map(self, fn) -> None:
        for name in self.NAMES:
            setattr(self, name, fn(getattr(self, name)))

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a bounded cache cannot restart; let generate() create a fresh cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a bounded cache cannot drop tokens (no assisted or speculative decoding)")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a BoundedKVLayer is made from a prefilled layer (BoundedSoftmax)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        B, _, T, _ = key_states.shape
        self.keys = torch.cat([last_keys(self.keys, self.width, 2), key_states], 2)
        self.values = torch.cat([last_keys(self.values, self.width, 2), value_states], 2)
        self.valid = torch.cat([last_keys(self.valid, self.width), self.valid.new_ones(B, T)], 1)
        self.seen, self.new = self.seen + T, T
        return torch.cat([self.held_keys, self.keys], 2), torch.cat([self.held_values, self.values], 2)

    def mask(self) -> torch.Tensor:
        """[B, 1, T, S + C + n] bool for the last call's T queries: every real held key; a window key if it is real,
        not after the query and less than W tokens before it."""
        n, T = self.keys.shape[2], self.new
        key_at = torch.arange(self.seen - n, self.seen, device=self.keys.device)              # [n]
        query_at = torch.arange(self.seen - T, self.seen, device=self.keys.device)[:, None]   # [T, 1]
        near = (key_at <= query_at) & (key_at > query_at - self.width)                         # [T, n]
        window = near[None] & self.valid[:, None, :]                                           # [B, T, n]
        held = self.held_valid[:, None, :].expand(-1, T, -1)
        return torch.cat([held, window], -1)[:, None]


class StaticBoundedLayer(CacheLayerMixin):
    """A bounded kept layer's slot for static decoding (`engine.StaticDecoder`), made from its `BoundedKVLayer` after
    the prompt: the held keys (sink and selected, [B, Hkv, S + C, D]) and a ring of W slots after them, the key at
    position p in slot p mod W; `position` is the decoder's [1] tensor. Each step writes its key into its ring slot in
    place and the layer attends over the real held keys and the ring's written slots (`slot_mask`, bound to the module
    as `dofattn_static_kv`): the same shapes every token, and the same keys as the growing `BoundedKVLayer` reads."""

    is_sliding = False
    is_compileable = True
    is_croppable = False

    @classmethod
    def from_layer(cls, layer: BoundedKVLayer, position: torch.Tensor) -> StaticBoundedLayer:
        static = cls()
        width, lead = layer.width, layer.held_keys.shape[2]
        static.keys = torch.cat([layer.held_keys, in_ring(layer.keys, layer.seen, width, 2)], 2)
        static.values = torch.cat([layer.held_values, in_ring(layer.values, layer.seen, width, 2)], 2)
        static.valid = torch.cat([layer.held_valid, in_ring(layer.valid, layer.seen, width)], 1)
        static.position, static.lead, static.width, static.seen = position, lead, width, layer.seen
        static.dtype, static.device, static.is_initialized = layer.keys.dtype, layer.keys.device, True
        return static

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a StaticBoundedLayer is made from a bounded layer (StaticBoundedLayer.from_layer)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        slot = self.lead + self.position.remainder(self.width)                  # [1]
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.valid.index_fill_(1, slot, True)
        return self.keys, self.values

    def slot_mask(self) -> torch.Tensor:
        """[B, 1, 1, S + C + W] bool: the real held keys and the ring's written slots (the current token's included)."""
        return self.valid[:, None, None]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class BoundedSoftmax(nn.Module):
    """A kept softmax layer's bounded cache: the selection of a `spec.Kept` beside the sink and window of the linear
    layers' `spec.Attention`. It has no parameters. `install` binds the HF cache and the layer's index for the
    duration of a call (`cache`, `layer_idx`); `attention.prompt` sets `reading` while a prompt is read in chunks:
    the tokens that follow the chunk being read (0 on the last)."""

    def __init__(self, kept, attention, scaling: float):
        super().__init__()
        self.kept, self.attention, self.scaling = kept, attention, float(scaling)
        self.cache, self.layer_idx, self.reading = None, None, 0

    def extra_repr(self) -> str:
        return self.kept.describe(self.attention)

    def layers(self) -> list:
        """The bound cache's slots (an EncoderDecoderCache: its self-attention cache's)."""
        return getattr(self.cache, "self_attention_cache", self.cache).layers

    def slot(self):
        """The bound cache's slot for this layer (None without a cache)."""
        if self.cache is None:
            return None
        layers = self.layers()
        return layers[self.layer_idx] if self.layer_idx < len(layers) else None

    def mask(self) -> torch.Tensor | None:
        """The slot's own mask once it is bounded (a call after the prompt), else None (HF's mask stands)."""
        slot = self.slot()
        return slot.mask() if isinstance(slot, BoundedKVLayer) else None

    @torch.no_grad()
    def after(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, new_valid: torch.Tensor | None):
        """After a call's attention (query [B, H, T, D]; key and value [B, Hkv, P, D], every key the layer attended:
        the cache's and the call's; new_valid [B, T], which of the call's keys are real, or None: all): while a
        prompt is read (a sequence's first call, and the calls that continue it while `reading`), the slot keeps its
        keys; at the prompt's end it becomes bounded."""
        slot = self.slot()
        B, _, T, _ = query.shape
        if isinstance(slot, PromptKVLayer):
            valid, queries = slot.valid, slot.queries
        elif type(slot) is DynamicLayer and key.shape[2] == T:         # a sequence's first call
            valid, queries = None, None
        else:
            return                        # bounded already, or a cache this layer did not start: nothing to choose
        real = torch.ones(B, T, dtype=torch.bool, device=key.device) if new_valid is None else new_valid
        valid = real if valid is None else torch.cat([valid, real], 1)
        queries = query.transpose(1, 2) if queries is None else torch.cat([queries, query.transpose(1, 2)], 1)
        queries = last_keys(queries, self.kept.select_observe)            # [B, ≤ observe, H, D]
        if self.reading:
            if not isinstance(slot, PromptKVLayer):
                slot = PromptKVLayer.from_layer(slot, key.shape[2] + self.reading)
                self.layers()[self.layer_idx] = slot
            slot.valid, slot.queries = valid, queries
            return
        self.layers()[self.layer_idx] = self.choose(queries, key, value, valid)

    def choose(self, queries: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               valid: torch.Tensor) -> BoundedKVLayer:
        """The bounded slot after a prompt of T tokens: its last queries [B, ≤ observe, H, D], its keys and values
        [B, Hkv, T, D] and which are real ([B, T])."""
        B, _, T, _ = key.shape
        k = key.transpose(1, 2)                                                     # [B, T, Hkv, D]
        width, sink_size, kept = self.attention.window, self.attention.sink, self.kept
        sink = first_keys(valid, B, T, sink_size, key.device) if sink_size else torch.zeros_like(valid)
        candidates = prompt_candidates(valid, sink, width)
        index, chosen = select_keys(queries, k, self.scaling, candidates, kept.select, kept.select_observe,
                                    kept.select_pool, valid)
        order = torch.sort(torch.where(sink, 0, 1), dim=1, stable=True).indices[:, :sink_size]    # sink positions
        at = torch.cat([order[:, None, :].expand(-1, k.shape[2], -1), index], -1)              # [B, Hkv, S + C]
        held_valid = torch.cat([sink.gather(1, order), chosen], 1)
        gather = lambda x: x.gather(2, at[..., None].expand(-1, -1, -1, x.shape[-1]))
        return BoundedKVLayer(gather(key), gather(value), held_valid, last_keys(key, width, 2),
                              last_keys(value, width, 2), last_keys(valid & ~sink, width), width, T)
