"""The window hybrid: exact softmax over the last W keys (`Window`) and the first S (`Sink`) beside the linear branch
beyond, in one normalisation (`ops.window`). This module holds the two parts, their cache states and the hybrid's
forms (`WindowForms`), which a layer with a window runs its calls through (`LinearAttention.forms`).

The parts own their parameters (the linear branch's gain against the window) and their cache state
(`cache.part("window")`, a `WindowState`: a ring of W slots in a static slot; `cache.part("sink")`, a `SinkState`)
and read nothing of the layer. The forms read the layer's feature map, its kv expansion and its other parts
through the op's arguments (`op_arguments`); a fast form runs only where every part says it can (`runs`):
    attend        a prefill, or a cached call's keys after the cache's: `window_linear_attention` (the cache's keys
                  still inside the window come first; a sink's S slots first of all, without positions)
    step          a cached call: a steady decode step (one token, the window full: `lean_step_ok`) on the growing
                  cache `fold_key` and `window_decode_step` (on SmolLM2 384 aten operators a layer against the
                  general call's 637), its PRF form `prf_window_decode_step`; a static ring's step (`ring_step`),
                  on CUDA with a PRF map the Triton kernel `ops.triton.window.prf_ring_step`; else `attend`
    logits        the layer's naive log weights (`ops.window.window_logits`), and `calibrate` the gain from them
"""

from __future__ import annotations

import math
import torch
from torch import nn

from dofattn.attention.cache import (LinearStateLayer, PartState, StaticStateLayer, in_ring, keep_buffer, last_keys,
                                     ring_slot)
from dofattn.attention.part import KERNELS, Part
from dofattn.errors import UserError
from dofattn.features import MAX_KEY_EXCESS, in_model_dtype
from dofattn.ops.naive import needs_grad
from dofattn.ops.softmax import attention_logits
from dofattn.ops.window import (PRFStep, first_keys, fold_key, prf_step_constants, prf_window_decode_step,
                                window_decode_step, window_linear_attention, window_logits)

TINY = torch.finfo(torch.float32).tiny


class WindowState(PartState):
    """A window's last W keys and values (after RoPE, kv heads: [B, ≤W, Hkv, D]) and whether each is a real token
    ([B, ≤W] bool); for static decoding (`frozen`) a ring of W slots, the key at position p in slot p mod W."""

    NAMES = ("keys", "values", "valid")
    width = 0          # W: how many it keeps (its `Window` says, on its first call)

    def frozen(self, seen: int) -> WindowState:
        """The ring of W slots after `seen` tokens (its last ≤ W keys in order), written in place a step at a time."""
        ring = type(self)()
        ring.width = self.width
        for name in self.NAMES:
            setattr(ring, name, in_ring(getattr(self, name), seen, self.width))
        return ring


class SinkState(PartState):
    """A sink's first S real tokens' keys and values ([B, S, Hkv, D]) in S slots, which slots are filled ([B, S]),
    and `full`: every row's slots filled (checked until they are)."""

    NAMES = ("keys", "values", "valid")
    full = False

    def frozen(self, seen: int) -> SinkState:
        """Static decoding reads S filled slots: after a prompt of at least S real tokens."""
        if self.valid is not None and not self.valid.all():
            raise UserError(f"static decoding with a sink of {self.valid.shape[1]} tokens needs prompts of at least "
                            f"that many real tokens; use a longer prompt or HF generate")
        copy = super().frozen(seen)
        copy.full = self.valid is not None
        return copy


class Window(Part):
    """Exact softmax over the last W keys, the linear branch beyond; `log_gain` [H] (learned, init 0) scales the
    linear part's mass against the window's. Its cache state is the last W keys (`keep`)."""

    name, State = "window", WindowState
    kernels = KERNELS          # the hybrid's fast forms are its own

    @classmethod
    def build(cls, attention, num_heads: int, num_kv_heads: int, head_dim: int) -> Window | None:
        return cls(attention.window, num_heads) if attention.window else None

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.width = int(width)
        self.log_gain = nn.Parameter(torch.zeros(num_heads))                       # [H]

    def extra_repr(self) -> str:
        return f"width={self.width}"

    def keep(self, cache: LinearStateLayer, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor) -> None:
        """The last W of these keys (kv heads), values and flags stay in the cache for the next call."""
        last = cache.part("window")
        last.keys, last.values, last.valid = (last_keys(x, self.width) for x in (k, v, key_valid))
        last.width = self.width


