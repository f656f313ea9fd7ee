"""Sliding-window hybrid attention: exact softmax over the last W keys, linear attention beyond, one normalisation.

    o, state = window_linear_attention(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling, window=64)

For the query at position t (keys at positions s ≤ t), every key gets one unnormalised weight:
    s > t − W:   exp(scaling · q_t·k_s)                                   (exact, the softmax kernel)
    s ≤ t − W:   φq_t·φk_s · exp(q_log_scale_t + log_offset_h)           (the feature-map estimate of it)
plus the state's mass φq_t·S_0[den] · exp(q_log_scale_t + log_offset_h) for keys before this call, and
o_t = Σ weight·v / Σ weight. `q_log_scale` [B, T, H] and `log_offset` [H] undo the feature map's numerical shifts
(see `FeatureMap.features`) and carry a learned per-head gain, so both parts are on one scale. The key shift is one
constant per head, so it lives in `log_offset` and the state never mixes shifts.

Layout: q [B, T, H, D] (raw, after RoPE); k, v [B, Tk, H, D] with Tk ≥ T: the queries are the last T positions,
the first P = Tk − T keys are a cache of past keys still inside the window (generation). phi_q [B, T, H, M], phi_k
[B, Tk, H, M]; key_valid [B, Tk] (False: padding, never attended); initial_state [B, H, M, V+1] holds every key
before the Tk given ones. The final state [B, H, M, V+1] holds every key except the last W: the caller keeps
those W keys (and values) as the next call's cache, so generation memory is O(W + M·V), flat in context length.

Attention sink (optional): sink_mask [B, Tk] marks keys that stay exact for every later query, however far back,
and never enter the linear part or the state: the first few real tokens of a sequence, on which a trained model's
late layers put much of each row. The mask is positional only through the caller: a cached call may put the sink
keys first (before the cached window keys), since an exact key's weight does not depend on its distance: `lead`
says how many keys come first that way, so that a decay counts positions after them. A sink is never decayed.

Decay (optional): log_decay [H] (≤ 0, as in `ops.naive`) multiplies the linear part's weight of key s by
γ_h^(t − W − s): the steps the key has spent beyond the window, so a key leaving the window enters the linear part
at full weight, and the exact part is the teacher's kernel, undecayed. The state is kept as of the newest key it
holds (the one that left the window last): it reaches the query at t as γ^(t + 1 − min(P, W)), with P = Tk − T the
cached keys (P = W once the context is longer than the window), and the final state is as of key Tk − 1 − W. In
the fast form this is the linear op's own decay run on the delayed keys, from position min(P, W) on.

Two implementations with the same signature:
    naive_window_linear_attention   the spec: one [T, Tk] logit matrix (plus a column for the state), row softmax
    window_linear_attention         the fast form: banded exact attention in blocks of W plus the linear op run on
                                    keys delayed by W (any `ops` backend), mixed in log space: with ō_w, λ_w the
                                    window's softmax output and log-mass and ō_l, λ_l the linear part's,
                                    o = σ(λ_w − λ_l)·ō_w + σ(λ_l − λ_w)·ō_l.
Both compute in float32 (float64 if any input is), return o in v.dtype, and give 0 for a query with no valid key.

One decode step, the spec's row for a single query, in few operations (a CPU decode step is bound by their count):
    o = window_decode_step(q, keys, values, valid, phi_q, q_log_scale, log_offset, scaling, state)
takes the keys this query sees exactly on the kv heads (sinks and window in any order: an exact weight does not
depend on distance) and the state already holding every key beyond the window (the caller folds the key that
leaves it in with `fold_key`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dofattn.ops import linear_attention
from dofattn.ops.prf import PRFMap
from dofattn.ops.naive import (TINY, check_log_decay, compute_dtype, decay_factors, decay_log, delayed_keys,
                               log_decay_matrix, needs_grad, valid_and)

DENSE_QUERIES = 16   # up to this many queries, backend "auto" takes the dense form (decode steps)

__all__ = ["naive_window_linear_attention", "window_linear_attention", "blocked_window_linear_attention",
           "window_parts",
           "window_decode_step", "fold_key", "window_logits", "window_pairs", "check_window_inputs", "sink_softmax",
           "mix_parts"]


def check_window_inputs(q, k, v, phi_q, phi_k, q_log_scale, log_offset, window, key_valid, initial_state,
                        log_decay=None, sink_mask=None, lead: int = 0) -> None:
    """ValueError saying what is wrong unless the shapes follow the layout in the module docstring."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, T, H, D = q.shape
    Tk = k.shape[1]
    if k.shape != (B, Tk, H, D) or v.shape[:3] != (B, Tk, H) or Tk < T:
        raise ValueError(f"k must be [B, Tk, H, D] and v [B, Tk, H, V] with Tk >= T, for q {tuple(q.shape)}; got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if phi_q.shape[:3] != (B, T, H) or phi_k.shape[:3] != (B, Tk, H) or phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(f"phi_q must be [B, T, H, M] and phi_k [B, Tk, H, M]; got {tuple(phi_q.shape)}, "
                         f"{tuple(phi_k.shape)}")
    if q_log_scale.shape != (B, T, H) or log_offset.shape != (H,):
        raise ValueError(f"q_log_scale must be [B, T, H] and log_offset [H]; got {tuple(q_log_scale.shape)}, "
                         f"{tuple(log_offset.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if key_valid is not None and key_valid.shape != (B, Tk):
        raise ValueError(f"key_valid must be [B, Tk] = {(B, Tk)}, got {tuple(key_valid.shape)}")
    expected = (B, H, phi_q.shape[-1], v.shape[-1] + 1)
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state must be [B, H, M, V+1] = {expected}, got {tuple(initial_state.shape)}")
    check_log_decay(log_decay, H)
    if sink_mask is not None:
        if sink_mask.shape != (B, Tk) or sink_mask.dtype != torch.bool:
            raise ValueError(f"sink_mask must be bool [B, Tk] = {(B, Tk)}, got {sink_mask.dtype} "
                             f"{tuple(sink_mask.shape)}")
    if not 0 <= lead <= Tk - T or (lead and sink_mask is None):
        raise ValueError(f"lead = {lead}: the sink slots put before the cached keys are at most the {Tk - T} cached "
                         f"keys, and marked in sink_mask")


def first_keys(key_valid: torch.Tensor | None, batch: int, length: int, count: int, device,
               had: torch.Tensor | int = 0) -> torch.Tensor:
    """[B, Tk] bool: the first `count` real keys of each row (all of them if a row has fewer), the sink: of a call
    that starts a sequence, or of a later call of a row that had `had` ([B, 1], or a number) sink keys before it.
    key_valid [B, Tk] or None (every key real). The one place the sink's rule is written."""
    if key_valid is None:
        return (torch.arange(length, device=device) < count - had).expand(batch, length)
    return key_valid & (had + key_valid.cumsum(1) <= count)


def _log(x: torch.Tensor) -> torch.Tensor:
    """log x with −inf (and a zero gradient, not NaN) where x == 0."""
    return torch.where(x > 0, torch.log(x.clamp_min(TINY)), -torch.inf)


def window_pairs(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int,
                 sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, linear): bool masks of the causal pairs of queries at `pos_q` and keys at `pos_k` (broadcasting, e.g.
    [T, 1] and [1, Tk]). Exact: the key is one of the query's last `window` tokens, or a sink key (`sink`, True where
    a key is one; broadcasting against the pairs) not after the query; linear: every other earlier key. The one
    place the window and sink rule is written (`window_logits`, `sink_softmax`, `spec.Attention.linear_pairs`, the
    bounded cache's mask)."""
    causal = pos_k <= pos_q
    exact = causal & (pos_k > pos_q - window)
    linear = causal & ~exact
    if sink is not None:
        exact, linear = exact | (sink & causal), linear & ~sink
    return exact, linear


def window_logits(q, k, phi_q, phi_k, q_log_scale, log_offset, scaling: float, window: int,
                  key_valid=None, initial_state=None, log_decay=None,
                  sink_mask=None, lead: int = 0, query_at=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-weights of the spec: [B, H, T, Tk] over keys (−inf where masked), and [B, H, T] for the state.
    `query_at` [T]: the queries' positions among the keys (default: the last T), so that a few rows of a long
    sequence cost T·Tk, not Tk².

    The layerwise softmax loss uses these rows directly; `naive_window_linear_attention` normalises them.
    """
    dtype = compute_dtype(q, k, phi_q, phi_k, initial_state)
    T = q.shape[1]
    Tk = k.shape[1]
    pos_q = (torch.arange(Tk - T, Tk, device=q.device) if query_at is None else query_at)[:, None]   # [T, 1]
    pos_k = torch.arange(Tk, device=q.device)[None, :]                   # [1, Tk]
    sink = None if sink_mask is None else sink_mask[:, None, None, :]   # [B, 1, 1, Tk]: exact whatever the distance
    near, far = window_pairs(pos_q, pos_k, window, sink)                  # [T, Tk], or [B, 1, T, Tk] with a sink
    shift = q_log_scale.to(dtype).permute(0, 2, 1)[..., None] + log_offset.to(dtype)[None, :, None, None]
    exact = scaling * torch.einsum("bthd,bshd->bhts", q.to(dtype), k.to(dtype))
    linear = _log(torch.einsum("bthm,bshm->bhts", phi_q.to(dtype), phi_k.to(dtype))) + shift
    if log_decay is not None:                                            # γ^(t − W − s) beyond the window
        log_decay = decay_log(log_decay, dtype)
        linear = linear + log_decay_matrix(log_decay, T, Tk, offset=-window, at=pos_q[:, 0])[0]
    logits = torch.where(near, exact, torch.where(far, linear, -torch.inf))
    if key_valid is not None:
        logits = logits.masked_fill(~key_valid[:, None, None, :], -torch.inf)
    state_logit = None
    if initial_state is not None:
        den = torch.einsum("bthm,bhm->bht", phi_q.to(dtype), initial_state[..., -1].to(dtype))
        state_logit = _log(den) + shift[..., 0]                         # [B, H, T]
        if log_decay is not None:                                        # γ^(t + 1 − min(P, W)), after the lead
            steps = (pos_q[:, 0] - lead + 1 - min(Tk - T - lead, window)).to(dtype)   # [T], ≥ 1
            state_logit = state_logit + log_decay[:, None] * steps
    return logits, state_logit


def naive_window_linear_attention(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling: float, window: int,
                                  key_valid=None, initial_state=None, output_final_state: bool = False,
                                  log_decay=None, sink_mask=None, lead: int = 0):
    """The spec: softmax over one row of log-weights per query (see the module docstring). O(T·Tk) memory."""
    check_window_inputs(q, k, v, phi_q, phi_k, q_log_scale, log_offset, window, key_valid, initial_state, log_decay,
                        sink_mask, lead)
    dtype = compute_dtype(q, k, v, phi_q, phi_k, initial_state)
    logits, state_logit = window_logits(q, k, phi_q, phi_k, q_log_scale, log_offset, scaling, window, key_valid,
                                        initial_state, log_decay, sink_mask, lead)
    values = v.to(dtype).transpose(1, 2)                                 # [B, H, Tk, V]
    Tk = k.shape[1]
    if state_logit is not None:
        S0 = initial_state.to(dtype)
        num = torch.einsum("bthm,bhmv->bhtv", phi_q.to(dtype), S0[..., :-1])
        den = torch.einsum("bthm,bhm->bht", phi_q.to(dtype), S0[..., -1])
        state_value = num / den.clamp_min(TINY)[..., None]               # [B, H, T, V]
        logits = torch.cat([logits, state_logit[..., None]], dim=-1)     # [B, H, T, Tk+1]
    row_max = logits.amax(-1, keepdim=True)
    weights = torch.exp(logits - torch.where(torch.isfinite(row_max), row_max, 0))
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(TINY)   # all-masked rows stay 0
    o = torch.einsum("bhts,bhsv->bthv", weights[..., :Tk], values)
    if state_logit is not None:
        o = o + (weights[..., Tk:] * state_value).transpose(1, 2)
    final_state = None
    if output_final_state:
        linear_keys = key_valid if sink_mask is None else valid_and(key_valid, ~sink_mask)
        final_state = _fold_state(phi_k, v, window, linear_keys, initial_state, dtype, log_decay, Tk - q.shape[1],
                                  lead)
    return o.to(v.dtype), final_state


def window_decode_step(q, keys, values, valid, phi_q, q_log_scale, log_offset, scaling: float, state):
    """The spec's output for one query per row, on kv heads, in about thirty small operations (a decode step).

    q [B, H, D]; keys [B, N, Hkv, D], values [B, N, Hkv, V], valid [B, N] bool: the keys this query sees exactly
    (the window, the new key among them, and the sinks, in any order); phi_q [B, H, M], q_log_scale [B, H],
    log_offset [H] as in the spec; state [B, H, M, V+1]: every key beyond the window. -> o [B, H, V] in
    values.dtype, computed in float32 (float64 if any input is); 0 for a row with no valid key and an empty state.
    Equal to the last row of `naive_window_linear_attention` on the same keys (decay: folded into the state).
    """
    B, N, Hkv, D = keys.shape
    H, V = q.shape[1], values.shape[-1]
    dtype = compute_dtype(q, keys, values, phi_q, state)
    G = H // Hkv                                                         # query heads per kv head
    exact = torch.matmul(q.to(dtype).reshape(B, Hkv, G, D), keys.to(dtype).permute(0, 2, 3, 1))   # [B, Hkv, G, N]
    exact = (scaling * exact).masked_fill(~valid[:, None, None, :], -torch.inf).reshape(B, H, N)
    read = torch.matmul(phi_q.to(dtype)[:, :, None, :], state.to(dtype))[:, :, 0]                  # [B, H, V+1]
    den = read[..., -1]
    state_logit = _log(den) + q_log_scale.to(dtype) + log_offset.to(dtype)                         # [B, H]
    logits = torch.cat([exact, state_logit[..., None]], -1)                                        # [B, H, N+1]
    top = logits.amax(-1, keepdim=True)
    weights = torch.exp(logits - torch.where(torch.isfinite(top), top, 0))
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(TINY)
    o = torch.matmul(weights[..., :N].reshape(B, Hkv, G, N), values.to(dtype).transpose(1, 2))    # [B, Hkv, G, V]
    o = o.reshape(B, H, V) + weights[..., N:] * read[..., :-1] / den.clamp_min(TINY)[..., None]
    return o.to(values.dtype)


class PRFStep(NamedTuple):
    """A PRF window layer's constants for `prf_window_decode_step`, laid out for its matrix products
    (`prf_step_constants`); fixed while the layer's parameters are."""

    query_directions: torch.Tensor   # [H, D, M]: √s·z_m, transposed
    key_directions: torch.Tensor     # [Hkv, D, G·M]: the same for the G query heads of each kv head, side by side
    query_bias: torch.Tensor         # [H, 1, M]: ½ log α
    key_bias: torch.Tensor           # [Hkv, 1, G·M]: ½ log α − the key shift
    log_offset: torch.Tensor         # [H]: the key shift − log M + the window's log-gain
    decay: torch.Tensor | None       # [H, 1, 1]: γ_h, or None
    scaling: float
    max_excess: float


def prf_step_constants(prf: PRFMap, log_gain, num_kv_heads: int, max_excess: float, log_decay=None) -> PRFStep:
    """A PRF map's numbers (`ops.prf.PRFMap`: directions [H, M, D], log-weights [H, M], the calibrated key shift
    [H], the softmax scaling), the window's log-gain [H], the kv heads, the key exponent's cap and log γ [H] (or
    None), as `PRFStep`."""
    directions, log_weights, key_shift, scaling = prf.directions, prf.log_weights, prf.key_shift, prf.scaling
    H, M, D = directions.shape
    G = H // num_kv_heads
    z = (directions.float() * math.sqrt(scaling)).transpose(1, 2)                           # [H, D, M]
    key_directions = z.reshape(num_kv_heads, G, D, M).permute(0, 2, 1, 3).reshape(num_kv_heads, D, G * M)
    half = 0.5 * log_weights.float()
    key_bias = (half - key_shift.float()[:, None]).reshape(num_kv_heads, 1, G * M)
    decay = None if log_decay is None else decay_log(log_decay, torch.float32).exp()[:, None, None]
    return PRFStep(z.contiguous(), key_directions.contiguous(), half[:, None].contiguous(), key_bias.contiguous(),
                   (key_shift.float() - math.log(M) + log_gain.float()).contiguous(), decay, float(scaling),
                   float(max_excess))


@torch.no_grad()
def prf_window_decode_step(q, old_key, old_value, old_valid, exact_keys, exact_values, exact_valid, state,
                           constants: PRFStep):
    """A steady decode step of a PRF window hybrid on a CPU, in few operations (eval, no autograd, float32): the key
    leaving the window folds into the state (in place), then the query reads the exact keys and the state. Equal to
    `fold_key` (with the map's key features) then `window_decode_step` (with its query features).

    q [B, H, D]; old_key, old_value [B, Hkv, D] and old_valid [B] the key leaving the window; exact_keys,
    exact_values [B, N, Hkv, D] and exact_valid [B, N] the keys read exactly (sinks and window, the new key among
    them); state [B, H, M, V+1] float32, contiguous, updated in place; `constants` the layer's
    (`prf_step_constants`). -> o [B, H, V] float32."""
    B, N, Hkv, D = exact_keys.shape
    H, _, M = constants.query_directions.shape
    G, V = H // Hkv, old_value.shape[-1]
    half_s = 0.5 * constants.scaling
    # the leaving key's features, on the G query heads of its kv head at once: [Hkv, B, G·M]
    x = old_key.transpose(0, 1)                                                              # [Hkv, B, D]
    e = torch.baddbmm(constants.key_bias, x, constants.key_directions) - half_s * (x * x).sum(-1, keepdim=True)
    phi_k = e.masked_fill_(~old_valid[None, :, None], -torch.inf).clamp_(max=constants.max_excess).exp_()
    if constants.decay is not None:
        state.mul_(constants.decay)
    state.view(B * Hkv, G * M, V + 1).baddbmm_(phi_k.transpose(0, 1).reshape(B * Hkv, G * M, 1),
                                               F.pad(old_value, (0, 1), value=1.0).view(B * Hkv, 1, V + 1))
    # the query: its features (shifted by their max), its read of the state, its exact logits
    eq = torch.baddbmm(constants.query_bias, q.transpose(0, 1), constants.query_directions)  # [H, B, M]
    shift = eq.amax(-1, keepdim=True)
    phi_q = (eq - shift).exp_().transpose(0, 1).reshape(B * H, 1, M)
    read = torch.bmm(phi_q, state.view(B * H, M, V + 1)).view(B, H, V + 1)
    den = read[..., V]
    log_state = torch.log(den.clamp_min(TINY)) + shift[..., 0].t() - half_s * (q * q).sum(-1) + constants.log_offset
    log_state = log_state.masked_fill_(den <= 0, -torch.inf)
    exact = torch.matmul(q.reshape(B, Hkv, G, D), exact_keys.permute(0, 2, 3, 1)).mul_(constants.scaling)
    exact = exact.reshape(B, H, N).masked_fill_(~exact_valid[:, None, :], -torch.inf)
    weights = torch.softmax(torch.cat([exact, log_state.unsqueeze(-1)], -1), -1).nan_to_num_(0.0)
    o = torch.matmul(weights[..., :N].reshape(B, Hkv, G, N), exact_values.transpose(1, 2)).reshape(B, H, V)
    return o.addcmul_(weights[..., N:], read[..., :V] / den.clamp_min(TINY)[..., None])


def fold_key(state, phi_k, value, log_decay=None):
    """The state after one key leaves the window: γ·S + φk ⊗ [v, 1]. state [B, H, M, V+1]; phi_k [B, H, M] (zero
    for a key that must not count: padding, a sink); value [B, H, V]; log_decay [H] or None. Out of place, in
    state's dtype (float32, or float64 if any input is)."""
    dtype = compute_dtype(state, phi_k, value)
    value = value.to(dtype)
    update = phi_k.to(dtype)[..., None] * torch.cat([value, torch.ones_like(value[..., :1])], -1)[:, :, None, :]
    state = state.to(dtype)
    if log_decay is not None:
        state = torch.exp(decay_log(log_decay, dtype))[:, None, None] * state
    return state + update


def _fold_state(phi_k, v, window, key_valid, initial_state, dtype, log_decay=None, cached: int = 0, lead: int = 0):
    """S_0 plus every key but the last `window`: [B, H, M, V+1]; with a decay, as of key Tk − 1 − W (the key s
    weighs γ^(Tk − 1 − W − s), S_0 γ^(Tk − min(cached, W))), positions counted after the `lead` sink keys (masked
    out of `key_valid`)."""
    Tk = phi_k.shape[1]
    keep = max(Tk - window, 0)
    pk = phi_k[:, :keep].to(dtype)
    if key_valid is not None:
        pk = pk * key_valid[:, :keep, None, None].to(dtype)
    if log_decay is not None:
        log_decay = decay_log(log_decay, dtype)
        pk = pk * decay_factors(log_decay, torch.arange(keep - 1, -1, -1, device=pk.device))[..., None]
    va = v[:, :keep].to(dtype)
    va = torch.cat([va, torch.ones_like(va[..., :1])], dim=-1)
    state = torch.einsum("bthm,bthv->bhmv", pk, va)
    if initial_state is None:
        return state
    S0 = initial_state.to(dtype)
    if log_decay is not None:
        S0 = torch.exp(log_decay * (Tk - lead - min(cached - lead, window)))[:, None, None] * S0
    return state + S0


def _banded_softmax(q, k, v, scaling: float, window: int, key_valid):
    """Exact softmax over keys (t − W, t], in blocks of W: (ō [B, T, H, V], log-mass [B, T, H], any-key [B, T, H])."""
    B, T = q.shape[:2]
    C = window
    N = -(-T // C)

    def blocks(x, front):                                                # [B, T, ...] -> [B, N+front, C, ...]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (front * C, N * C - T))
        return x.view(B, N + front, C, *x.shape[2:])

    qb = blocks(q, 0)                                                    # [B, N, C, H, D]
    kb, vb = blocks(k, 1), blocks(v, 1)                                  # [B, N+1, C, H, *]
    valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_valid is None else key_valid
    validb = blocks(valid[..., None], 1)[..., 0]                         # [B, N+1, C], front block False
    kw = torch.cat([kb[:, :-1], kb[:, 1:]], dim=2)                       # [B, N, 2C, H, D]: previous + own block
    vw = torch.cat([vb[:, :-1], vb[:, 1:]], dim=2)
    validw = torch.cat([validb[:, :-1], validb[:, 1:]], dim=2)           # [B, N, 2C]
    i = torch.arange(C, device=q.device)[:, None]
    j = torch.arange(2 * C, device=q.device)[None, :]
    band = (j > i) & (j <= i + C)                                        # key j − C in (i − W, i]
    scores = scaling * torch.einsum("bnihd,bnjhd->bnhij", qb, kw)        # [B, N, H, C, 2C]
    mask = band[None, None, None] & validw[:, :, None, None, :]
    scores = scores.masked_fill(~mask, -torch.inf)
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0).detach()   # a constant: log-mass adds it back
    p = torch.exp(scores - row_max)
    mass = p.sum(-1)                                                     # [B, N, H, C]
    o = torch.einsum("bnhij,bnjhv->bnihv", p, vw) / mass.clamp_min(TINY).transpose(2, 3)[..., None]
    any_key = mask.any(-1).expand_as(mass)
    log_mass = torch.where(any_key, torch.log(mass.clamp_min(TINY)) + row_max[..., 0], 0)

    def unblock(x):                                                      # [B, N, C, H, ...] -> [B, T, H, ...]
        return x.reshape(B, N * C, *x.shape[3:])[:, :T]

    return unblock(o), unblock(log_mass.transpose(2, 3)), unblock(any_key.transpose(2, 3))


def _sink_span(sink_mask: torch.Tensor) -> int:
    """The keys up to the last sink of any row (sink_mask [B, Tk]): how many a sink part reads."""
    used = sink_mask.any(0).nonzero()
    return int(used.max()) + 1 if used.numel() else 0


def sink_softmax(q, k, v, scaling: float, window: int, sink_mask):
    """Exact softmax over the sink keys at least W before each query (those nearer are the band's), on the layout
    of `blocked_window_linear_attention` (q [B, Tk, H, D]): (ō [B, Tk, H, V], log-mass [B, Tk, H], any-key).
    Computes in q's dtype; only the keys and values up to the last sink are converted to it."""
    B, Tk, H = q.shape[:3]
    L = _sink_span(sink_mask)
    k, v = k[:, :L].to(q.dtype), v[:, :L].to(q.dtype)
    pos_q = torch.arange(Tk, device=q.device)[:, None]
    pos_k = torch.arange(L, device=q.device)[None, :]
    mask = window_pairs(pos_q, pos_k, window)[1][None, None] & sink_mask[:, None, None, :L]   # [B, 1, Tk, L]
    scores = scaling * torch.einsum("bthd,bshd->bhts", q, k)            # [B, H, Tk, L]
    scores = scores.masked_fill(~mask, -torch.inf)
    row_max = scores.amax(-1, keepdim=True) if L else scores.new_zeros(B, H, Tk, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0).detach()
    p = torch.exp(scores - row_max)
    mass = p.sum(-1)                                                     # [B, H, Tk]
    o = torch.einsum("bhts,bshv->bthv", p, v) / mass.clamp_min(TINY).transpose(1, 2)[..., None]
    any_key = mask.any(-1).expand_as(mass)
    log_mass = torch.where(any_key, torch.log(mass.clamp_min(TINY)) + row_max[..., 0], 0)
    return o, log_mass.transpose(1, 2), any_key.transpose(1, 2)


def mix_parts(parts) -> torch.Tensor:
    """Σ_i e^λ_i ō_i / Σ_i e^λ_i over the parts (ō [B, T, H, V], λ [B, T, H], present [B, T, H]) a row has;
    0 for a row with none."""
    lam = torch.stack([torch.where(has, lam, -torch.inf) for _, lam, has in parts])   # [parts, B, T, H]
    top = lam.amax(0)
    top = torch.where(torch.isfinite(top), top, 0).detach()
    weights = [torch.where(has, torch.exp(torch.where(has, lam, top) - top), 0) for _, lam, has in parts]
    total = sum(weights).clamp_min(TINY)
    return sum((w / total)[..., None] * o for (o, _, _), w in zip(parts, weights))


def fused_window_ok(q, k, v, phi_q, phi_k, q_log_scale, log_offset, window, initial_state, backend,
                    log_decay=None, sink_mask=None) -> bool:
    """True when the Triton hybrid (`ops.triton.window.window_forward`) gives this call's result: CUDA, a prefill (as
    many keys as queries), a window in `ops.triton.window.WINDOWS`, no float64, not a decay and a sink together, and
    backend triton, or backend auto without autograd (training takes the Triton backward when asked for by name:
    `backend="triton"`). Asked for by name with a decay and a sink together: a ValueError (the kernel has not been
    confirmed for the pair; backend auto runs the PyTorch form)."""
    from dofattn.ops import load_triton, triton_available

    if log_decay is not None and sink_mask is not None:
        if backend == "triton":
            raise ValueError("the Triton window hybrid does not take a decay and a sink together: use backend auto "
                             "(the PyTorch form)")
        return False
    if backend not in ("auto", "triton") or not q.is_cuda or not triton_available():
        return False
    tensors = (q, k, v, phi_q, phi_k, q_log_scale, log_offset, initial_state)
    if needs_grad(*tensors) and backend != "triton":
        return False
    if any(x is not None and x.dtype == torch.float64 for x in tensors) or k.shape[1] != q.shape[1]:
        return False
    return window in load_triton()[0].window.WINDOWS


def window_linear_attention(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling: float, window: int,
                            key_valid=None, initial_state=None, output_final_state: bool = False,
                            backend: str = "auto", log_decay=None, sink_mask=None, lead: int = 0):
    """The fast form of `naive_window_linear_attention` (same arguments and result up to float rounding).

    `backend` picks the linear op (`ops.linear_attention`); the window part is plain PyTorch, O(T·W) memory.
    With backend "auto" on a CPU without autograd (reading a prompt, evaluating), the block form
    `block_window_linear_attention` (a few dozen operations a call; training keeps the blocked form, whose numbers
    its runs were made with).
    With backend "auto", a call with few queries (decode: T = 1 against W cached keys) runs the spec's dense form,
    which is O(T·Tk) and there cheaper than laying out blocks over all Tk positions. On CUDA without autograd, a
    prefill with a window of 16, 32 or 64 runs in Triton (`ops.triton.window.window_forward`: the linear scan on the
    delayed keys, then one kernel for the exact part and the shared normalisation); backend "triton" takes that
    path with autograd too (its backward is Triton as well), with a decay (`log_decay`) or an attention sink
    (`sink_mask`: its few keys beyond the window are a third block of keys in the exact part's kernel; their
    gradients are computed in PyTorch).
    """
    check_window_inputs(q, k, v, phi_q, phi_k, q_log_scale, log_offset, window, key_valid, initial_state, log_decay,
                        sink_mask, lead)
    if backend == "auto" and q.shape[1] <= DENSE_QUERIES:
        return naive_window_linear_attention(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling, window,
                                             key_valid, initial_state, output_final_state, log_decay, sink_mask, lead)
    if fused_window_ok(q, k, v, phi_q, phi_k, q_log_scale, log_offset, window, initial_state, backend, log_decay,
                       sink_mask):
        from dofattn.ops import load_triton
        return load_triton()[0].window.window_forward(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling,
                                                      window, key_valid, initial_state, output_final_state,
                                                      log_decay=log_decay, sink_mask=sink_mask)
    if backend == "auto" and not q.is_cuda and not needs_grad(q, k, v, phi_q, phi_k, q_log_scale, log_offset,
                                                             initial_state, log_decay):
        return block_window_linear_attention(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling, window,
                                             key_valid, initial_state, output_final_state, log_decay, sink_mask, lead)
    return blocked_window_linear_attention(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling, window,
                                           key_valid, initial_state, output_final_state, backend, log_decay,
                                           sink_mask, lead)


def blocked_window_linear_attention(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling: float, window: int,
                                    key_valid=None, initial_state=None, output_final_state: bool = False,
                                    backend: str = "auto", log_decay=None, sink_mask=None, lead: int = 0):
    """The PyTorch form of the hybrid: banded exact attention in blocks of W, the linear op (`backend`) on keys
    delayed by W, mixed in log space; with a sink, a third part: exact attention to the sink keys beyond the band.
    Differentiable through autograd on any device."""
    parts, final_state = window_parts(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling, window, key_valid,
                                      initial_state, output_final_state, backend, log_decay, sink_mask, lead)
    P = k.shape[1] - q.shape[1]
    if sink_mask is None:
        (o_win, lam_win, has_win), (o_lin, lam_lin, has_lin) = parts
        both = has_win & has_lin
        w_win = torch.where(both, torch.sigmoid(lam_win - lam_lin), has_win.to(o_win.dtype))[..., None]
        o = w_win * o_win + (1 - w_win) * o_lin
    else:
        o = mix_parts(parts)
    return o[:, P:].to(v.dtype), final_state


def _grid(x: torch.Tensor, origin: int, blocks: int, width: int) -> torch.Tensor:
    """[B, L, ...] positions → [B, blocks, width, ...]: position p at block (p − origin) // width, slot
    (p − origin) % width; positions before 0 or past L are zeros (False for a bool mask)."""
    B, L = x.shape[:2]
    front, back = -origin, blocks * width + origin - L
    if front < 0:                                   # the grid starts after position 0: drop those before it
        x, front = x[:, -front:], 0
    pad = (0, 0) * (x.dim() - 2) + (front, back)
    x = F.pad(x.to(torch.uint8), pad).bool() if x.dtype == torch.bool else F.pad(x, pad)
    return x.reshape(B, blocks, width, *x.shape[2:])


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, N, W, H, ...] -> [B, N, H, W, ...], contiguous: each head's block a matrix for the batched products."""
    return x.transpose(2, 3).contiguous()


@torch.no_grad()
def block_window_linear_attention(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling: float, window: int,
                                  key_valid=None, initial_state=None, output_final_state: bool = False,
                                  log_decay=None, sink_mask=None, lead: int = 0):
    """The spec in blocks of W queries, each block's rows one softmax: the CPU's form for reading a prompt (about
    forty operations a call, where `blocked_window_linear_attention` takes a thousand; each of those is a parallel
    region, and with other work on the cores every region waits for a descheduled thread). Same arguments and
    result as the spec, up to float rounding; no gradients (training takes the blocked form).

    Blocks of W positions are laid so that the linear part's first position (`start`, after the cached keys and the
    lead) begins one: a query in block n, at slot i, sees its own block's keys j ≤ i and the previous block's j > i
    exactly (the band), the previous block's j ≤ i as linear pairs (φq·φk, γ^(i − j)), every earlier block through a
    block state R_n (as of the end of block n − 2, read at γ^(i + 1)), and the sink keys exactly. One row holds
    [sink keys, previous block, own block, state] in log space, normalised once, as the spec's row.
    R_n = γ^((n − 1)W) S_0 + Σ_{m ≤ n − 2} γ^((n − 2 − m)W) B_m, B_m a block's keys as of its end: every exponent ≥ 0.
    """
    check_window_inputs(q, k, v, phi_q, phi_k, q_log_scale, log_offset, window, key_valid, initial_state, log_decay,
                        sink_mask, lead)
    dtype = compute_dtype(q, k, v, phi_q, phi_k, initial_state)
    B, T, H, D = q.shape
    Tk, V, C = k.shape[1], v.shape[-1], window
    P = Tk - T
    start = lead + min(P - lead, C)                 # the linear part's first position (after the cached window)
    origin = start - C                              # block 0: [start − W, start); the queries are in blocks ≥ 1
    N = -(-(Tk - origin) // C)
    first = (P - origin) // C                       # the first block holding a query
    Nq = N - first
    valid = torch.ones(B, Tk, dtype=torch.bool, device=q.device) if key_valid is None else key_valid
    plain = valid if sink_mask is None else valid & ~sink_mask          # keys of the band and of the linear part

    # the grid, heads first: keys [B, N, H, W, ·]; queries [B, Nq, H, W, ·] (zero where a position has none)
    keys = lambda x: _heads_first(_grid(x.to(dtype), origin, N, C))
    queries = lambda x: _heads_first(_grid(x.to(dtype), origin - P, N, C)[:, first:])     # query t at position P + t
    plain_g = _grid(plain, origin, N, C)                                                 # [B, N, W]
    kg, vg = keys(k), keys(v)
    pk = keys(phi_k).mul_(plain_g[:, :, None, :, None])                                  # linear keys only
    qg, pq = queries(q), queries(phi_q)
    shift = queries(q_log_scale).add_(log_offset.to(dtype)[:, None])                     # [B, Nq, H, W]
    i = torch.arange(C, device=q.device)
    later = i[None, :] > i[:, None]                                                      # [i, j]: j > i
    log_gamma = None if log_decay is None else decay_log(log_decay, dtype)               # [H]

    # one row per query: [previous block | own block] exact (the band) or linear (the previous block's j ≤ i)
    pair_keys = torch.cat([kg[:, first - 1:N - 1], kg[:, first:]], 3)                    # [B, Nq, H, 2W, D]
    logits = torch.matmul(qg, pair_keys.transpose(-1, -2)).mul_(scaling)                 # [B, Nq, H, W, 2W]
    linear = _log(torch.matmul(pq, pk[:, first - 1:N - 1].transpose(-1, -2))).add_(shift[..., None])   # [.., W, W]
    if log_gamma is not None:                                                            # γ^(i − j), j ≤ i
        linear.add_(log_gamma[:, None, None] * (i[:, None] - i[None, :]).clamp_min(0).to(dtype))
    before = logits[..., :C]
    before.copy_(torch.where(later, before, linear))
    seen = torch.cat([plain_g[:, first - 1:N - 1], plain_g[:, first:]], 2)               # [B, Nq, 2W]
    band = torch.cat([torch.ones_like(later), ~later], 1)                                # [i, 2W]: own block j ≤ i
    logits.masked_fill_(~(seen[:, :, None, None, :] & band), -torch.inf)

    # the block states B_m = Σ_j γ^(W − 1 − j) φk_j ⊗ [v_j, 1], and R_n for the query blocks, read at γ^(i + 1)
    va = F.pad(vg, (0, 1), value=1.0)                                                    # [B, N, H, W, V+1]
    pk_end = pk if log_gamma is None else pk * torch.exp(log_gamma[:, None] * (C - 1 - i).to(dtype))[..., None]
    blocks = torch.matmul(pk_end[:, :N - 2].transpose(-1, -2), va[:, :N - 2])            # [B, N − 2, H, M, V+1]
    n = torch.arange(first, N, device=q.device)
    steps = (n[:, None] - 2 - torch.arange(N - 2, device=q.device)[None, :]) * C          # [Nq, N − 2]
    if log_gamma is None:
        weights = (steps >= 0).to(dtype)[None].expand(H, -1, -1)
    else:
        weights = torch.exp(log_gamma[:, None, None] * steps.clamp_min(0).to(dtype)).masked_fill_(steps < 0, 0)
    R = torch.einsum("hnm,bmhxy->bnhxy", weights, blocks)                                # [B, Nq, H, M, V+1]
    if initial_state is not None:
        S0 = initial_state.to(dtype)[:, None]                                            # [B, 1, H, M, V+1]
        if log_gamma is not None:
            S0 = S0 * torch.exp(log_gamma[None, :] * ((n - 1) * C).to(dtype)[:, None])[None, :, :, None, None]
        R = R + S0
    read = torch.matmul(pq, R)                                                           # [B, Nq, H, W, V+1]
    if log_gamma is not None:
        read.mul_(torch.exp(log_gamma[:, None] * (i + 1).to(dtype))[..., None])
    den = read[..., -1]
    state_logit = _log(den) + shift                                                      # [B, Nq, H, W]
    parts = [logits]
    if sink_mask is not None:                       # the sink keys, exact for every later query, up to the last sink
        L = _sink_span(sink_mask)
        pos_q = origin + n[:, None] * C + i[None, :]                                      # [Nq, W]
        sinks = (sink_mask & valid)[:, :L]                                               # [B, L]
        k_sink = k[:, :L].to(dtype).transpose(1, 2)[:, None]                              # [B, 1, H, L, D]
        sink_logits = torch.matmul(qg, k_sink.transpose(-1, -2)).mul_(scaling)            # [B, Nq, H, W, L]
        sink_logits.masked_fill_(~((torch.arange(L, device=q.device) <= pos_q[..., None])[None, :, None]
                                   & sinks[:, None, None, None]), -torch.inf)
        parts.append(sink_logits)
    row = torch.cat([*parts, state_logit[..., None]], -1)                                # [B, Nq, H, W, ·]
    top = row.amax(-1, keepdim=True)
    w = row.sub_(torch.where(torch.isfinite(top), top, 0)).exp_()
    w.div_(w.sum(-1, keepdim=True).clamp_min_(TINY))
    pair_values = torch.cat([vg[:, first - 1:N - 1], vg[:, first:]], 3)                  # [B, Nq, H, 2W, V]
    o = torch.matmul(w[..., :2 * C], pair_values)                                        # [B, Nq, H, W, V]
    o.add_(w[..., -1:] * read[..., :-1] / den.clamp_min(TINY)[..., None])
    if sink_mask is not None:
        o.add_(torch.matmul(w[..., 2 * C:-1], v[:, :L].to(dtype).transpose(1, 2)[:, None]))
    o = o.transpose(2, 3).reshape(B, Nq * C, H, V)                                       # [B, positions, H, V]
    skip = P - origin - first * C                                                        # grid slots before the queries
    o = o[:, skip:skip + T]
    final_state = None
    if output_final_state:
        linear_keys = key_valid if sink_mask is None else valid_and(key_valid, ~sink_mask)
        final_state = _fold_state(phi_k, v, window, linear_keys, initial_state, dtype, log_decay, P, lead)
    return o.to(v.dtype), final_state


def window_parts(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling: float, window: int, key_valid=None,
                 initial_state=None, output_final_state: bool = False, backend: str = "auto", log_decay=None,
                 sink_mask=None, lead: int = 0):
    """The hybrid's parts before they are mixed, over the Tk key positions (the P cached ones first, without
    queries): ([(ō, λ, present) of the window's band, of the linear branch, and with a sink of the sink keys beyond
    the band], final state). ō [B, Tk, H, V] is a part's own normalised output, λ [B, Tk, H] its log-mass: a
    query's share of a part is e^λ over the sum of e^λ of the parts it has (`mix_parts`). What
    `blocked_window_linear_attention` mixes, and what `experiments/linear_share.py` reads."""
    dtype = compute_dtype(q, k, v, phi_q, phi_k, initial_state)
    P = k.shape[1] - q.shape[1]
    # Every tensor is laid out over the Tk key positions; the P cached positions get zero queries, dropped at the end.
    qf = F.pad(q.to(dtype), (0, 0, 0, 0, P, 0))
    o_win, lam_win, has_win = _banded_softmax(qf, k.to(dtype), v.to(dtype), scaling, window, key_valid)

    linear_keys = key_valid if sink_mask is None else valid_and(key_valid, ~sink_mask)
    phi_q, delayed_k, delayed_v = delayed_keys(phi_q, phi_k, v, linear_keys, window, dtype)
    phi_qf = F.pad(phi_q, (0, 0, 0, 0, P, 0))
    # the first min(P, W) positions hold neither a query (cached keys) nor a delayed key (the pad): the op starts
    # after them (and after the `lead` sink keys), so that with a decay S_0 sits where the last call's state ended
    start = lead + min(P - lead, window)
    decay = {} if log_decay is None else {"log_decay": log_decay}
    o_aug, final_state = linear_attention(phi_qf[:, start:], delayed_k[:, start:], delayed_v[:, start:],
                                          initial_state=initial_state, output_final_state=output_final_state,
                                          backend=backend, normalize=False, **decay)
    o_aug = F.pad(o_aug.to(dtype), (0, 0, 0, 0, start, 0))
    den = o_aug[..., -1]                                                 # [B, Tk, H]
    has_lin = den > 0
    o_lin = o_aug[..., :-1] / den.clamp_min(TINY)[..., None]
    shift = F.pad(q_log_scale.to(dtype), (0, 0, P, 0)) + log_offset.to(dtype)
    lam_lin = torch.where(has_lin, torch.log(den.clamp_min(TINY)) + shift, 0)
    parts = [(o_win, lam_win, has_win), (o_lin, lam_lin, has_lin)]
    if sink_mask is not None:
        parts.append(sink_softmax(qf, k, v, scaling, window, valid_and(key_valid, sink_mask)))
    if final_state is not None:
        final_state = final_state.to(dtype)
    return parts, final_state
