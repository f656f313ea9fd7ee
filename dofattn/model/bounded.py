"""A kept softmax layer with a bounded cache: after the prompt, its sink, its selected keys and a sliding window.

A layer the student keeps as exact softmax attention (`keep_softmax`) holds every past key in a KV cache, which grows
with the context. With `student.select` > 0 (its `spec.Kept`) its module carries a `BoundedSoftmax`
(`dofattn_bounded`): the prompt is read with full attention, as the teacher reads it; then the cache keeps the
first S real tokens (the sink), the C keys per kv head that the prompt's last queries attend to most (`ops.select`,
SnapKV-style) and the last W keys, and drops the rest (`BoundedKVLayer`). Every later query (the answer, the
generated tokens) reads those, exactly, and a key leaving its window is gone: memory after the prompt is (S + C + W)
keys per kv head at any length.

The prompt is a sequence's first call. A long one is read in chunks (`model.prompt`: the model's forward
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
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from dofattn.attention.cache import BatchSlot, in_ring, last_keys, ring_slot
from dofattn.ops.select import prompt_candidates, select_keys
from dofattn.ops.window import first_keys, window_pairs


class PromptKVLayer(DynamicLayer):
    """A kept layer's slot while a prompt is read in chunks: every key and value so far, in buffers made once for the
    whole prompt (`length` tokens, announced by the prompt reader before its first chunk: growing them a chunk at a
    time would leave the allocator a trail of smaller freed ones), and what the choice at the prompt's end reads
    besides: which keys are real (`valid` [B, T]) and the last queries ([B, ≤ observe, H, D])."""

    def __init__(self, length: int):
        super().__init__()
        self.length, self.valid, self.queries = int(length), None, None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, Hkv, _, D = key_states.shape
        self.key_buffer = key_states.new_empty(B, Hkv, self.length, D)
        self.value_buffer = value_states.new_empty(B, Hkv, self.length, value_states.shape[-1])
        self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T, new = self.keys.shape[2], key_states.shape[2]
        if T + new > self.length:     # more than announced (the model read as its teacher: nothing bounds it)
            self.length = T + new
            self.key_buffer = torch.cat([self.keys, key_states.new_empty(*key_states.shape[:2], new,
                                                                        key_states.shape[3])], 2)
            self.value_buffer = torch.cat([self.values, value_states.new_empty(*value_states.shape[:2], new,
                                                                              value_states.shape[3])], 2)
        self.key_buffer[:, :, T:T + new], self.value_buffer[:, :, T:T + new] = key_states, value_states
        self.keys, self.values = self.key_buffer[:, :, :T + new], self.value_buffer[:, :, :T + new]
        return self.keys, self.values

    def read(self) -> bool:
        """Whether the whole announced prompt has been read (a slot read past it, as its teacher reads, is a
        `DynamicLayer` for its further tokens)."""
        return self.is_initialized and self.keys.shape[2] == self.length


class BoundedKVLayer(BatchSlot):
    """A kept softmax layer's cache slot after a prompt: keys and values [B, Hkv, L + W, D], the L held ones (the
    sink's, then each kv head's C selected; slot c of a kv head is that head's own choice, without positions) and a
    ring of W slots after them, the key at position p in slot L + p mod W; `valid` [B, L + W] says which slots hold
    a real key (not a padding token, a slot not chosen or not written yet). A one-token call writes its key into its
    ring slot in place and reads every valid slot: the ring holds exactly the window, the last W tokens. A longer
    call reads the ring in order before its own keys under a causal window mask (`mask`) and leaves its last W keys
    in the ring. `seen` counts the tokens read; it neither restarts nor drops tokens. It hands SDPA its own mask, so
    HF sizes its causal mask on another layer (`is_sliding`). Static decoding keeps the same layout
    (`StaticBoundedLayer`)."""

    is_sliding = True
    is_compileable = False
    is_croppable = False
    NAMES = ("keys", "values", "valid")

    def __init__(self, keys, values, valid, lead: int, width: int, seen: int):
        super().__init__()
        self.keys, self.values, self.valid = keys, values, valid
        self.lead, self.width, self.seen, self.call_mask = int(lead), int(width), int(seen), None
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    @classmethod
    def from_prompt(cls, held_keys, held_values, held_valid, keys, values, valid, width: int) -> BoundedKVLayer:
        """The slot after a prompt of T tokens: the held keys and values [B, Hkv, L, D] and which are real ([B, L]),
        and the prompt's keys and values [B, Hkv, T, D] with theirs ([B, T]), whose last W go into the ring."""
        T = keys.shape[2]
        ring = lambda x, dim: in_ring(last_keys(x, width, dim), T, width, dim)
        return cls(torch.cat([held_keys, ring(keys, 2)], 2), torch.cat([held_values, ring(values, 2)], 2),
                   torch.cat([held_valid, ring(valid, 1)], 1), held_keys.shape[2], width, T)

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
        L, W, seen = self.lead, self.width, self.seen
        self.seen = seen + T
        if torch.is_grad_enabled():   # the slots change in place below: not those an earlier call's graph holds
            self.keys, self.values, self.valid = self.keys.clone(), self.values.clone(), self.valid.clone()
        if T == 1:                                    # a decode step: its key in its ring slot, every slot read
            slot = ring_slot(seen, W, L)
            self.keys[:, :, slot], self.values[:, :, slot] = key_states[:, :, 0], value_states[:, :, 0]
            self.valid[:, slot] = True
            self.call_mask = None
            return self.keys, self.values
        slots = ring_slot(torch.arange(seen - W, seen, device=self.keys.device), W, L)   # the ring, oldest first
        keys = torch.cat([self.keys[:, :, :L], self.keys[:, :, slots], key_states], 2)
        values = torch.cat([self.values[:, :, :L], self.values[:, :, slots], value_states], 2)
        valid = torch.cat([self.valid[:, slots], self.valid.new_ones(B, T)], 1)           # [B, W + T]
        key_at = torch.arange(seen - W, seen + T, device=self.keys.device)               # [W + T]
        query_at = torch.arange(seen, seen + T, device=self.keys.device)[:, None]        # [T, 1]
        near = window_pairs(query_at, key_at, W)[0]                                        # [T, W + T]
        held = self.valid[:, None, :L].expand(-1, T, -1)
        self.call_mask = torch.cat([held, near[None] & valid[:, None, :]], -1)[:, None]   # [B, 1, T, L + W + T]
        last = ring_slot(torch.arange(seen + T - W, seen + T, device=self.keys.device), W, L)
        self.keys.index_copy_(2, last, keys[:, :, -W:])
        self.values.index_copy_(2, last, values[:, :, -W:])
        self.valid[:, last] = valid[:, -W:]
        return keys, values

    def mask(self) -> torch.Tensor:
        """Which keys the last call's queries see, bool: after one token [B, 1, 1, L + W], every valid slot; after
        T tokens [B, 1, T, L + W + T], every real held key, and a ring or new key if it is real, not after the
        query and less than W tokens before it."""
        return self.valid[:, None, None] if self.call_mask is None else self.call_mask

    def to_static(self, position: torch.Tensor) -> StaticBoundedLayer:
        """This slot for static decoding: the same held keys and ring (`StaticBoundedLayer`)."""
        return StaticBoundedLayer.from_layer(self, position)