class Sink(Part):
    """The first S real tokens of a sequence stay exact for every later query, however far back, and never enter the
    linear branch (an attention sink; `ops.window`). Beside a window only; with a decay the sink is not decayed.
    Generation keeps their keys in S slots of the cache (a `SinkState`), which a cached call puts before the
    window's keys (the op's `lead`: an exact key's weight does not depend on its distance)."""

    name, State = "sink", SinkState
    kernels = KERNELS          # every hybrid form reads its slots beside the window's

    @classmethod
    def build(cls, attention, num_heads: int, num_kv_heads: int, head_dim: int) -> Sink | None:
        return cls(attention.sink) if attention.sink else None

    def __init__(self, count: int):
        super().__init__()
        self.count = int(count)

    def extra_repr(self) -> str:
        return f"count={self.count}"

    def ready(self, cache: LinearStateLayer) -> bool:
        """Whether every row's S slots are filled (checked, with a GPU sync, until they are)."""
        sink = cache.part("sink")
        if not sink.full:
            sink.full = sink.valid is not None and bool(sink.valid.all())
        return sink.full

    def take(self, cache: LinearStateLayer, key_valid: torch.Tensor) -> torch.Tensor:
        """The first S real tokens ever seen: a row's slots fill over calls if its first calls were shorter."""
        sink = cache.part("sink")
        had = 0 if sink.valid is None else sink.valid.sum(1, keepdim=True)         # [B, 1]
        return first_keys(key_valid, *key_valid.shape, self.count, key_valid.device, had)

    def store(self, cache: LinearStateLayer, k: torch.Tensor, v: torch.Tensor, taken: torch.Tensor) -> None:
        B, T = taken.shape
        S, sink = self.count, cache.part("sink")
        if sink.keys is None:
            sink.keys, sink.values = k.new_zeros(B, S, *k.shape[2:]), v.new_zeros(B, S, *v.shape[2:])
            sink.valid = taken.new_zeros(B, S)
        rank = sink.valid.sum(1, keepdim=True) + taken.cumsum(1)                   # [B, T]: 1-based among taken
        slot = torch.where(taken, rank - 1, S)                                      # slot S: a spare, dropped
        for name, new in (("keys", k), ("values", v)):
            buffer = torch.cat([getattr(sink, name), new.new_zeros(B, 1, *new.shape[2:])], 1)
            index = slot.reshape(B, T, *[1] * (new.dim() - 2)).expand_as(new)
            setattr(sink, name, buffer.scatter(1, index, new)[:, :S])
        sink.valid = torch.cat([sink.valid, taken.new_zeros(B, 1)], 1).scatter(1, slot, taken)[:, :S]


