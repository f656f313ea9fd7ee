"""The sliding-window hybrid in Triton: its prefill (forward and backward) and its static decode step.

    o, state = window_forward(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling, 64)   # with autograd
    o = prf_ring_step(prf, q1, k1, v1, state, keys, values, key_valid, position, log_gain, MAX_KEY_EXCESS)
                                                  # a window hybrid's static step on its ring of W keys, one kernel

Same layout, math and result as `ops/window.py` (the spec) and `hybrid.WindowForms.ring_step`.

The hybrid (window W) runs the linear part as the scan (`scan.py`) on the keys delayed by W (read in place, W
rows back; the backward builds delayed copies), then `_window_exact` adds, per chunk of W queries, exact softmax
logits against the raw keys of the chunk and the one before (and an attention sink's few keys, when there is
one); the parts are combined per row in log space.
Its backward (`WindowHybrid`) keeps each row's log total mass from the forward: the exact part's gradients come
from one banded kernel that recomputes its weights (`_window_exact_backward`), and the linear part's are the
scan's backward (`scan.scan_grads`) on the delayed keys, with the upstream gradient scaled per row by its share of
the mass. The window's exact logits run in ieee (float32) or in 16-bit dots of the 16-bit q and k, whose products
are exact (`common.EXACT`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dofattn.ops.naive import decay_log, delayed_keys, needs_grad, valid_and
from dofattn.ops.triton.common import EXACT, _dot_dtype, _pow2, _tile, _value_tile, interpreting
from dofattn.ops.prf import PRFMap
from dofattn.ops.triton.prf import _prf_exponents
from dofattn.ops.triton.scan import scan, scan_grads

WINDOWS = (16, 32, 64)   # window sizes the Triton hybrid takes (the window is its exact part's chunk)
# Warps: 8 for both kernels, where ptxas reports no register spills on sm_90 for their tiles (16-bit inputs for
# the exact part, the PRF map's usual widths for the ring step) and 4 spills; see docs/log/experiments.md,
# "Registers and spills of the kernels", and `benchmarks/kernel_registers.py`.
WINDOW_WARPS = 8   # the window's exact part
RING_WARPS = 8     # the window hybrid's decode step


# --- the prefill: forward and backward -----------------------------------------------------------------------------


@triton.jit
def _window_exact(q_ptr, k_ptr, v_ptr, ol_ptr, den_ptr, ls_ptr, off_ptr, valid_ptr, sink_ptr, o_ptr, lse_ptr, T, H,
                  D, V, scaling, C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, SB: tl.constexpr,
                  HAS_VALID: tl.constexpr, STORE_LSE: tl.constexpr, EXACT_DOT: tl.constexpr,
                  EXACT_PREC: tl.constexpr):
    """The hybrid's forward for query chunk j of C = W tokens, once its linear part is done: query t takes exact
    softmax weights exp(scaling·q_t·k_s) for s in (t − C, t] and the linear part's mass exp(log den_t + shift_t)
    with its output ol_t (= num_t / den_t, the scan on the keys delayed by C: ol_ptr [B, T, H, V], den_ptr
    [B, T, H]) in one normalisation (shift_t = q_log_scale_t + log_offset_h). With SB > 0, an attention sink: the
    keys at positions sink_ptr [B, SB] (int32, −1: none; out of the linear part) are exact for every query at
    least C after them too (those nearer are in the band already). With STORE_LSE each row's log total mass (−inf
    for a row with no key) goes to lse_ptr [B, T, H], for the backward."""
    j, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    od, ov, oc = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, C)
    md, mv = od < D, ov < V
    row0 = b.to(tl.int64) * T * H + h
    rows, prev = j * C + oc, j * C - C + oc
    mr, mp = rows < T, (prev >= 0) & (prev < T)
    if HAS_VALID:
        vr = tl.load(valid_ptr + b.to(tl.int64) * T + rows, mask=mr, other=0) != 0
        vp = tl.load(valid_ptr + b.to(tl.int64) * T + prev, mask=mp, other=0) != 0
    else:
        vr, vp = mr, mp
    den = tl.load(den_ptr + row0 + rows.to(tl.int64) * H, mask=mr, other=0.0)
    shift = tl.load(ls_ptr + row0 + rows.to(tl.int64) * H, mask=mr, other=0.0) + tl.load(off_ptr + h)
    has_lin = den > 0
    lam = tl.where(has_lin, tl.log(tl.maximum(den, 1.1754943508222875e-38)) + shift, float("-inf"))
    # one key block at a time with a running max (m: −inf while a row has no key; s: m or 0): the sink keys
    # beyond the band, the raw keys of the previous chunk (s > t − C), then of this one (s ≤ t)
    qc = tl.load(q_ptr + (row0 + rows[:, None].to(tl.int64) * H) * D + od[None, :],
                 mask=mr[:, None] & md[None, :], other=0.0).to(EXACT_DOT)                       # [C, BD]
    if SB > 0:
        sink = tl.load(sink_ptr + b.to(tl.int64) * SB + tl.arange(0, SB))                       # [SB] positions
        ms = sink >= 0
        kx = tl.load(k_ptr + (row0 + sink[:, None].to(tl.int64) * H) * D + od[None, :],
                     mask=ms[:, None] & md[None, :], other=0.0).to(EXACT_DOT)                   # [SB, BD]
        logits = scaling * tl.dot(qc, tl.trans(kx), input_precision=EXACT_PREC)                # [C, SB]
        logits = tl.where(ms[None, :] & (sink[None, :] <= rows[:, None] - C), logits, float("-inf"))
        m_sink = tl.maximum(tl.max(logits, 1), lam)
        s_sink = tl.where(m_sink == float("-inf"), 0.0, m_sink)
        p = tl.exp(logits - s_sink[:, None])
        vx = tl.load(v_ptr + (row0 + sink[:, None].to(tl.int64) * H) * V + ov[None, :],
                     mask=ms[:, None] & mv[None, :], other=0.0).to(EXACT_DOT)
        acc = tl.dot(p.to(EXACT_DOT), vx, input_precision=EXACT_PREC)                           # [C, BV]
        total = tl.sum(p, 1)
    else:
        m_sink, s_sink = lam, tl.where(lam == float("-inf"), 0.0, lam)
        acc, total = tl.zeros([C, BV], dtype=tl.float32), tl.zeros([C], dtype=tl.float32)
    kx = tl.load(k_ptr + (row0 + prev[:, None].to(tl.int64) * H) * D + od[None, :],
                 mask=mp[:, None] & md[None, :], other=0.0).to(EXACT_DOT)
    logits = scaling * tl.dot(qc, tl.trans(kx), input_precision=EXACT_PREC)                    # [C, C]
    logits = tl.where((oc[None, :] > oc[:, None]) & vp[None, :], logits, float("-inf"))
    m_prev = tl.maximum(tl.max(logits, 1), m_sink)
    s_prev = tl.where(m_prev == float("-inf"), 0.0, m_prev)
    alpha = tl.where(m_sink == float("-inf"), 0.0, tl.exp(s_sink - s_prev))                    # acc, total are 0
    p = tl.exp(logits - s_prev[:, None])
    vx = tl.load(v_ptr + (row0 + prev[:, None].to(tl.int64) * H) * V + ov[None, :],
                 mask=mp[:, None] & mv[None, :], other=0.0).to(EXACT_DOT)
    acc = acc * alpha[:, None] + tl.dot(p.to(EXACT_DOT), vx, input_precision=EXACT_PREC)        # [C, BV]
    total = total * alpha + tl.sum(p, 1)
    kx = tl.load(k_ptr + (row0 + rows[:, None].to(tl.int64) * H) * D + od[None, :],
                 mask=mr[:, None] & md[None, :], other=0.0).to(EXACT_DOT)
    logits = scaling * tl.dot(qc, tl.trans(kx), input_precision=EXACT_PREC)
    logits = tl.where((oc[:, None] >= oc[None, :]) & vr[None, :], logits, float("-inf"))
    m = tl.maximum(m_prev, tl.max(logits, 1))
    s_cur = tl.where(m == float("-inf"), 0.0, m)
    alpha = tl.where(m_prev == float("-inf"), 0.0, tl.exp(s_prev - s_cur))                     # acc, total are 0
    p = tl.exp(logits - s_cur[:, None])
    vx = tl.load(v_ptr + (row0 + rows[:, None].to(tl.int64) * H) * V + ov[None, :],
                 mask=mr[:, None] & mv[None, :], other=0.0).to(EXACT_DOT)
    w_lin = tl.where(has_lin, tl.exp(lam - s_cur), 0.0)                                        # the linear mass
    ol = tl.load(ol_ptr + (row0 + rows[:, None].to(tl.int64) * H) * V + ov[None, :],
                 mask=mr[:, None] & mv[None, :], other=0.0).to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(EXACT_DOT), vx, input_precision=EXACT_PREC) + w_lin[:, None] * ol
    total = total * alpha + tl.sum(p, 1) + w_lin
    o = tl.where((total > 0)[:, None], acc / tl.maximum(total, 1.1754943508222875e-38)[:, None], 0.0)
    tl.store(o_ptr + (row0 + rows[:, None].to(tl.int64) * H) * V + ov[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mr[:, None] & mv[None, :])
    if STORE_LSE:
        lse = tl.where(total > 0, s_cur + tl.log(tl.maximum(total, 1.1754943508222875e-38)), float("-inf"))
        tl.store(lse_ptr + row0 + rows.to(tl.int64) * H, lse, mask=mr)


@triton.jit
def _rows(ptr, row0, rows, mr, H, W, cols, mc):
    """Rows `rows` of a [B, T, H, W] tensor for one (b, h) as float32 [len(rows), len(cols)], 0 where masked."""
    return tl.load(ptr + (row0 + rows[:, None].to(tl.int64) * H) * W + cols[None, :],
                   mask=mr[:, None] & mc[None, :], other=0.0).to(tl.float32)


@triton.jit
def _row_stats(lse_ptr, delta_ptr, row0, rows, mr, H):
    """Per-row log total mass and delta = ∂o·o for `rows` of one (b, h); a row without keys (or past T) gets
    lse = +inf, so that every weight it recomputes is 0."""
    lse = tl.load(lse_ptr + row0 + rows.to(tl.int64) * H, mask=mr, other=float("inf"))
    delta = tl.load(delta_ptr + row0 + rows.to(tl.int64) * H, mask=mr, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse), delta


@triton.jit
def _exact_grads(qx, kx, vx, dox, lse, delta, mask, scaling):
    """Softmax weights p = exp(scaling·q·kᵀ − lse) on `mask` (else 0) and the logit gradient p·(dO·vᵀ − delta)."""
    logits = tl.where(mask, scaling * tl.dot(qx, tl.trans(kx), input_precision="ieee"), float("-inf"))
    p = tl.exp(logits - lse[:, None])
    return p, p * (tl.dot(dox, tl.trans(vx), input_precision="ieee") - delta[:, None])


@triton.jit
def _window_exact_backward(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, valid_ptr, dq_ptr, dk_ptr, dv_ptr,
                           T, H, D, V, scaling, C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                           HAS_VALID: tl.constexpr):
    """The hybrid's exact part, backward, for chunk j of C = W tokens: ∂q of the queries in chunk j (keys of
    chunks j − 1 and j) and ∂k, ∂v of the keys in chunk j (queries of chunks j and j + 1), float32. The weights
    are recomputed from the forward's row log-mass lse (one normalisation over both parts), and the logit
    gradient is p·(∂o·v − delta) with delta = ∂o·o over the whole row."""
    j, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    od, ov, oc = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, C)
    md, mv = od < D, ov < V
    row0 = b.to(tl.int64) * T * H + h
    cur, prev, nxt = j * C + oc, j * C - C + oc, j * C + C + oc
    mcur, mprev, mnxt = cur < T, (prev >= 0) & (prev < T), nxt < T
    if HAS_VALID:
        vcur = tl.load(valid_ptr + b.to(tl.int64) * T + cur, mask=mcur, other=0) != 0
        vprev = tl.load(valid_ptr + b.to(tl.int64) * T + prev, mask=mprev, other=0) != 0
    else:
        vcur, vprev = mcur, mprev
    lower = oc[:, None] >= oc[None, :]            # key j ≤ query i, same chunk
    upper = oc[:, None] < oc[None, :]             # key c of the earlier chunk within the window of query i: c > i
    qc, kc = _rows(q_ptr, row0, cur, mcur, H, D, od, md), _rows(k_ptr, row0, cur, mcur, H, D, od, md)
    vc, doc = _rows(v_ptr, row0, cur, mcur, H, V, ov, mv), _rows(do_ptr, row0, cur, mcur, H, V, ov, mv)
    lse_c, delta_c = _row_stats(lse_ptr, delta_ptr, row0, cur, mcur, H)
    # ∂q of chunk j
    kp, vp = _rows(k_ptr, row0, prev, mprev, H, D, od, md), _rows(v_ptr, row0, prev, mprev, H, V, ov, mv)
    _, ds_prev = _exact_grads(qc, kp, vp, doc, lse_c, delta_c, upper & vprev[None, :], scaling)
    p_cur, ds_cur = _exact_grads(qc, kc, vc, doc, lse_c, delta_c, lower & vcur[None, :], scaling)
    dq = scaling * (tl.dot(ds_prev, kp, input_precision="ieee") + tl.dot(ds_cur, kc, input_precision="ieee"))
    tl.store(dq_ptr + (row0 + cur[:, None].to(tl.int64) * H) * D + od[None, :], dq, mask=mcur[:, None] & md[None, :])
    # ∂k, ∂v of chunk j: its own queries, then the next chunk's
    qn, don = _rows(q_ptr, row0, nxt, mnxt, H, D, od, md), _rows(do_ptr, row0, nxt, mnxt, H, V, ov, mv)
    lse_n, delta_n = _row_stats(lse_ptr, delta_ptr, row0, nxt, mnxt, H)
    p_n, ds_n = _exact_grads(qn, kc, vc, don, lse_n, delta_n, upper & vcur[None, :], scaling)
    dv = tl.dot(tl.trans(p_cur), doc, input_precision="ieee") + tl.dot(tl.trans(p_n), don, input_precision="ieee")
    dk = scaling * (tl.dot(tl.trans(ds_cur), qc, input_precision="ieee")
                    + tl.dot(tl.trans(ds_n), qn, input_precision="ieee"))
    tl.store(dk_ptr + (row0 + cur[:, None].to(tl.int64) * H) * D + od[None, :], dk, mask=mcur[:, None] & md[None, :])
    tl.store(dv_ptr + (row0 + cur[:, None].to(tl.int64) * H) * V + ov[None, :], dv, mask=mcur[:, None] & mv[None, :])


def window_forward(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling: float, window: int,
                   key_valid=None, initial_state=None, output_final_state: bool = False, block: int | None = None,
                   log_decay=None, sink_mask=None):
    """`ops.window.window_linear_attention` for a prefill (as many keys as queries) in Triton, forward and backward.

    q, k [B, T, H, D]; v [B, T, H, V]; phi_q, phi_k [B, T, H, M] (any M); q_log_scale [B, T, H]; log_offset [H];
    key_valid [B, T] or None; initial_state [B, H, M, V+1] or None; log_decay [H] or None (the linear part decays
    from the window's edge, as in the spec); sink_mask [B, T] bool or None (keys exact for every later query, out
    of the linear part and the state; not with a decay). window must be one of WINDOWS. Returns o [B, T, H, V] in
    v.dtype and the state of every key but the last `window` (float32) if output_final_state, else None.
    Gradients reach every floating input from both outputs (`WindowHybrid`).

    A sink is a third block of keys in the exact part's kernel: the sink keys (at most a few per row) are out of
    the linear part, and each chunk of queries takes exact weights for those at least W before it, in the same
    normalisation (`sink_positions`). Their gradients come from the same row log-mass, in PyTorch
    (`sink_grads`: O(T·S)).
    """
    if window not in WINDOWS or k.shape[1] != q.shape[1]:
        raise ValueError(f"window_forward takes windows {WINDOWS} and as many keys as queries; got window {window}, "
                         f"{k.shape[1]} keys for {q.shape[1]} queries")
    if sink_mask is not None and log_decay is not None:
        raise ValueError("the Triton window hybrid does not take a decay and a sink together (unconfirmed on a GPU): "
                         "use ops.window.window_linear_attention with backend auto")
    S0 = None if initial_state is None else initial_state.float().contiguous()
    if log_decay is not None:
        log_decay = decay_log(log_decay, torch.float32)                # differentiable clamp to [-1e4, 0]

    linear_valid, sink_pos = key_valid, None
    if sink_mask is not None:
        linear_valid, sink_pos = valid_and(key_valid, ~sink_mask), sink_positions(valid_and(key_valid, sink_mask))
    if not needs_grad(q, k, v, phi_q, phi_k, q_log_scale, log_offset, S0, log_decay):
        o, final, _ = _window_launch(q, k, v, phi_q, phi_k, q_log_scale, log_offset, S0, key_valid, linear_valid,
                                     sink_pos, float(scaling), window, output_final_state, block, store_lse=False,
                                     log_decay=log_decay)       # a prefill: without autograd's bookkeeping
        return o, final
    return WindowHybrid.apply(q, k, v, phi_q, phi_k, q_log_scale, log_offset, S0, key_valid, linear_valid, sink_pos,
                              float(scaling), window, output_final_state, block, log_decay)


def sink_positions(sink_mask: torch.Tensor) -> torch.Tensor | None:
    """[B, T] bool -> int32 [B, SB]: each row's sink positions in order, then −1; SB a power of two ≥ 16 (a dot's
    smallest side). None if no row has a sink key. Reads the largest count per row on the host (one sync)."""
    count = int(sink_mask.sum(1).max()) if sink_mask.numel() else 0
    if count == 0:
        return None
    B, T = sink_mask.shape
    where = torch.where(sink_mask, torch.arange(T, device=sink_mask.device), T)
    first = where.topk(count, dim=1, largest=False).values                      # sorted, T where a row has fewer
    pos = torch.full((B, max(16, _pow2(count))), -1, dtype=torch.int32, device=sink_mask.device)
    pos[:, :count] = torch.where(first < T, first, -1)
    return pos


def sink_grads(q, k, v, g_o, lse, delta, sink_pos, scaling: float, window: int):
    """The sink keys' part of the hybrid's backward, in float32: their weights p_ts = exp(scaling·q_t·k_s − lse_t)
    (s a sink position at least W before t) give ∂v_s = Σ_t p_ts ∂o_t and, with ∂logit_ts = p_ts (∂o_t·v_s −
    delta_t), ∂q_t = scaling Σ_s ∂logit_ts k_s and ∂k_s = scaling Σ_t ∂logit_ts q_t. Returns (∂q [B, T, H, D],
    ∂k and ∂v of the sink keys [B, SB, H, *] (0 in empty slots), their positions [B, SB] with −1 as 0)."""
    T = q.shape[1]
    valid = sink_pos >= 0
    pos = sink_pos.long().clamp_min(0)                                                       # [B, SB]
    ks = k.float().gather(1, pos[:, :, None, None].expand(-1, -1, *k.shape[2:]))             # [B, SB, H, D]
    vs = v.float().gather(1, pos[:, :, None, None].expand(-1, -1, *v.shape[2:]))
    t = torch.arange(T, device=q.device)
    mask = valid[:, None, :] & (pos[:, None, :] <= t[None, :, None] - window)                # [B, T, SB]
    logits = scaling * torch.einsum("bthd,bshd->bths", q.float(), ks)                        # [B, T, H, SB]
    lse = lse[..., None]
    p = torch.where(mask[:, :, None, :] & torch.isfinite(lse), torch.exp(logits - torch.where(
        torch.isfinite(lse), lse, 0)), 0.0)
    dv = torch.einsum("bths,bthv->bshv", p, g_o)
    d_logit = p * (torch.einsum("bthv,bshv->bths", g_o, vs) - delta[..., None])
    dq = scaling * torch.einsum("bths,bshd->bthd", d_logit, ks)
    dk = scaling * torch.einsum("bths,bthd->bshd", d_logit, q.float())
    return dq, dk, dv, pos


def _window_launch(q, k, v, phi_q, phi_k, q_log_scale, log_offset, S0, key_valid, linear_valid, sink_pos,
                   scaling: float, window: int, output_final_state: bool, block: int | None, store_lse: bool,
                   log_decay=None):
    """The forward: the linear part is the scan with its keys and values delayed by W (read in place, `delay`),
    normalised, float32, decayed by position (so key s reaches t as γ^(t − W − s), and S0 as γ^(t+1)); then
    `_window_exact` adds the exact part per chunk of W queries. Returns (o in v.dtype, final state or None, row
    log-mass [B, T, H] float32 or None).

    Two kernels, not one: a kernel that kept the linear state in registers beside the exact part's tiles spilled
    registers (ptxas, sm_90), and the linear output's round trip through memory costs less than the scan's own
    reads of φq and φk. key_valid masks the exact part's keys, linear_valid the linear part's (padding, and the
    sink keys when there is a sink); sink_pos (int32 [B, SB] or None, `sink_positions`) the exact part's sink
    keys."""
    B, T, H, D = q.shape
    V = v.shape[-1]
    if linear_valid is not None:                  # padding (and sink) keys add nothing to the linear part
        phi_k = phi_k * linear_valid[:, :, None, None].to(phi_k.dtype)
    o_lin, den, final = scan(phi_q, phi_k, v, S0, with_den=True, final_state=output_final_state, normalize=True,
                             block=block, delay=window, log_decay=log_decay)
    exact_dot = _dot_dtype(q, k, v)[0]            # 16-bit q, k, v: their products are exact in the float32 sums
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if store_lse else o
    valid = den if key_valid is None else key_valid.contiguous()
    _window_exact[(triton.cdiv(T, window), B * H)](
        q.contiguous(), k.contiguous(), v.contiguous(), o_lin, den, q_log_scale.float().contiguous(),
        log_offset.float().contiguous(), valid, den if sink_pos is None else sink_pos, o, lse, T, H, D, V,
        float(scaling), C=window, BD=_pow2(D), BV=_value_tile(_pow2(V), exact_dot),
        SB=0 if sink_pos is None else sink_pos.shape[1], HAS_VALID=key_valid is not None, STORE_LSE=store_lse,
        EXACT_DOT=exact_dot, EXACT_PREC=EXACT if exact_dot == tl.float32 else "tf32", num_warps=WINDOW_WARPS)
    return o, final, (lse if store_lse else None)


class WindowHybrid(torch.autograd.Function):
    """The Triton hybrid with its backward. Outputs o and the final state (or None); the forward keeps each row's
    log total mass lse over all parts for the backward. With delta = ∂o·o:
    - the exact part is a banded softmax backward (`_window_exact_backward`), its weights recomputed from lse;
    - the sink keys' weights are recomputed from lse as well (`sink_grads`, in PyTorch: a few columns);
    - the linear part's weights are φq_t·φk_s·c_t with c_t = exp(shift_t − lse_t), so it is the plain scan's
      backward (`scan_grads`) on the delayed keys with g_t = c_t·[∂o_t, −delta_t], and
      ∂shift_t = φq_t·∂φq_t (shift_t = q_log_scale_t + log_offset_h);
    - the delayed key and value gradients move back by W, and keys outside linear_valid get none from it."""

    @staticmethod
    def forward(ctx, q, k, v, phi_q, phi_k, q_log_scale, log_offset, S0, key_valid, linear_valid, sink_pos, scaling,
                window, want_state, block, log_decay):
        o, final, lse = _window_launch(q, k, v, phi_q, phi_k, q_log_scale, log_offset, S0, key_valid, linear_valid,
                                       sink_pos, scaling, window, want_state, block,
                                       store_lse=any(ctx.needs_input_grad), log_decay=log_decay)
        ctx.save_for_backward(q, k, v, phi_q, phi_k, q_log_scale, log_offset, S0, key_valid, linear_valid, sink_pos,
                              o, lse, log_decay)
        ctx.scaling, ctx.window = scaling, window
        return o, final

    @staticmethod
    def backward(ctx, g_o, g_state):

        (q, k, v, phi_q, phi_k, q_log_scale, log_offset, S0, key_valid, linear_valid, sink_pos, o, lse,
         log_decay) = ctx.saved_tensors
        B, T, H, D = q.shape
        V, W = v.shape[-1], ctx.window
        g_o = torch.zeros_like(o, dtype=torch.float32) if g_o is None else g_o.float().contiguous()
        delta = (g_o * o.float()).sum(-1).contiguous()                                         # [B, T, H]
        f32 = dict(device=q.device, dtype=torch.float32)
        dq_x, dk_x = torch.empty(B, T, H, D, **f32), torch.empty(B, T, H, D, **f32)
        dv_x = torch.empty(B, T, H, V, **f32)
        valid = lse if key_valid is None else key_valid.contiguous()
        _window_exact_backward[(triton.cdiv(T, W), B * H)](
            q.contiguous(), k.contiguous(), v.contiguous(), g_o, lse, delta, valid, dq_x, dk_x, dv_x, T, H, D, V,
            ctx.scaling, C=W, BD=_pow2(D), BV=_pow2(V), HAS_VALID=key_valid is not None)
        if sink_pos is not None:
            dq_s, dk_s, dv_s, pos = sink_grads(q, k, v, g_o, lse, delta, sink_pos, ctx.scaling, W)
            dq_x = dq_x + dq_s
            index = pos[:, :, None, None]                 # empty slots add their zeros to position 0
            dk_x = dk_x.scatter_add(1, index.expand_as(dk_s), dk_s)
            dv_x = dv_x.scatter_add(1, index.expand_as(dv_s), dv_s)
        shift = q_log_scale.float() + log_offset.float()
        c = torch.where(torch.isfinite(lse), torch.exp(shift - lse), 0.0)                     # [B, T, H]
        g_lin = c[..., None] * torch.cat([g_o, -delta[..., None]], -1)                         # [B, T, H, V+1]
        pq, dk, dv = (x.contiguous() for x in delayed_keys(phi_q, phi_k, v, linear_valid, W, torch.float32))
        d_pq, d_dk, d_dv, dS0, d_log_decay = scan_grads(pq, dk, dv, S0, g_lin, g_state, log_decay)
        d_shift = (pq.float() * d_pq.float()).sum(-1)                                          # [B, T, H]
        d_phi_k = torch.nn.functional.pad(d_dk.float()[:, W:], (0, 0, 0, 0, 0, min(W, T)))     # back by W
        d_v = dv_x + torch.nn.functional.pad(d_dv.float()[:, W:], (0, 0, 0, 0, 0, min(W, T)))
        if linear_valid is not None:
            d_phi_k = d_phi_k * linear_valid[:, :, None, None]
        return (dq_x.to(q.dtype), dk_x.to(k.dtype), d_v.to(v.dtype), d_pq.to(phi_q.dtype), d_phi_k.to(phi_k.dtype),
                d_shift.to(q_log_scale.dtype), d_shift.sum((0, 1)).to(log_offset.dtype), dS0, None, None, None, None,
                None, None, None, d_log_decay)


# --- the static decode step ----------------------------------------------------------------------------------------


@triton.jit
def _prf_ring_step(q_ptr, k_ptr, v_ptr, w_ptr, lw_ptr, cnt_ptr, ks_ptr, gain_ptr, log_decay_ptr, s_ptr, rk_ptr, rv_ptr,
                   rvalid_ptr, pos_ptr, sk_ptr, sv_ptr, svalid_ptr, arrive_ptr, o_ptr, H, G, D, M, V, W, NS,
                   root_s, scaling, max_excess, BD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
                   BW: tl.constexpr, BS: tl.constexpr, BKV: tl.constexpr, HAS_DECAY: tl.constexpr,
                   HAS_SINK: tl.constexpr):
    """A window hybrid's whole static decode step for one (batch, head) (`hybrid.WindowForms.ring_step`): the key in
    ring slot p mod W (p = pos_ptr[0], read here) leaves the window: its PRF features (on query head h's map) join
    the state in place, S ← γ S + φk ⊗ [v, 1] (γ = exp(log_decay_ptr[h]) with a decay; nothing if the
    slot was empty); the new key takes the slot; then o = one softmax over the ring's valid keys, the sink's
    (sk_ptr [B, NS, Hkv, D]) and the linear part's mass exp(log(φq·z) + shift), shift = the query's and key's
    log-scales + log_gain[h], under their max. Ring keys, values [B, W, Hkv, D | V], flags [B, W] (uint8).
    The programs of a batch row share its ring slot (G query heads per kv head) and its flag: each reads them and
    sees the new key in the slot in its registers; at the end it counts itself in arrive_ptr[b] (acq_rel), and the
    last to arrive writes the new keys of every kv head and the flag, and sets the count back to 0. No program
    reads what another writes."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    HKV = H // G
    bkv = b * HKV + h // G                                                                     # row of k, v
    od, om, ov, ow = tl.arange(0, BD), tl.arange(0, BM), tl.arange(0, BV), tl.arange(0, BW)
    md, mv, mw = od < D, ov < V, ow < W
    slot = tl.load(pos_ptr) % W
    ring = (b.to(tl.int64) * W + ow) * HKV + h // G                                            # [BW] ring rows
    leaving = (b.to(tl.int64) * W + slot) * HKV + h // G
    # features of the query and of the key leaving the window, as in `_prf_decode_step`
    count = tl.load(cnt_ptr + h)
    mm = om < count
    w = tl.load(w_ptr + (h * M + om[:, None]) * D + od[None, :], mask=mm[:, None] & md[None, :], other=0.0)
    lw = tl.load(lw_ptr + h * M + om, mask=mm, other=0.0)                                      # [BM]
    q = tl.load(q_ptr + bh * D + od, mask=md, other=0.0).to(tl.float32)                       # [BD]
    k_old = tl.load(rk_ptr + leaving * D + od, mask=md, other=0.0)
    eq = _prf_exponents(w, lw, q, root_s)                                                      # [BM]
    ek = _prf_exponents(w, lw, k_old, root_s)
    eq = tl.where(mm, eq, float("-inf"))
    q_max = tl.max(eq, 0)
    pq = tl.exp(eq - q_max)                                                                    # [BM]
    key_shift = tl.load(ks_ptr + h).to(tl.float32)
    old_valid = tl.load(rvalid_ptr + b.to(tl.int64) * W + slot) != 0
    pk = tl.where(mm & old_valid, tl.exp(tl.minimum(ek - key_shift, max_excess)), 0.0)
    # the state [M, V+1] as Σ φk ⊗ v [M, V] and Σ φk [M], in place
    rows = bh.to(tl.int64) * M * (V + 1) + om * (V + 1)
    mr = om < M
    S = tl.load(s_ptr + rows[:, None] + ov[None, :], mask=mr[:, None] & mv[None, :], other=0.0)
    z = tl.load(s_ptr + rows + V, mask=mr, other=0.0)
    if HAS_DECAY:
        decay = tl.exp(tl.load(log_decay_ptr + h).to(tl.float32))
        S, z = S * decay, z * decay
    v_old = tl.load(rv_ptr + leaving * V + ov, mask=mv, other=0.0).to(tl.float32)            # [BV]
    S += pk[:, None] * v_old[None, :]
    z += pk
    tl.store(s_ptr + rows[:, None] + ov[None, :], S, mask=mr[:, None] & mv[None, :])
    tl.store(s_ptr + rows + V, z, mask=mr)
    num = tl.sum(pq[:, None] * S, 0)                                                           # [BV]
    den = tl.sum(pq * z, 0)
    # one normalisation: the linear mass, the ring's logits (the new key in its slot) and the sink's, under their max
    log_count = tl.log(count.to(tl.float32))
    shift = q_max + key_shift - log_count + tl.load(gain_ptr + h).to(tl.float32)             # both scales + gain
    lam = tl.where(den > 0, tl.log(tl.maximum(den, 1.1754943508222875e-38)) + shift, float("-inf"))
    new = ow == slot
    kr = tl.load(rk_ptr + ring[:, None] * D + od[None, :], mask=mw[:, None] & md[None, :], other=0.0)   # [BW, BD]
    kr = tl.where(new[:, None], tl.load(k_ptr + bkv * D + od, mask=md, other=0.0)[None, :], kr)
    valid = (tl.load(rvalid_ptr + b.to(tl.int64) * W + ow, mask=mw, other=0) != 0) | new                # [BW]
    logits = tl.where(valid, scaling * tl.sum(kr.to(tl.float32) * q[None, :], 1), float("-inf"))
    m = tl.maximum(tl.max(logits, 0), lam)
    if HAS_SINK:
        sink = (b.to(tl.int64) * NS + tl.arange(0, BS)) * HKV + h // G                         # [BS]
        ms = tl.arange(0, BS) < NS
        ks = tl.load(sk_ptr + sink[:, None] * D + od[None, :], mask=ms[:, None] & md[None, :], other=0.0)
        s_valid = tl.load(svalid_ptr + b.to(tl.int64) * NS + tl.arange(0, BS), mask=ms, other=0) != 0
        s_logits = tl.where(s_valid, scaling * tl.sum(ks.to(tl.float32) * q[None, :], 1), float("-inf"))
        m = tl.maximum(m, tl.max(s_logits, 0))
    m = tl.where(m == float("-inf"), 0.0, m)             # nothing to weigh: every weight 0, o = 0
    p = tl.exp(logits - m)
    vr = tl.load(rv_ptr + ring[:, None] * V + ov[None, :], mask=mw[:, None] & mv[None, :], other=0.0)   # [BW, BV]
    vr = tl.where(new[:, None], tl.load(v_ptr + bkv * V + ov, mask=mv, other=0.0)[None, :], vr)
    w_lin = tl.where(den > 0, tl.exp(lam - m), 0.0)
    acc = tl.sum(p[:, None] * vr.to(tl.float32), 0) + (w_lin / tl.maximum(den, 1.1754943508222875e-38)) * num
    total = tl.sum(p, 0) + w_lin
    if HAS_SINK:
        p = tl.exp(s_logits - m)
        vs = tl.load(sv_ptr + sink[:, None] * V + ov[None, :], mask=ms[:, None] & mv[None, :], other=0.0)
        acc += tl.sum(p[:, None] * vs.to(tl.float32), 0)
        total += tl.sum(p, 0)
    tl.store(o_ptr + bh * V + ov, (acc / tl.maximum(total, 1.1754943508222875e-38)).to(o_ptr.dtype.element_ty),
             mask=mv)
    # the ring's writes, once every program of row b has read it: the last to count itself writes them
    tl.debug_barrier()                                   # every thread of this program has read
    if tl.atomic_add(arrive_ptr + b, 1, sem="acq_rel") == H - 1:
        ox = tl.arange(0, BKV)
        dst = (b.to(tl.int64) * W + slot) * HKV
        tl.store(rk_ptr + dst * D + ox, tl.load(k_ptr + b.to(tl.int64) * HKV * D + ox, mask=ox < HKV * D),
                 mask=ox < HKV * D)
        tl.store(rv_ptr + dst * V + ox, tl.load(v_ptr + b.to(tl.int64) * HKV * V + ox, mask=ox < HKV * V),
                 mask=ox < HKV * V)
        tl.store(rvalid_ptr + b.to(tl.int64) * W + slot, 1)
        tl.store(arrive_ptr + b, 0)


def prf_ring_step(prf: PRFMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, key_valid: torch.Tensor, position: torch.Tensor, log_gain: torch.Tensor,
                  max_excess: float, log_decay: torch.Tensor | None = None, sink_keys: torch.Tensor | None = None,
                  sink_values: torch.Tensor | None = None, sink_valid: torch.Tensor | None = None,
                  arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """`hybrid.WindowForms.ring_step` of a PRF window hybrid in one kernel: the state, the ring and its flags
    updated in place, the position read on the device (no host sync: a CUDA graph can replay it).

    q [B, 1, H, D] (after RoPE); k, v [B, 1, Hkv, D | V] on kv heads (H a multiple of Hkv); state [B, H, M, V+1]
    float32 contiguous; keys, values [B, W, Hkv, D | V] and key_valid [B, W] bool: the ring (slot p mod W holds the
    key at position p), contiguous; position [1] int64: p, the token being decoded; log_gain [H]; log_decay [H] or
    None: log γ_h (clamped to [-1e4, 0], as the ops do); sink_keys,
    sink_values [B, S, Hkv, D | V] and sink_valid [B, S] or None: exact keys beside the ring, never folded;
    arrivals [B] int32 zeros (kept between steps, `StaticStateLayer.arrivals`; None: a new one). The map's key_shift
    must be finite. Returns o [B, 1, H, V] in q.dtype.

    One program per (batch, query head), each reading its kv head's W ring slots: the G query heads of a kv head
    all read the slot that the step overwrites, and every head of a batch row its flag. So nobody writes until
    everyone has read: each program uses the new key from registers, and when done (a barrier, then an acq_rel
    atomic) counts itself in arrivals[b]; the last of the row writes the new keys, values and flag and resets the
    count. One program per kv head looping over its query heads would still share the flag across kv heads (and
    would run G heads one after the other).
    """
    B, _, H, D = q.shape
    Hkv, V, M, W = k.shape[2], v.shape[-1], prf.dim, keys.shape[1]
    if state.shape != (B, H, M, V + 1) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"prf_ring_step needs a contiguous float32 state [B, H, M, V+1] = {(B, H, M, V + 1)}, got "
                         f"{tuple(state.shape)} {state.dtype}")
    for x, shape in ((keys, (B, W, Hkv, D)), (values, (B, W, Hkv, V)), (key_valid, (B, W))):
        if x.shape != shape or not x.is_contiguous():
            raise ValueError(f"prf_ring_step updates the ring in place: it needs contiguous buffers shaped {shape}, "
                             f"got {tuple(x.shape)} (contiguous: {x.is_contiguous()})")
    sink = sink_keys is not None and sink_keys.shape[1] > 0
    if sink:   # read only: copied if not contiguous (`StaticStateLayer.from_layer` makes them so)
        S = sink_keys.shape[1]
        if sink_keys.shape != (B, S, Hkv, D) or sink_values.shape != (B, S, Hkv, V) or sink_valid.shape != (B, S):
            raise ValueError(f"prf_ring_step needs sink keys, values and flags shaped {(B, S, Hkv, D)}, "
                             f"{(B, S, Hkv, V)} and {(B, S)}, got {tuple(sink_keys.shape)}, "
                             f"{tuple(sink_values.shape)} and {tuple(sink_valid.shape)}")
        sink_keys, sink_values, sink_valid = sink_keys.contiguous(), sink_values.contiguous(), sink_valid.contiguous()
    if not (q.is_cuda or interpreting()):
        raise RuntimeError(f"prf_ring_step needs CUDA tensors, got {q.device}; use the PyTorch ring step")
    w, lw, counts = prf.directions, prf.log_weights, prf.counts
    ld = None if log_decay is None else decay_log(log_decay, torch.float32).contiguous()
    if arrivals is None:
        arrivals = torch.zeros(B, dtype=torch.int32, device=q.device)
    o = torch.empty(B, 1, H, V, device=q.device, dtype=q.dtype)
    flags = key_valid.view(torch.uint8)
    _prf_ring_step[(B * H,)](
        q.contiguous(), k.contiguous(), v.contiguous(), w, lw, counts, prf.key_shift, log_gain,
        log_gain if ld is None else ld, state, keys, values, flags, position,
        sink_keys if sink else keys, sink_values if sink else values, sink_valid.view(torch.uint8) if sink else flags,
        arrivals, o, H, H // Hkv, D, M, V, W, S if sink else 0, prf.scaling ** 0.5, prf.scaling, max_excess,
        BD=_pow2(D), BM=_pow2(M), BV=_pow2(V), BW=_tile(W), BS=_tile(S) if sink else 2,
        BKV=triton.next_power_of_2(Hkv * max(D, V)), HAS_DECAY=ld is not None, HAS_SINK=sink,
        num_warps=RING_WARPS)
    return o
