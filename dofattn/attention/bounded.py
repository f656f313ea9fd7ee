"""A kept softmax layer with a bounded cache: after the prompt, its sink, its selected keys and a sliding window.

A layer the student keeps as exact softmax attention (`keep_softmax`) holds every past key in a KV cache, which grows
with the context. With `student.select` > 0 its module carries a `BoundedSoftmax` (`dofattn_bounded`): the prompt is
read with full attention, as the teacher reads it; then the cache keeps the first S real tokens (the sink), the C keys
per kv head that the prompt's last queries attend to most (`ops.select`, SnapKV-style) and the last W keys, and drops
the rest (`BoundedKVLayer`). Every later query (the answer, the generated tokens) reads those, exactly, and a key
leaving its window is gone: memory after the prompt is (S + C + W) keys per kv head at any length.

The prompt is the first call of a sequence: read a prompt in one call (as `generate` and `dofattn eval --recall`
do). A prompt fed in chunks (HF's `prefill_chunk_size`) is bounded after its first chunk, which is not the method.
The prefill itself holds the whole prompt's keys, as the teacher's does: its peak grows with the prompt.

With `student.select_by = stream` the layer never reads beyond its bound, the prompt included: a trained
`KeyScorer` scores each key as it arrives, and every query sees the sink, its window and the C best-scored keys that
have left the window (`ops.stream`), without a cache (perplexity of a long text) as with one (`StreamKVLayer`, in
one call or chunks). The question need not be known: the cache is bounded while a long text is read.

    attention = Attention(window=64, sink=4, select=128)   # linearize(...) gives every kept layer its BoundedSoftmax
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from dofattn.attention.cache import BatchSlot
from dofattn.attention.scorer import KeyScorer
from dofattn.errors import UserError
from dofattn.ops.select import prompt_candidates, select_keys
from dofattn.ops.stream import KEY, PAD, SINK, keep_after, stream_visible
from dofattn.ops.window import first_keys

QUERY_BLOCK = 1024      # a streaming layer's queries attend in blocks of this many (its mask is per kv head)


class BoundedSlot(BatchSlot):
    """A kept layer's bounded cache slot after its first call (`BoundedKVLayer`, `StreamKVLayer`): its tensors are
    `NAMES`, `seen` counts the tokens read; it neither restarts nor drops tokens. It hands SDPA its own mask, so HF
    sizes its causal mask on another layer (`is_sliding`)."""

    is_sliding = True
    is_compileable = False
    is_croppable = False
    NAMES: tuple[str, ...] = ()

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


class BoundedKVLayer(BoundedSlot):
    """A kept softmax layer's cache slot after a prompt: `held` keys and values [B, Hkv, S + C, D] (the sink's, then
    each kv head's C selected; slot c of a kv head is that head's own choice, without positions) and which are real
    ([B, S + C]), and the window's last keys [B, Hkv, n, D] with theirs ([B, n]). `update` appends a call's keys to
    the window (after trimming it to the last W of the calls before) and returns [held, window]; `mask` says which of
    them each new query sees."""

    NAMES = ("held_keys", "held_values", "held_valid", "keys", "values", "valid")

    def __init__(self, held_keys, held_values, held_valid, keys, values, valid, width: int, seen: int):
        super().__init__()
        self.held_keys, self.held_values, self.held_valid = held_keys, held_values, held_valid
        self.keys, self.values, self.valid = keys, values, valid
        self.width, self.seen, self.new = int(width), int(seen), 0
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a BoundedKVLayer is made from a prefilled layer (BoundedSoftmax)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keep = slice(max(self.keys.shape[2] - self.width, 0), None)
        B, _, T, _ = key_states.shape
        self.keys = torch.cat([self.keys[:, :, keep], key_states], 2)
        self.values = torch.cat([self.values[:, :, keep], value_states], 2)
        self.valid = torch.cat([self.valid[:, keep], self.valid.new_ones(B, T)], 1)
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
        B, Hkv, n, D = layer.keys.shape
        width, lead = layer.width, layer.held_keys.shape[2]
        slots = torch.arange(layer.seen - n, layer.seen, device=layer.keys.device).remainder(width)
        ring = lambda x: x.new_zeros(*x.shape[:2], width, x.shape[-1]).index_copy_(2, slots, x)
        static.keys = torch.cat([layer.held_keys, ring(layer.keys)], 2)
        static.values = torch.cat([layer.held_values, ring(layer.values)], 2)
        static.valid = torch.cat([layer.held_valid, layer.valid.new_zeros(B, width).index_copy_(1, slots, layer.valid)],
                                 1)
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


class StreamKVLayer(BoundedSlot):
    """A streaming kept layer's cache slot (`student.select_by = stream`): `held`, the sink and the chosen keys that
    have left the window ([B, Hkv, S + C, D], with their positions, scores and kinds [B, Hkv, S + C]), and the
    window, the last keys in order ([B, Hkv, n, D]; positions seen - n .. seen - 1, scores [B, Hkv, n], kinds
    [B, n]); `sunk` [B]: the sink tokens each row has had. `update` appends a call's keys to the window and returns
    [held, window]; `BoundedSoftmax.stream` scores them (`admit`), attends, then `settle` keeps the bound."""

    NAMES = ("held_keys", "held_values", "held_pos", "held_score", "held_kind", "keys", "values", "score", "kind",
             "sunk")

    def __init__(self, keys, values, score, kind, sunk, seen: int):
        super().__init__()
        B, Hkv, _, D = keys.shape
        empty = lambda *shape, dtype: keys.new_zeros(*shape, dtype=dtype)
        self.held_keys, self.held_values = empty(B, Hkv, 0, D, dtype=keys.dtype), empty(B, Hkv, 0, D, dtype=keys.dtype)
        self.held_pos, self.held_kind = empty(B, Hkv, 0, dtype=torch.long), empty(B, Hkv, 0, dtype=torch.long)
        self.held_score = empty(B, Hkv, 0, dtype=torch.float32)
        self.keys, self.values, self.score, self.kind, self.sunk = keys, values, score, kind, sunk
        self.seen, self.new = int(seen), 0
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a StreamKVLayer is made from a layer's first call (BoundedSoftmax)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys = torch.cat([self.keys, key_states], 2)
        self.values = torch.cat([self.values, value_states], 2)
        self.seen, self.new = self.seen + key_states.shape[2], key_states.shape[2]
        return torch.cat([self.held_keys, self.keys], 2), torch.cat([self.held_values, self.values], 2)

    def before(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window's keys before the last call's, as the scorer reads its context: [B, n, Hkv, D] twice, [B, n]."""
        n = self.keys.shape[2] - self.new
        return (self.keys[:, :, :n].transpose(1, 2), self.values[:, :, :n].transpose(1, 2),
                self.kind[:, :n] != PAD)

    def admit(self, score: torch.Tensor, kind: torch.Tensor) -> None:
        """The last call's keys' scores [B, Hkv, T] and kinds [B, T]."""
        self.score, self.kind = torch.cat([self.score, score], 2), torch.cat([self.kind, kind], 1)

    def pool(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions, scores and kinds [B, Hkv, P] of [held, window], as `update` returned their keys."""
        B, Hkv, n = self.score.shape
        at = torch.arange(self.seen - n, self.seen, device=self.keys.device).expand(B, Hkv, n)
        return (torch.cat([self.held_pos, at], 2), torch.cat([self.held_score, self.score], 2),
                torch.cat([self.held_kind, self.kind[:, None].expand(B, Hkv, n)], 2))

    def settle(self, width: int, count: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """After a call that attended over `keys` and `values` (what `update` returned): keep the sink and the best
        `count` keys that have left the window, and the window's last width - 1 keys (those the next query sees)."""
        pos, score, kind = self.pool()
        held, held_kind = keep_after(pos, score, kind, self.seen, width, count)
        gather = lambda x: x.gather(2, held[..., None].expand(-1, -1, -1, x.shape[-1]))
        self.held_keys, self.held_values = gather(keys), gather(values)
        self.held_pos, self.held_score, self.held_kind = pos.gather(2, held), score.gather(2, held), held_kind
        last = slice(max(self.keys.shape[2] - (width - 1), 0), None)
        self.keys, self.values = self.keys[:, :, last], self.values[:, :, last]
        self.score, self.kind, self.new = self.score[:, :, last], self.kind[:, last], 0


def arriving_kinds(key_valid: torch.Tensor, sunk: torch.Tensor, sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """key_valid [B, T] of a call's keys, sunk [B] the sink tokens before it -> (kinds [B, T], sunk after)."""
    order = sunk[:, None] + key_valid.long().cumsum(1)
    kind = torch.where(key_valid, torch.where(order <= sink, SINK, KEY), PAD)
    return kind, sunk + key_valid.long().sum(1)


class BoundedSoftmax(nn.Module):
    """A kept softmax layer's bounded cache: the sink, window and selection of a `spec.Attention`; with
    `select_by = stream` its `KeyScorer` (the only parameters). `install` binds the HF cache and the layer's index for
    the duration of a call (`cache`, `layer_idx`)."""

    def __init__(self, attention, scaling: float, num_kv_heads: int = 1, head_dim: int = 1):
        super().__init__()
        self.scaling = float(scaling)
        self.sink, self.width = attention.sink, attention.window
        self.count, self.observe, self.pool = attention.select, attention.select_observe, attention.select_pool
        self.streams = attention.select_by == "stream"
        self.scorer = KeyScorer(num_kv_heads, head_dim) if self.streams else None
        self.cache, self.layer_idx = None, None

    def extra_repr(self) -> str:
        by = "stream" if self.streams else "prompt"
        return f"sink={self.sink}, window={self.width}, select={self.count}, by {by}"

    def stream(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor | None,
               attend) -> torch.Tensor:
        """A streaming layer's attention (query [B, H, T, D], key and value [B, Hkv, P, D] as the layer attends:
        with a `StreamKVLayer` its pool, else the call's keys; key_valid [B, T] of the call's keys or None).
        `attend(query_block, key, value, mask [B, H, t, P] bool)` is the layer's softmax; returns [B, T, H, D]."""
        B, H, T, _ = query.shape
        Hkv = key.shape[1]
        valid = torch.ones(B, T, dtype=torch.bool, device=key.device) if key_valid is None else key_valid
        new_k, new_v = key[:, :, -T:].transpose(1, 2), value[:, :, -T:].transpose(1, 2)      # [B, T, Hkv, D]
        slot = self.slot()
        if isinstance(slot, StreamKVLayer):
            score = self.scorer(new_k, new_v, valid, before=slot.before(), start=slot.seen - T)
            kind, slot.sunk = arriving_kinds(valid, slot.sunk, self.sink)
            slot.admit(score, kind)
            pos, score, kind = slot.pool()
        else:
            if slot is not None and key.shape[2] != T:
                raise UserError(f"layer {self.layer_idx} streams its cache but found {key.shape[2] - T} past keys in "
                                f"a {type(slot).__name__}: start generation from a fresh cache")
            score = self.scorer(new_k, new_v, valid)
            kind, sunk = arriving_kinds(valid, valid.new_zeros(B, dtype=torch.long), self.sink)
            if slot is not None:          # a sequence's first call: its slot streams from here on
                slot = StreamKVLayer(key, value, score, kind, sunk, T)
                self.layers()[self.layer_idx] = slot
            pos = torch.arange(T, device=key.device).expand(B, Hkv, T)
            kind = kind[:, None].expand(B, Hkv, T)
        end = slot.seen if slot is not None else T
        seen = stream_visible(pos, score, kind, torch.arange(end - T, end, device=key.device), self.width,
                              self.count)                                                  # [B, Hkv, T, P]
        out = torch.cat([attend(query[:, :, lo:lo + QUERY_BLOCK], key, value,
                                seen[:, :, lo:lo + QUERY_BLOCK].repeat_interleave(H // Hkv, dim=1))
                         for lo in range(0, T, QUERY_BLOCK)], 1)
        if slot is not None:
            slot.settle(self.width, self.count, key, value)
        return out

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
    def after(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor | None):
        """After a call's attention (query [B, H, T, D], key and value [B, Hkv, T, D] as the layer attended,
        key_valid [B, T] or None): if it was a sequence's first (the prompt), the slot becomes bounded."""
        slot = self.slot()
        B, _, T, _ = key.shape
        if type(slot) is not DynamicLayer or key.shape[2] != query.shape[2]:
            return                        # bounded already, or not a prompt's first call: nothing to choose
        q, k = query.transpose(1, 2), key.transpose(1, 2)                           # [B, T, H, D], [B, T, Hkv, D]
        valid = torch.ones(B, T, dtype=torch.bool, device=key.device) if key_valid is None else key_valid
        sink = first_keys(valid, B, T, self.sink, key.device) if self.sink else torch.zeros_like(valid)
        candidates = prompt_candidates(valid, sink, self.width)
        index, chosen = select_keys(q, k, self.scaling, candidates, self.count, self.observe, self.pool, valid)
        order = torch.sort(torch.where(sink, 0, 1), dim=1, stable=True).indices[:, :self.sink]    # sink positions
        at = torch.cat([order[:, None, :].expand(-1, k.shape[2], -1), index], -1)              # [B, Hkv, S + C]
        held_valid = torch.cat([sink.gather(1, order), chosen], 1)
        gather = lambda x: x.gather(2, at[..., None].expand(-1, -1, -1, x.shape[-1]))
        last = slice(max(T - self.width, 0), None)                                  # the window's keys
        self.layers()[self.layer_idx] = BoundedKVLayer(gather(key), gather(value), held_valid, key[:, :, last],
                                                      value[:, :, last], (valid & ~sink)[:, last], self.width, T)
