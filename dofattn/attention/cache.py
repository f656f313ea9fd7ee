"""Cache slots for linearized layers in a Hugging Face `Cache`: a recurrent state instead of a growing KV cache.

`LinearStateLayer` holds a layer's state [B, H, M, V+1], its token count, and a `PartState` per part that keeps one
(each part declares its own: a window's last W keys and values, a sink's first S, a convolution's last K-1 inputs),
so memory stays flat in context length. `StaticStateLayer` is its form for static decoding (`engine.StaticDecoder`):
a hybrid's window in a fixed ring of W slots. `state_layer` puts a `LinearStateLayer`
into a fresh cache slot.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from dofattn.errors import UserError


# What an HF forward (a model's, or an attention module's) calls its cache: `cache` from transformers 5.24 on,
# `past_key_values` before, `layer_past` in older GPT-NeoX code.
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def cache_argument(arguments: dict) -> Cache | None:
    """The cache a call's keyword arguments bring under any of its names (`CACHE_ARGUMENTS`), or None."""
    return next((arguments[name] for name in CACHE_ARGUMENTS if arguments.get(name) is not None), None)


def cache_kwargs(model, cache) -> dict:
    """{name: cache} for a call of `model`: its forward takes the cache as `cache` from transformers 5.24 on and as
    `past_key_values` before (still accepted there, with a deprecation warning)."""
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def keep_buffer(holder, name: str, value: torch.Tensor) -> None:
    """Store `value` as `holder`'s tensor `name` (a cache slot's, or a part's state's). While a CUDA graph is being
    captured (`engine.StaticDecoder`) it is copied into the tensor already there, so that every replay reads and
    writes the same buffer."""
    old = getattr(holder, name)
    if (old is not None and value.is_cuda and torch.cuda.is_current_stream_capturing()
            and value.shape == old.shape and value.dtype == old.dtype):
        old.copy_(value)
    else:
        setattr(holder, name, value)


def last_keys(x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """The last `width` entries of `x` along `dim` (all, if fewer): what a window keeps of the keys it has seen."""
    return x.narrow(dim, max(x.shape[dim] - width, 0), min(x.shape[dim], width))


def ring_slot(position, width: int, lead: int = 0):
    """The slot of the key at `position` (an int, or a tensor of positions) in a ring of `width` slots after `lead`
    others: lead + position mod width. The one ring rule: the window hybrid's static ring
    (`exact.WindowState.frozen`) and a bounded kept layer's cache (`model.bounded.BoundedKVLayer`, `StaticBoundedLayer`)
    both keep their last keys by it."""
    return lead + (position.remainder(width) if isinstance(position, torch.Tensor) else position % width)


def in_ring(x: torch.Tensor, seen: int, width: int, dim: int = 1) -> torch.Tensor:
    """The last n keys seen, `x` (n ≤ width along `dim`, in order; the last at position seen - 1), in a ring of
    `width` slots, the key at position p in slot p mod width (the slots not reached yet zero): a window for static
    decoding, written in place a step at a time."""
    n = x.shape[dim]
    slots = ring_slot(torch.arange(seen - n, seen, device=x.device), width)
    shape = list(x.shape)
    shape[dim] = width
    return x.new_zeros(shape).index_copy_(dim, slots, x)


class PartState:
    """One part's tensors in a cache slot, every one [B, ...] (None until the part's first call); the slot reorders,
    selects, repeats and moves them whatever the part. Each part declares its own (`Part.State`), registered here
    under the part's name (`PART_STATES`) when the part's class is made."""

    NAMES: tuple[str, ...] = ()

    def __init__(self):
        for name in self.NAMES:
            setattr(self, name, None)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.NAMES if getattr(self, name) is not None}

    def frozen(self, seen: int) -> PartState:
        """This state for static decoding after `seen` tokens (`StaticStateLayer.freeze`): the same tensors, each
        contiguous (a one-kernel step reads their rows). A part whose state changes shape for it says so (the
        window's ring)."""
        copy = type(self)()
        copy.__dict__.update({k: v for k, v in vars(self).items() if not isinstance(v, torch.Tensor)})
        for name, t in self.tensors().items():
            setattr(copy, name, t.contiguous())
        return copy


