"""The PRF feature map in Triton, and a PRF layer's whole decode step in one kernel.

    prf = feature_map.prf()                                                      # the map's numbers (`ops.prf`)
    phi, q_log_scale = prf_features(prf, q, "query", MAX_KEY_EXCESS)              # no autograd
    o = prf_decode_step(prf, q1, k1, v1, state, MAX_KEY_EXCESS)                  # features + step, one kernel

Same result as `PositiveRandomFeatures.features` and the naive op's step (`naive.py`): phi [B, T, H, M], state
[B, H, M, V+1] float32. The projection that makes the exponents runs at `common.exact_precision` (ieee for float32
x, tf32x3 for 16-bit x). The window hybrid's decode step (`window.prf_ring_step`) uses the same exponents
(`_prf_exponents`) and the map's numbers (`ops.prf.PRFMap`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dofattn.ops.naive import decay_log
from dofattn.ops.prf import PRFMap
from dofattn.ops.triton.common import _pow2, exact_precision


@triton.jit
def _prf_features(x_ptr, w_ptr, lw_ptr, cnt_ptr, ks_ptr, phi_ptr, qs_ptr, T, H, D, M, root_s, max_excess,
                  BT: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, QUERY: tl.constexpr,
                  EXACT_PREC: tl.constexpr):
    """PRF features of BT tokens of one head: e = W·u − ‖u‖²/2 + ½ log α (u = √s·x), masked past the head's count;
    queries φ = exp(e − max e) and their log-scale max e − ½ log count; keys φ = exp(min(e − key_shift, cap))."""
    it, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = it * BT + tl.arange(0, BT)
    od, om = tl.arange(0, BD), tl.arange(0, BM)
    mr, md = rows < T, od < D
    count = tl.load(cnt_ptr + h)
    mm = om < count
    x_rows = (b.to(tl.int64) * T + rows) * H + h                                               # [BT] token-head rows
    u = tl.load(x_ptr + x_rows[:, None] * D + od[None, :], mask=mr[:, None] & md[None, :], other=0.0)
    u = u.to(tl.float32) * root_s                                                              # [BT, BD]
    w = tl.load(w_ptr + (h * M + om[:, None]) * D + od[None, :], mask=mm[:, None] & md[None, :], other=0.0)
    lw = tl.load(lw_ptr + h * M + om, mask=mm, other=0.0)                                      # [BM]
    e = tl.dot(u, tl.trans(w.to(tl.float32)), input_precision=EXACT_PREC)                     # [BT, BM]
    e = e - 0.5 * tl.sum(u * u, 1)[:, None] + 0.5 * lw[None, :]
    e = tl.where(mm[None, :], e, float("-inf"))
    if QUERY:
        shift = tl.max(e, 1)                                                                   # [BT]
        phi = tl.exp(e - shift[:, None])
        tl.store(qs_ptr + x_rows, shift - 0.5 * tl.log(count.to(tl.float32)), mask=mr)
    else:
        phi = tl.exp(tl.minimum(e - tl.load(ks_ptr + h), max_excess))
    tl.store(phi_ptr + x_rows[:, None] * M + om[None, :], phi.to(phi_ptr.dtype.element_ty),
             mask=mr[:, None] & (om < M)[None, :])


@triton.jit
def _prf_exponents(w, lw, x, root_s):
    """The PRF exponents of one head's vector x [BD] under its map (directions w [BM, BD], log-weights lw [BM]):
    w·u − |u|²/2 + lw/2 with u = x·root_s, in float32 [BM]."""
    u = x.to(tl.float32) * root_s
    return tl.sum(w * u[None, :], 1) - 0.5 * tl.sum(u * u, 0) + 0.5 * lw


@triton.jit
def _prf_decode_step(q_ptr, k_ptr, v_ptr, w_ptr, lw_ptr, cnt_ptr, ks_ptr, s_ptr, o_ptr, valid_ptr, ld_ptr, H, G, D,
                     M, V, root_s, max_excess, BD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
                     HAS_VALID: tl.constexpr, HAS_DECAY: tl.constexpr):
    """A whole linear-attention decode step for one (batch, head): PRF features of the new query and key (k, v on
    kv head h // G), S ← γ S + φk ⊗ [v, 1] in place (γ = exp(ld_ptr[h]) with a decay, else 1; a padding token,
    valid_ptr [B] False, adds no key but still counts as a step), o = (φq·S)[:V] / max((φq·S)[V], tiny) in o_ptr's
    dtype."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    bkv = b * (H // G) + h // G
    od, om, ov = tl.arange(0, BD), tl.arange(0, BM), tl.arange(0, BV)
    md, mv, mv1 = od < D, ov < V, ov <= V
    count = tl.load(cnt_ptr + h)
    mm = om < count
    w = tl.load(w_ptr + (h * M + om[:, None]) * D + od[None, :], mask=mm[:, None] & md[None, :], other=0.0)
    lw = tl.load(lw_ptr + h * M + om, mask=mm, other=0.0)                                      # [BM]
    eq = _prf_exponents(w, lw, tl.load(q_ptr + bh * D + od, mask=md, other=0.0), root_s)        # [BM]
    ek = _prf_exponents(w, lw, tl.load(k_ptr + bkv * D + od, mask=md, other=0.0), root_s)
    eq = tl.where(mm, eq, float("-inf"))
    pq = tl.exp(eq - tl.max(eq, 0))
    pk = tl.where(mm, tl.exp(tl.minimum(ek - tl.load(ks_ptr + h), max_excess)), 0.0)
    if HAS_VALID:
        pk = tl.where(tl.load(valid_ptr + b) != 0, pk, 0.0)                                    # padding adds nothing
    v = tl.load(v_ptr + bkv * V + ov, mask=mv, other=0.0).to(tl.float32)
    v = tl.where(ov == V, 1.0, v)                                                              # [v, 1]
    s_off = bh.to(tl.int64) * M * (V + 1) + om[:, None] * (V + 1) + ov[None, :]
    ms = (om < M)[:, None] & mv1[None, :]
    S = tl.load(s_ptr + s_off, mask=ms, other=0.0)
    if HAS_DECAY:
        S = S * tl.exp(tl.load(ld_ptr + h))
    S += pk[:, None] * v[None, :]
    tl.store(s_ptr + s_off, S, mask=ms)
    num = tl.sum(pq[:, None] * S, 0)                                                           # [BV]
    den = tl.sum(tl.where(ov == V, num, 0.0), 0)
    tl.store(o_ptr + bh * V + ov, (num / tl.maximum(den, 1.1754943508222875e-38)).to(o_ptr.dtype.element_ty),
             mask=mv)