class StaticBoundedLayer(CacheLayerMixin):
    """A bounded kept layer's slot for static decoding (`engine.StaticDecoder`), made from its `BoundedKVLayer` after
    the prompt: the same held keys and ring of W slots ([B, Hkv, L + W, D]); `position` is the decoder's [1] tensor.
    Each step writes its key into its ring slot in place, the slot read from the tensor, and the layer attends over
    the valid slots (`slot_mask`, which `install` reads off the call's cache): the same shapes every token, and the
    same keys as the growing `BoundedKVLayer` reads."""

    is_sliding = False
    is_compileable = True
    is_croppable = False

    @classmethod
    def _of(cls, keys, values, valid, position, lead: int, width: int, seen: int) -> StaticBoundedLayer:
        static = cls()
        static.keys, static.values, static.valid = keys, values, valid
        static.position, static.lead, static.width, static.seen = position, lead, width, seen
        static.dtype, static.device, static.is_initialized = keys.dtype, keys.device, True
        return static

    @classmethod
    def from_layer(cls, layer: BoundedKVLayer, position: torch.Tensor) -> StaticBoundedLayer:
        return cls._of(layer.keys.clone(), layer.values.clone(), layer.valid.clone(), position, layer.lead,
                       layer.width, layer.seen)

    @classmethod
    def from_window(cls, layer: DynamicSlidingWindowLayer, position: torch.Tensor) -> StaticBoundedLayer:
        """A model's own sliding-window layer (Gemma 2/3, Mistral) for static decoding: HF's slot after the prompt
        holds its last W - 1 keys (W, its `sliding_window`); here they lie in a ring of W slots with nothing held
        before it, so that each step's key fills the ring's last slot and the step reads its W keys, as HF's does."""
        W, seen = layer.sliding_window, layer.cumulative_length
        written = torch.ones(layer.keys.shape[0], layer.keys.shape[2], dtype=torch.bool, device=layer.keys.device)
        return cls._of(in_ring(layer.keys, seen, W, 2), in_ring(layer.values, seen, W, 2), in_ring(written, seen, W, 1),
                       position, 0, W, seen)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a StaticBoundedLayer is made from a bounded layer (StaticBoundedLayer.from_layer)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        slot = ring_slot(self.position, self.width, self.lead)                  # [1]
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.valid.index_fill_(1, slot, True)
        return self.keys, self.values

    def slot_mask(self) -> torch.Tensor:
        """[B, 1, 1, L + W] bool: the real held keys and the ring's written slots (the current token's included)."""
        return self.valid[:, None, None]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class HeadSplit:
    """Which key/value heads of a linear layer stay exact softmax attention (`exact`) and which are linear, each query
    head going with its key/value head's group. Heads are taken and put back by slicing runs of neighbours (no index
    tensors: a CUDA graph can capture it)."""

    def __init__(self, exact, num_kv_heads: int, num_heads: int):
        self.exact = tuple(sorted(int(h) for h in exact))
        self.num_kv_heads, self.num_heads = int(num_kv_heads), int(num_heads)
        self.linear = tuple(h for h in range(self.num_kv_heads) if h not in self.exact)
        group = self.num_heads // self.num_kv_heads
        self.exact_q = tuple(h * group + g for h in self.exact for g in range(group))
        self.linear_q = tuple(h * group + g for h in self.linear for g in range(group))
        side_by_side = self.exact_q + self.linear_q                   # the heads as `merge` receives them
        self.order = tuple(side_by_side.index(h) for h in range(self.num_heads))

    def __repr__(self) -> str:
        return f"exact kv heads {list(self.exact)} of {self.num_kv_heads}"

    def split(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dim: int):
        """((q, k, v) of the exact heads, (q, k, v) of the linear ones), the heads along `dim` of each."""
        kv = lambda x, heads: take(x, heads, dim)
        return ((take(query, self.exact_q, dim), kv(key, self.exact), kv(value, self.exact)),
                (take(query, self.linear_q, dim), kv(key, self.linear), kv(value, self.linear)))

    def merge(self, exact: torch.Tensor, linear: torch.Tensor, dim: int) -> torch.Tensor:
        """The layer's output heads in order along `dim`, from the exact heads' and the linear heads' outputs."""
        return take(torch.cat([exact, linear], dim), self.order, dim)