PART_STATES: dict[str, type[PartState]] = {}   # by part name: filled by each `attention.part.Part` with a State


class BatchSlot(CacheLayerMixin):
    """A cache slot whose every tensor has the batch first: the slot says how to replace each one (`_map`), and beam
    search, batch selection and offloading follow for all of them."""

    def _map(self, fn) -> None:
        """Every tensor t of the slot replaced by fn(t)."""
        raise NotImplementedError

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized:
            self._map(lambda t: t if t.device == self.device else t.to(self.device, non_blocking=True))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])


class LinearStateLayer(BatchSlot):
    """A cache slot for a linear layer: the linear branch's recurrent state, a state per part that keeps one (a
    window's last keys, a sink's, a convolution's last inputs: `part`), and the number of tokens seen, no growing
    keys or values, so memory stays flat in context length.

    Its mask sizes cover only the new tokens (`get_mask_sizes`), and `is_sliding` is True so that HF sizes the
    causal mask on the first layer that is not (`masking_utils.find_first_full_attention_index`): a softmax layer
    kept beside linear ones (`student.keep_softmax`), whose keys include the past and its padding. A model with no
    such layer falls back to layer 0's small mask."""

    static = False     # a static decoder's slot (`StaticStateLayer`): fixed shapes, a ring, steps in place
    is_sliding = True
    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.state: torch.Tensor | None = None   # [B, H, M, V+1], float32: the linear branch
        self.parts: dict[str, PartState] = {}    # by part name (`LinearAttention`'s attribute): window, sink, conv
        self.exact: CacheLayerMixin | None = None   # the slot of the layer's exact heads, if it keeps some
        self.seen = 0

    def part(self, name: str) -> PartState:
        """The state of the layer's part `name`, made empty on first use."""
        if name not in self.parts:
            self.parts[name] = PART_STATES[name]()
        return self.parts[name]

    def tensors(self) -> dict[str, torch.Tensor]:
        found = {} if self.state is None else {"state": self.state}
        for part, state in self.parts.items():
            found.update({f"{part}.{name}": t for name, t in state.tensors().items()})
        return found

    def _map(self, fn) -> None:
        """Every tensor t of the slot replaced by fn(t): the state and each part's."""
        if self.state is not None:
            self.state = fn(self.state)
        for part in self.parts.values():
            for name, t in part.tensors().items():
                setattr(part, name, fn(t))
        if self.exact is not None:
            map_slot(self.exact, fn)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states  # the attention sees only the new tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.parts, self.exact, self.seen = None, {}, None, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a linear attention state cannot drop tokens (no assisted or speculative decoding)")

    def to_static(self, position: torch.Tensor) -> StaticStateLayer:
        """This prefilled slot for static decoding (`engine.StaticDecoder`): `StaticStateLayer.freeze`. `position`:
        the decoder's [1] tensor."""
        return StaticStateLayer.freeze(self, position)


class StaticStateLayer(LinearStateLayer):
    """A linear layer's cache slot for static decoding (`engine.StaticDecoder`): the same state, each part's frozen
    (a window's last W keys and values in a ring of W slots, the key at position p in slot p mod W), and `position`,
    a [1] tensor the decoder advances in place: the position of the token being decoded. Its token count stays put
    during the steps, since a step replayed as a CUDA graph or compiled once must not change anything on the host
    per token (a count that moved would recompile a compiled step every token); the decoder sets `seen` when it is
    done. `arrivals` [B] int32 (zeros between steps) is the one-kernel ring step's count of the programs that have
    read a row's ring slot."""

    static = True

    arrivals: torch.Tensor | None = None
    position: torch.Tensor | None = None

    @classmethod
    def freeze(cls, layer: LinearStateLayer, position: torch.Tensor | None = None) -> StaticStateLayer:
        """The static form of `layer` after a prefill of `layer.seen` tokens."""
        static = cls.__new__(cls)
        static.__dict__.update(vars(layer))
        static.position = position
        if layer.state is not None:
            static.state = layer.state.float().contiguous()
        static.parts = {name: part.frozen(layer.seen) for name, part in layer.parts.items()}
        if layer.exact is not None:
            static.exact = layer.exact.to_static(position)
        return static

    def to_static(self, position: torch.Tensor) -> StaticStateLayer:
        return self                                  # static already

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return key_states, value_states