def _prf_tiles(M: int) -> tuple[int, int]:
    """(feature tile, token tile) of the feature-map kernel."""
    BM = _pow2(M)
    return BM, (64 if BM <= 128 else 32)


PRF_WARPS = 8   # the feature map: no register spills in ptxas' report at 8 warps with tf32x3 (sm_90)


def prf_features(prf: PRFMap, x: torch.Tensor, role: str,
                 max_excess: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`PositiveRandomFeatures.features` in one kernel, without autograd: the map's numbers (`ops.prf.PRFMap`), x
    [B, T, H, D] -> (φ [B, T, H, M] in x's dtype if 16-bit else float32, the query log-scale [B, T, H] float32 or
    None for keys). Keys use the map's current `key_shift`, which must be finite (calibrated)."""
    B, T, H, D = x.shape
    M = prf.dim
    w, lw, counts = prf.directions, prf.log_weights, prf.counts
    dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    phi = torch.empty(B, T, H, M, device=x.device, dtype=dtype)
    query = role == "query"
    scale = torch.empty(B, T, H, device=x.device, dtype=torch.float32) if query else phi
    BM, BT = _prf_tiles(M)
    grid = (triton.cdiv(T, BT), B * H)
    _prf_features[grid](x.contiguous(), w, lw, counts, prf.key_shift, phi, scale, T, H, D, M,
                        prf.scaling ** 0.5, max_excess, BT=BT, BD=_pow2(D), BM=BM, QUERY=query,
                        EXACT_PREC=exact_precision(x), num_warps=PRF_WARPS)
    return phi, (scale if query else None)


def prf_decode_step(prf: PRFMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                    max_excess: float, key_valid: torch.Tensor | None = None,
                    log_decay: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of a PRF linear-attention layer in one kernel, the state updated in place.

    q [B, 1, H, D] (after RoPE); k, v [B, 1, Hkv, D] on kv heads (H a multiple of Hkv); state [B, H, M, V+1]
    float32 contiguous; key_valid [B, 1] (False: a padding token, which adds no key) or None; log_decay [H] or
    None: the state is multiplied by γ = exp(log_decay) first (for a padding token too: a decay counts every
    position, as in `ops.naive`). Returns o [B, 1, H, V] in q.dtype. The map's key_shift must be finite (set by
    the prefill).
    """
    B, _, H, D = q.shape
    Hkv, V, M = k.shape[2], v.shape[-1], prf.dim
    if state.shape != (B, H, M, V + 1) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"prf_decode_step needs a contiguous float32 state [B, H, M, V+1] = {(B, H, M, V + 1)}, got "
                         f"{tuple(state.shape)} {state.dtype}")
    w, lw, counts = prf.directions, prf.log_weights, prf.counts
    o = torch.empty(B, 1, H, V, device=q.device, dtype=q.dtype)
    valid = None if key_valid is None else key_valid.reshape(B).contiguous()
    ld = state if log_decay is None else decay_log(log_decay, torch.float32).contiguous()
    _prf_decode_step[(B * H,)](q.contiguous(), k.contiguous(), v.contiguous(), w, lw, counts, prf.key_shift, state, o,
                               state if valid is None else valid, ld, H, H // Hkv, D, M, V, prf.scaling ** 0.5,
                               max_excess, BD=_pow2(D), BM=_pow2(M), BV=_pow2(V + 1), HAS_VALID=valid is not None,
                               HAS_DECAY=log_decay is not None)
    return o