def take(x: torch.Tensor, heads: tuple[int, ...], dim: int) -> torch.Tensor:
    """x's `heads` along `dim`, in order, by runs of neighbours."""
    runs = []
    for h in heads:
        if runs and runs[-1][1] == h:
            runs[-1][1] += 1
        else:
            runs.append([h, h + 1])
    pieces = [x.narrow(dim, a, b - a) for a, b in runs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


class BoundedSoftmax(nn.Module):
    """A kept softmax layer's bounded cache: the selection of a `spec.Kept` beside the sink and window of the linear
    layers' `spec.Attention`; with `heads` (a `HeadSplit`), those of a linear layer's key/value heads it keeps exact
    (their slot nested in the layer's `LinearStateLayer`: `exact`). It has no parameters and holds nothing between
    calls: the call's cache comes as an argument (`install`), and a prompt read in chunks announces its length in the
    layer's slot (`PromptKVLayer`)."""

    def __init__(self, kept, attention, scaling: float, heads: HeadSplit | None = None):
        super().__init__()
        self.kept, self.attention, self.scaling, self.heads = kept, attention, float(scaling), heads

    def extra_repr(self) -> str:
        return self.kept.describe(self.attention) + ("" if self.heads is None else f", {self.heads!r}")

    @torch.no_grad()
    def observed(self, slot: PromptKVLayer, query: torch.Tensor, new_valid: torch.Tensor) -> BoundedKVLayer | None:
        """A prompt's call read into `slot` (query [B, H, T, D], which of its keys are real [B, T]): the slot keeps
        which keys are real and the last queries; once the whole prompt is read, the bounded slot chosen from them
        (`choose`), else None."""
        valid = new_valid if slot.valid is None else torch.cat([slot.valid, new_valid], 1)
        queries = query.transpose(1, 2) if slot.queries is None else torch.cat([slot.queries, query.transpose(1, 2)], 1)
        slot.valid, slot.queries = valid, last_keys(queries, self.kept.select_observe)     # [B, ≤ observe, H, D]
        if not slot.read():
            return None
        return self.choose(slot.queries, slot.keys, slot.values, slot.valid)

    def mask(self, slot) -> torch.Tensor | None:
        """The slot's own mask once it is bounded (a call after the prompt), else None (HF's mask stands)."""
        return slot.mask() if isinstance(slot, BoundedKVLayer) else None

    @torch.no_grad()
    def after(self, cache, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              new_valid: torch.Tensor | None):
        """After a call's attention on the HF `cache` (query [B, H, T, D]; key and value [B, Hkv, P, D], every key the
        layer attended: the cache's and the call's; new_valid [B, T], which of the call's keys are real, or None:
        all): while a prompt is read (a sequence's first call, or the chunks of an announced prompt), the slot keeps
        its keys; at the prompt's end it becomes bounded."""
        layers = getattr(cache, "self_attention_cache", cache).layers
        slot = layers[layer_idx] if layer_idx < len(layers) else None
        B, _, T, _ = query.shape
        real = torch.ones(B, T, dtype=torch.bool, device=key.device) if new_valid is None else new_valid
        if isinstance(slot, PromptKVLayer):                                # a chunk of an announced prompt
            chosen = self.observed(slot, query, real)
        elif type(slot) is DynamicLayer and key.shape[2] == T:             # a sequence's first call: its prompt
            chosen = self.choose(last_keys(query.transpose(1, 2), self.kept.select_observe), key, value, real)
        else:
            return                        # bounded already, or a cache this layer did not start: nothing to choose
        if chosen is not None:
            layers[layer_idx] = chosen

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
        return BoundedKVLayer.from_prompt(gather(key), gather(value), held_valid, key, value, valid & ~sink, width)