class StaticKVLayer(CacheLayerMixin):
    """A kept softmax layer's cache slot for static decoding (`engine.StaticDecoder`): the prompt's keys and values at
    the front of buffers of `length` slots [B, Hkv, length, D], and `position`, the decoder's [1] tensor: each step
    writes its key and value into slot `position` in place. The layer attends over the slots written so far
    (`slot_mask`, which `model.install` hands SDPA in place of HF's mask), so that the step has the same shapes
    every token."""

    is_sliding = False
    is_compileable = True
    is_croppable = False

    @classmethod
    def from_layer(cls, layer: DynamicLayer, length: int, position: torch.Tensor) -> StaticKVLayer:
        static = cls()
        B, Hkv, T, D = layer.keys.shape
        static.keys = layer.keys.new_zeros(B, Hkv, length, D)
        static.values = layer.values.new_zeros(B, Hkv, length, layer.values.shape[-1])
        static.keys[:, :, :T], static.values[:, :, :T] = layer.keys, layer.values
        static.position, static.seen, static.length = position, T, length
        static.dtype, static.device, static.is_initialized = layer.keys.dtype, layer.keys.device, True
        return static

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a StaticKVLayer is made from a prefilled layer (StaticKVLayer.from_layer)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.position, key_states)
        self.values.index_copy_(2, self.position, value_states)
        return self.keys, self.values

    def slot_mask(self) -> torch.Tensor:
        """[1, 1, 1, length] bool: True for the slots written so far, the current token's included."""
        return (torch.arange(self.length, device=self.keys.device) <= self.position)[None, None, None]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.length


def map_slot(slot: CacheLayerMixin, fn) -> None:
    """Every tensor t of a cache slot replaced by fn(t): a `BatchSlot` says how; another (HF's own) holds them as its
    attributes."""
    if isinstance(slot, BatchSlot):
        slot._map(fn)
        return
    for name, t in list(vars(slot).items()):
        if isinstance(t, torch.Tensor):
            setattr(slot, name, fn(t))


def cache_bytes(cache: Cache | None) -> int:
    """Bytes a generation cache holds for its sequences: every tensor of every layer (a KV cache; or a state with
    its parts' window, sink and convolution history, and its exact heads' slot). 0 for no cache."""
    def held(layer) -> list:
        parts = getattr(layer, "parts", {})
        exact = getattr(layer, "exact", None)
        own = [t for holder in (layer, *parts.values()) for t in vars(holder).values() if isinstance(t, torch.Tensor)]
        return own + ([] if exact is None else held(exact))

    return sum(t.numel() * t.element_size() for layer in getattr(cache, "layers", []) for t in held(layer))


def state_layer(cache: Cache, layer_idx: int) -> LinearStateLayer:
    """The `LinearStateLayer` in `cache`'s slot `layer_idx`, put there if the slot is a fresh dynamic layer (a
    sliding-window one too: HF makes those for a model's own local layers, some of which may be linearized)."""
    cache = getattr(cache, "self_attention_cache", cache)  # EncoderDecoderCache
    if not isinstance(cache, Cache):
        raise UserError(f"linearized layers need a transformers Cache, got {type(cache).__name__}")
    while len(cache.layers) <= layer_idx:
        cache.layers.append(DynamicLayer())
    slot = cache.layers[layer_idx]
    if isinstance(slot, LinearStateLayer):
        return slot
    if type(slot) not in (DynamicLayer, DynamicSlidingWindowLayer) or slot.get_seq_length() > 0:
        raise UserError(f"layer {layer_idx} is linear attention and cannot continue a {type(slot).__name__} cache "
                        f"with {slot.get_seq_length()} tokens; let generate() create the cache (DynamicCache)")
    cache.layers[layer_idx] = LinearStateLayer()
    return cache.layers[layer_idx]