class WindowForms:
    """The forms of a `LinearAttention` with a window (the module's docstring), each given the layer it runs."""

    @classmethod
    def attend(cls, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_valid: torch.Tensor | None, state: torch.Tensor | None, output_final_state: bool, backend: str,
               sink_mask: torch.Tensor | None, lead: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`LinearAttention.attend` with a window: q [B, T, H, D], k and v [B, Tk, H, D] (Tk > T: cached keys come
        first, after `lead` sink slots) -> (o [B, T, H, D], state or None). With a sink and no `sink_mask`, the call
        starts a sequence: its first S real keys are the sink."""
        sink = layer.attention.sink
        if sink and sink_mask is None:
            sink_mask = first_keys(key_valid, k.shape[0], k.shape[1], sink, k.device)
        fmap = layer.feature_map
        phi_q, q_scale = fmap.features(q, "query")                             # [B, T, H, M], [B, T, H]
        phi_k, k_scale = fmap.features(k, "key")                               # [B, Tk, H, M], [H]
        phi_q, phi_k = in_model_dtype(phi_q, q.dtype), in_model_dtype(phi_k, q.dtype)
        if key_valid is not None:   # the cached keys come first: a rule on left padding holds beside them
            layer.check_padding(key_valid[:, lead:])
        return window_linear_attention(q, k, v, phi_q, phi_k, q_scale, k_scale + layer.window.log_gain, fmap.scaling,
                                       layer.window.width, key_valid, state, output_final_state=output_final_state,
                                       backend=backend, sink_mask=sink_mask, lead=lead, **layer.op_arguments(v))

    @classmethod
    def step(cls, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             key_valid: torch.Tensor | None, cache: LinearStateLayer, backend: str) -> torch.Tensor:
        """A cached call of the hybrid: q [B, T, H, D], k and v [B, T, Hkv, D] -> o [B, T, H, D]. A ring (static
        decoding) takes `ring_step`, a steady decode step `decode_step`. Otherwise the keys go in as [the sink's S
        slots, the cache's keys still inside the window (each with its padding flag), the new keys]; the keys the
        sink takes stay exact for the later queries and leave the window's keys (no key counts twice), and the last
        W of the rest stay for the next call. The first call of a sequence (empty slots) puts nothing first: its keys
        are its own, as many as its queries, so a CUDA prefill takes the Triton hybrid."""
        if cache.static:
            return cls.ring_step(layer, q, k, v, cache, backend)
        if cls.lean_step_ok(layer, q, cache):
            return cls.decode_step(layer, q, k, v, key_valid, cache)
        B, T = k.shape[:2]
        if key_valid is None:
            key_valid = torch.ones(B, T, dtype=torch.bool, device=k.device)
        sink = layer.sink
        held = cache.part("sink") if sink is not None else None
        held = held if held is not None and held.keys is not None else None   # none on a first call
        taken = sink.take(cache, key_valid) if sink is not None else None        # [B, T]: new keys the sink holds
        lead = held.keys.shape[1] if held is not None else 0
        last = cache.part("window")
        parts = [(held.keys, held.values, held.valid)] if held is not None else []
        if last.keys is not None:
            parts.append((last.keys, last.values, last.valid))
        keys, values, valid = (torch.cat([*(p[i] for p in parts), x], 1) for i, x in enumerate((k, v, key_valid)))
        sink_mask = None
        if sink is not None:   # the held slots and this call's new sink keys stay exact for every later query
            sink_mask = torch.cat([*([held.valid] if held is not None else []),
                                   valid.new_zeros(B, keys.shape[1] - lead - T), taken], 1)
        o, state = cls.attend(layer, q, layer.expand_kv(keys), layer.expand_kv(values), valid, cache.state, True,
                              backend, sink_mask, lead)
        keep_buffer(cache, "state", state)
        window_valid = valid[:, lead:]
        if sink is not None:   # a key the sink holds is not a window key: none counts twice
            sink.store(cache, k, v, taken)
            window_valid = torch.cat([window_valid[:, :-T], window_valid[:, -T:] & ~taken], 1)
        layer.window.keep(cache, keys[:, lead:], values[:, lead:], window_valid)
        return o

    @classmethod
    def one_kernel_ring(cls, layer: nn.Module, q: torch.Tensor, cache: StaticStateLayer, backend: str) -> bool:
        """True when this ring step runs as one Triton kernel (`ops.triton.window.prf_ring_step`): backend auto on
        CUDA, or backend triton (on CPU: Triton's interpreter, for tests); a PRF map with a calibrated key shift, in
        eval mode, no autograd, a contiguous float32 state. Reads nothing from the GPU per step (the calibration
        once)."""
        fmap = layer.feature_map
        if not (backend == "triton" or (backend == "auto" and q.is_cuda)):
            return False
        if needs_grad(q, *layer.parameters()):
            return False
        from dofattn.ops import load_triton
        return (layer.runs("prf_ring_step") and fmap.prf() is not None and fmap.settled()
                and cache.state is not None and cache.state.dtype == torch.float32 and cache.state.is_contiguous()
                and load_triton()[0] is not None)

    @classmethod
    def lean_step_ok(cls, layer: nn.Module, q: torch.Tensor, cache: LinearStateLayer) -> bool:
        """True when this cached call is a steady decode step, which `decode_step` gives with the general call's
        numbers: one query, a full window of W cached keys, a full sink, and a feature map that the keys no longer
        move (eval mode; a PRF map's key shift calibrated). Syncs with a GPU only until a cache's sink is full."""
        fmap, last = layer.feature_map, cache.part("window")
        if (not layer.runs("lean_step") or q.shape[1] != 1 or not fmap.settled() or cache.state is None
                or last.keys is None or last.keys.shape[1] != layer.window.width):
            return False
        return layer.sink is None or layer.sink.ready(cache)

    @classmethod
    def decode_step(cls, layer: nn.Module,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                    cache: LinearStateLayer) -> torch.Tensor:
        """A steady decode step (`lean_step_ok`) on the growing-list cache: the oldest cached key leaves the window
        and joins the state, the new key joins the window, and the query reads [sinks, window] exactly and the
        state. q [B, 1, H, D], k and v [B, 1, Hkv, D] -> o [B, 1, H, D]."""
        last = cache.part("window")
        if key_valid is None:          # a real token: no padding can follow a real one
            key_valid = last.valid.new_ones(k.shape[:2])
        else:                          # as the general call (a decay: no padding after a real token)
            layer.check_padding(torch.cat([last.valid, key_valid], 1))
        old = last.keys[:, 0], last.values[:, 0], last.valid[:, 0]                # the key leaving the window
        last.keys, last.values = torch.cat([last.keys[:, 1:], k], 1), torch.cat([last.values[:, 1:], v], 1)
        last.valid = torch.cat([last.valid[:, 1:], key_valid], 1)
        if cls.prf_step_ok(layer, q, cache):
            o = prf_window_decode_step(q[:, 0], *old, *cls.exact_keys(layer, cache), cache.state,
                                       cls.step_constants(layer, v))
            return o[:, None]
        state, k_scale = cls.fold(layer, cache.state, *old, q.dtype, v)
        keep_buffer(cache, "state", state)
        return cls.read_exact(layer, q, cache, k_scale, q.dtype)

    @classmethod
    def prf_step_ok(cls, layer: nn.Module, q: torch.Tensor, cache: LinearStateLayer) -> bool:
        """True when a steady decode step runs as `ops.window.prf_window_decode_step` (few operations, the state
        updated in place): a PRF map, float32, a contiguous state, no autograd (a window has no gate: `spec`); else
        `fold` and `read_exact`."""
        return (layer.runs("prf_window_step") and layer.feature_map.prf() is not None
                and q.dtype == torch.float32
                and cache.state.dtype == torch.float32 and cache.state.is_contiguous()
                and not needs_grad(q, *layer.parameters()))

    @classmethod
    def step_constants(cls, layer: nn.Module, v: torch.Tensor) -> PRFStep:
        """The PRF step's constants (`ops.window.prf_step_constants`, with the parts' op arguments for the values v
        [B, 1, Hkv, D]), made again only when a tensor of the layer changed (its storage or its version: an optimizer
        step, a load, a move: `LinearAttention.held`)."""
        return layer.held("prf_step", lambda: prf_step_constants(layer.feature_map.prf(), layer.window.log_gain,
                                                                 layer.num_kv_heads, MAX_KEY_EXCESS,
                                                                 **layer.step_arguments(v)))

    @classmethod
    def exact_keys(cls, layer: nn.Module,
                   cache: LinearStateLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys, values and flags a query reads exactly: the sink's, then the window's ([B, S + W, Hkv, D])."""
        held = ([cache.part("sink")] if layer.sink is not None else []) + [cache.part("window")]
        return tuple(torch.cat([getattr(slots, name) for slots in held], 1) for name in ("keys", "values", "valid"))

    @classmethod
    def fold(cls, layer: nn.Module,
             state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor,
             dtype: torch.dtype, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the state after the key [B, Hkv, D] with its value leaves the window, the keys' log-scale [H]): a key
        that is padding or a sink (`valid` [B] False) adds nothing (with a decay, the state still decays: a step
        passed; the parts' op arguments read this step's values v [B, 1, Hkv, D]). Features rounded to `dtype` if
        it is 16-bit (as `attend` does for a 16-bit model; the static ring keeps them in float32, as its one-kernel
        step)."""
        phi, k_scale = layer.feature_map.features(layer.expand_kv(key[:, None]), "key")     # [B, 1, H, M], [H]
        phi = in_model_dtype(phi, dtype)[:, 0]
        phi = phi * valid[:, None, None].to(phi.dtype)
        return fold_key(state, phi, layer.expand_kv(value[:, None])[:, 0], **layer.step_arguments(v)), k_scale

    @classmethod
    def read_exact(cls, layer: nn.Module, q: torch.Tensor, cache: LinearStateLayer, k_scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        """The query q [B, 1, H, D] against the cache's sinks and window keys (exact) and its state -> [B, 1, H, D]
        (`ops.window.window_decode_step`); its features rounded to `dtype` if 16-bit, as in `fold`."""
        keys, values, valid = cls.exact_keys(layer, cache)
        phi_q, q_scale = layer.feature_map.features(q, "query")                            # [B, 1, H, M]
        phi_q = in_model_dtype(phi_q, dtype)
        o = window_decode_step(q[:, 0], keys, values, valid, phi_q[:, 0], q_scale[:, 0],
                               k_scale + layer.window.log_gain, layer.feature_map.scaling, cache.state)
        return o[:, None]

    @classmethod
    def ring_step(cls, layer: nn.Module,
                  q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: StaticStateLayer,
                  backend: str = "auto") -> torch.Tensor:
        """One static decode step on a ring of W key slots: the key leaving the window (the oldest, in slot position
        mod W) is folded into the state, the new key takes its slot. Fixed shapes and in-place updates only, with the
        position read from the cache's tensor, so a CUDA graph can replay it. q [B, 1, H, D], k and v [B, 1, Hkv, D]
        -> o [B, 1, H, D]. On CUDA (or with backend triton) a PRF map runs it as one kernel (`one_kernel_ring`);
        otherwise `fold` and `read_exact`, as the growing cache's `decode_step` (the ring's order does not matter:
        an exact key's weight does not depend on its distance)."""
        if not layer.runs("ring_step"):
            raise UserError(f"static decoding runs a window hybrid's ring step, which does not compute every part of "
                            f"this layer ({layer.attention.describe()}); decode with HF generate")
        ring = cache.part("window")
        if cls.one_kernel_ring(layer, q, cache, backend):
            from dofattn.ops import load_triton
            if cache.arrivals is None or cache.arrivals.shape[0] != q.shape[0]:
                cache.arrivals = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
            sink = cache.parts.get("sink", SinkState())                         # no sink: None tensors
            return load_triton()[0].window.prf_ring_step(
                layer.feature_map.prf(), q, k, v, cache.state, ring.keys, ring.values, ring.valid, cache.position,
                layer.window.log_gain, MAX_KEY_EXCESS, sink_keys=sink.keys, sink_values=sink.values,
                sink_valid=sink.valid, arrivals=cache.arrivals, **layer.step_arguments(v))
        slot = ring_slot(cache.position, layer.window.width)                              # [1]: the oldest key's slot
        state, k_scale = cls.fold(layer, cache.state, ring.keys.index_select(1, slot)[:, 0],
                                  ring.values.index_select(1, slot)[:, 0],
                                  ring.valid.index_select(1, slot)[:, 0], torch.float32, v)
        cache.state.copy_(state)
        ring.keys.index_copy_(1, slot, k)
        ring.values.index_copy_(1, slot, v)
        ring.valid.index_fill_(1, slot, True)
        return cls.read_exact(layer, q, cache, k_scale, torch.float32).to(q.dtype)

    @classmethod
    def naive(cls, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, rows: bool,
              gain: bool, at: torch.Tensor | None) -> torch.Tensor:
        """`LinearAttention.naive` after the parts' inputs: the exact keys (the last W, the first S) weigh as the
        teacher's kernel, the linear pairs as the features' with the parts' op arguments (`ops.window.window_logits`;
        `gain`: with the window's learned gain on the linear part)."""
        a, fmap = layer.attention, layer.feature_map
        q_rows = q if at is None else q[:, at]
        phi_q, q_scale = fmap.features(q_rows, "query")
        phi_k, k_scale = fmap.features(k, "key")
        sink = first_keys(None, k.shape[0], k.shape[1], a.sink, k.device) if a.sink else None
        logits, _ = window_logits(q_rows, k, phi_q, phi_k, q_scale,
                                  k_scale + layer.window.log_gain if gain else k_scale, fmap.scaling, a.window,
                                  sink_mask=sink, query_at=at, **layer.op_arguments(v))
        return torch.log_softmax(logits, -1).clamp_min(math.log(TINY)) if rows else logits

    @classmethod
    def needs_calibration(cls, layer: nn.Module) -> bool:
        """Whether the linear part's mass must be put on the exact keys' scale before training (`calibrate`): for a
        map that does not estimate the kernel itself."""
        return not layer.feature_map.estimates_kernel

    @classmethod
    @torch.no_grad()
    def calibrate(cls, layer: nn.Module, q: torch.Tensor, k: torch.Tensor) -> None:
        """Set the window's `log_gain` so that, per head, the linear part's mass beyond the window matches the exact
        kernel's on average (in log space) over these queries and keys [B, T, H, D] (k on query heads). For maps
        whose scale is not the kernel's own (hedgehog, dijiang), whose estimate can be off by e^50 at the start;
        PRF needs none."""
        if q.shape[1] <= layer.window.width:
            return
        logits = layer.naive(q, k, rows=False, gain=False)
        far = layer.attention.linear_pairs(q.shape[1], q.device)                          # the linear pairs
        exact = attention_logits(q, k, layer.feature_map.scaling)
        exact_mass = torch.logsumexp(exact.masked_fill(~far, -torch.inf), -1)              # [B, H, T]
        linear_mass = torch.logsumexp(logits.masked_fill(~far, -torch.inf), -1)
        rows = torch.isfinite(exact_mass) & torch.isfinite(linear_mass)
        gap = torch.where(rows, exact_mass - linear_mass, 0).sum((0, 2)) / rows.sum((0, 2)).clamp_min(1)
        layer.window.log_gain.copy_(gap)
