"""The window hybrid's forms, as a mixin of `LinearAttention` (beside `linear.LinearBranch`): exact softmax over
the last W keys (`exact.Window`) and the first S (`exact.Sink`), the linear branch beyond, in one normalisation.

Every form runs the op: a prefill or a cached call `window_linear_attention` (the cache's keys still inside the
window come first; a sink's S slots first of all, without positions); a steady decode step (one token, the window
full: `lean_step_ok`), on the growing cache or a static ring, `fold_key` and `window_decode_step` (on SmolLM2 384
aten operators a layer against the general call's 637); or on CUDA with a PRF map a ring step the Triton kernel
`ops.triton.window.prf_ring_step`. The forms read the layer's feature map, decay and kv expansion; the parts
(`Window`, `Sink`) own their parameters and cache state (`cache.part("window")`, a `WindowState`: a ring of W
slots in a static slot; `cache.part("sink")`, a `SinkState`) and read nothing of the layer. The other parts come in
through the op's arguments (`op_arguments`); a fast form runs only where every part says it can (`runs`).
"""

from __future__ import annotations

import torch

from dofattn.attention.cache import LinearStateLayer, StaticStateLayer, keep_buffer, ring_slot
from dofattn.attention.exact import SinkState
from dofattn.errors import UserError
from dofattn.features import MAX_KEY_EXCESS, in_model_dtype
from dofattn.ops.naive import needs_grad
from dofattn.ops.window import (PRFStep, first_keys, fold_key, prf_step_constants, prf_window_decode_step,
                                window_decode_step, window_linear_attention)


class WindowBranch:
    """The forms of a `LinearAttention` with a window (see its docstring)."""

    def window_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                      state: torch.Tensor | None, output_final_state: bool, backend: str,
                      sink_mask: torch.Tensor | None, lead: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`LinearAttention.attend` with a window: q [B, T, H, D], k and v [B, Tk, H, D] (Tk > T: cached keys come
        first, after `lead` sink slots) -> (o [B, T, H, D], state or None). With a sink and no `sink_mask`, the call
        starts a sequence: its first S real keys are the sink."""
        sink = self.attention.sink
        if sink and sink_mask is None:
            sink_mask = first_keys(key_valid, k.shape[0], k.shape[1], sink, k.device)
        fmap = self.feature_map
        phi_q, q_scale = fmap.features(q, "query")                             # [B, T, H, M], [B, T, H]
        phi_k, k_scale = fmap.features(k, "key")                               # [B, Tk, H, M], [H]
        phi_q, phi_k = in_model_dtype(phi_q, q.dtype), in_model_dtype(phi_k, q.dtype)
        if key_valid is not None:   # the cached keys come first: a rule on left padding holds beside them
            self.check_padding(key_valid[:, lead:])
        return window_linear_attention(q, k, v, phi_q, phi_k, q_scale, k_scale + self.window.log_gain, fmap.scaling,
                                       self.window.width, key_valid, state, output_final_state=output_final_state,
                                       backend=backend, sink_mask=sink_mask, lead=lead, **self.op_arguments(v))

    def window_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                    cache: LinearStateLayer, backend: str) -> torch.Tensor:
        """A cached call of the hybrid: q [B, T, H, D], k and v [B, T, Hkv, D] -> o [B, T, H, D]. A ring (static
        decoding) takes `ring_step`, a steady decode step `decode_step`. Otherwise the keys go in as [the sink's S
        slots, the cache's keys still inside the window (each with its padding flag), the new keys]; the keys the
        sink takes stay exact for the later queries and leave the window's keys (no key counts twice), and the last
        W of the rest stay for the next call. The first call of a sequence (empty slots) puts nothing first: its keys
        are its own, as many as its queries, so a CUDA prefill takes the Triton hybrid."""
        if isinstance(cache, StaticStateLayer):
            return self.ring_step(q, k, v, cache, backend)
        if self.lean_step_ok(q, cache):
            return self.decode_step(q, k, v, key_valid, cache)
        B, T = k.shape[:2]
        if key_valid is None:
            key_valid = torch.ones(B, T, dtype=torch.bool, device=k.device)
        sink = self.sink
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
        o, state = self.window_attend(q, self.expand_kv(keys), self.expand_kv(values), valid, cache.state, True,
                                      backend, sink_mask, lead)
        keep_buffer(cache, "state", state)
        window_valid = valid[:, lead:]
        if sink is not None:   # a key the sink holds is not a window key: none counts twice
            sink.store(cache, k, v, taken)
            window_valid = torch.cat([window_valid[:, :-T], window_valid[:, -T:] & ~taken], 1)
        self.window.keep(cache, keys[:, lead:], values[:, lead:], window_valid)
        return o


    def one_kernel_ring(self, q: torch.Tensor, cache: StaticStateLayer, backend: str) -> bool:
        """True when this ring step runs as one Triton kernel (`ops.triton.window.prf_ring_step`): backend auto on
        CUDA, or backend triton (on CPU: Triton's interpreter, for tests); a PRF map with a calibrated key shift, in
        eval mode, no autograd, a contiguous float32 state. Reads nothing from the GPU per step (the calibration
        once)."""
        fmap = self.feature_map
        if not (backend == "triton" or (backend == "auto" and q.is_cuda)):
            return False
        if needs_grad(q, *self.parameters()):
            return False
        from dofattn.ops import load_triton
        return (self.runs("prf_ring_step") and fmap.prf() is not None and fmap.settled()
                and cache.state is not None and cache.state.dtype == torch.float32 and cache.state.is_contiguous()
                and load_triton()[0] is not None)

    def lean_step_ok(self, q: torch.Tensor, cache: LinearStateLayer) -> bool:
        """True when this cached call is a steady decode step, which `decode_step` gives with the general call's
        numbers: one query, a full window of W cached keys, a full sink, and a feature map that the keys no longer
        move (eval mode; a PRF map's key shift calibrated). Syncs with a GPU only until a cache's sink is full."""
        fmap, last = self.feature_map, cache.part("window")
        if (not self.runs("lean_step") or q.shape[1] != 1 or not fmap.settled() or cache.state is None
                or last.keys is None or last.keys.shape[1] != self.window.width):
            return False
        return self.sink is None or self.sink.ready(cache)

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                    cache: LinearStateLayer) -> torch.Tensor:
        """A steady decode step (`lean_step_ok`) on the growing-list cache: the oldest cached key leaves the window
        and joins the state, the new key joins the window, and the query reads [sinks, window] exactly and the
        state. q [B, 1, H, D], k and v [B, 1, Hkv, D] -> o [B, 1, H, D]."""
        last = cache.part("window")
        if key_valid is None:          # a real token: no padding can follow a real one
            key_valid = last.valid.new_ones(k.shape[:2])
        else:                          # as the general call (a decay: no padding after a real token)
            self.check_padding(torch.cat([last.valid, key_valid], 1))
        old = last.keys[:, 0], last.values[:, 0], last.valid[:, 0]                # the key leaving the window
        last.keys, last.values = torch.cat([last.keys[:, 1:], k], 1), torch.cat([last.values[:, 1:], v], 1)
        last.valid = torch.cat([last.valid[:, 1:], key_valid], 1)
        if self.prf_step_ok(q, cache):
            o = prf_window_decode_step(q[:, 0], *old, *self.exact_keys(cache), cache.state, self.step_constants(v))
            return o[:, None]
        state, k_scale = self.fold(cache.state, *old, q.dtype, v)
        keep_buffer(cache, "state", state)
        return self.read_exact(q, cache, k_scale, q.dtype)

    def prf_step_ok(self, q: torch.Tensor, cache: LinearStateLayer) -> bool:
        """True when a steady decode step runs as `ops.window.prf_window_decode_step` (few operations, the state
        updated in place): a PRF map, float32, a contiguous state, no autograd (a window has no gate: `spec`); else
        `fold` and `read_exact`."""
        return (self.runs("prf_window_step") and self.feature_map.prf() is not None
                and q.dtype == torch.float32
                and cache.state.dtype == torch.float32 and cache.state.is_contiguous()
                and not needs_grad(q, *self.parameters()))

    def step_constants(self, v: torch.Tensor) -> PRFStep:
        """The PRF step's constants (`ops.window.prf_step_constants`, with the parts' op arguments for the values v
        [B, 1, Hkv, D]), made again only when a tensor of the layer changed (its storage or its version: an optimizer
        step, a load, a move)."""
        key = self.tensor_versions()
        held = self._step_constants
        if held is None or held[0] != key:
            held = key, prf_step_constants(self.feature_map.prf(), self.window.log_gain, self.num_kv_heads,
                                           MAX_KEY_EXCESS, **self.step_arguments(v))
            self._step_constants = held
        return held[1]

    def exact_keys(self, cache: LinearStateLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys, values and flags a query reads exactly: the sink's, then the window's ([B, S + W, Hkv, D])."""
        held = ([cache.part("sink")] if self.sink is not None else []) + [cache.part("window")]
        return tuple(torch.cat([getattr(slots, name) for slots in held], 1) for name in ("keys", "values", "valid"))

    def fold(self, state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor,
             dtype: torch.dtype, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the state after the key [B, Hkv, D] with its value leaves the window, the keys' log-scale [H]): a key
        that is padding or a sink (`valid` [B] False) adds nothing (with a decay, the state still decays: a step
        passed; the parts' op arguments read this step's values v [B, 1, Hkv, D]). Features rounded to `dtype` if
        it is 16-bit (as `attend` does for a 16-bit model; the static ring keeps them in float32, as its one-kernel
        step)."""
        phi, k_scale = self.feature_map.features(self.expand_kv(key[:, None]), "key")      # [B, 1, H, M], [H]
        phi = in_model_dtype(phi, dtype)[:, 0]
        phi = phi * valid[:, None, None].to(phi.dtype)
        return fold_key(state, phi, self.expand_kv(value[:, None])[:, 0], **self.step_arguments(v)), k_scale

    def read_exact(self, q: torch.Tensor, cache: LinearStateLayer, k_scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        """The query q [B, 1, H, D] against the cache's sinks and window keys (exact) and its state -> [B, 1, H, D]
        (`ops.window.window_decode_step`); its features rounded to `dtype` if 16-bit, as in `fold`."""
        keys, values, valid = self.exact_keys(cache)
        phi_q, q_scale = self.feature_map.features(q, "query")                             # [B, 1, H, M]
        phi_q = in_model_dtype(phi_q, dtype)
        o = window_decode_step(q[:, 0], keys, values, valid, phi_q[:, 0], q_scale[:, 0], k_scale + self.window.log_gain,
                               self.feature_map.scaling, cache.state)
        return o[:, None]

    def ring_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: StaticStateLayer,
                  backend: str = "auto") -> torch.Tensor:
        """One static decode step on a ring of W key slots: the key leaving the window (the oldest, in slot position
        mod W) is folded into the state, the new key takes its slot. Fixed shapes and in-place updates only, with the
        position read from the cache's tensor, so a CUDA graph can replay it. q [B, 1, H, D], k and v [B, 1, Hkv, D]
        -> o [B, 1, H, D]. On CUDA (or with backend triton) a PRF map runs it as one kernel (`one_kernel_ring`);
        otherwise `fold` and `read_exact`, as the growing cache's `decode_step` (the ring's order does not matter:
        an exact key's weight does not depend on its distance)."""
        if not self.runs("ring_step"):
            raise UserError(f"static decoding runs a window hybrid's ring step, which does not compute every part of "
                            f"this layer ({self.attention.describe()}); decode with HF generate")
        ring = cache.part("window")
        if self.one_kernel_ring(q, cache, backend):
            from dofattn.ops import load_triton
            if cache.arrivals is None or cache.arrivals.shape[0] != q.shape[0]:
                cache.arrivals = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
            sink = cache.parts.get("sink", SinkState())                         # no sink: None tensors
            return load_triton()[0].window.prf_ring_step(
                self.feature_map.prf(), q, k, v, cache.state, ring.keys, ring.values, ring.valid, cache.position,
                self.window.log_gain, MAX_KEY_EXCESS, sink_keys=sink.keys, sink_values=sink.values,
                sink_valid=sink.valid, arrivals=cache.arrivals, **self.step_arguments(v))
        slot = ring_slot(cache.position, self.window.width)                               # [1]: the oldest key's slot
        state, k_scale = self.fold(cache.state, ring.keys.index_select(1, slot)[:, 0],
                                   ring.values.index_select(1, slot)[:, 0],
                                   ring.valid.index_select(1, slot)[:, 0], torch.float32, v)
        cache.state.copy_(state)
        ring.keys.index_copy_(1, slot, k)
        ring.values.index_copy_(1, slot, v)
        ring.valid.index_fill_(1, slot, True)
        return self.read_exact(q, cache, k_scale, torch.float32).to(q.dtype)
