"""dofattn's Triton kernels (CUDA): causal linear attention for prefill and training (forward and backward), the
PRF feature map, the decode step, and the sliding-window hybrid (forward and backward).

    o, state = triton_linear_attention(phi_q, phi_k, v, initial_state=None, output_final_state=True)
    o = triton_decode_step(phi_q1, phi_k1, v1, state, state)   # T = 1, the state [B, H, M, V+1] updated in place
    phi, q_log_scale = prf_features(fmap, q, "query", MAX_KEY_EXCESS)             # no autograd
    o = prf_decode_step(fmap, q1, k1, v1, state, MAX_KEY_EXCESS)                 # features + step, one kernel
    o = prf_ring_step(fmap, q1, k1, v1, state, keys, values, key_valid, position, log_gain, MAX_KEY_EXCESS)
                                                  # a window hybrid's static step on its ring of W keys, one kernel
    o, state = window_forward(q, k, v, phi_q, phi_k, q_log_scale, log_offset, scaling, 64)   # with autograd
All but the feature map take an optional per-head decay, `log_decay` [H] (forward, backward and decode steps); the
linear op and its decode step take a gate instead, `log_gate` [B, T, H] (a decay per token).

Same layout, math and result as `naive.py` and `window.py` (the specs): phi_q, phi_k [B, T, H, M], v [B, T, H, V],
state [B, H, M, V+1] float32, o [B, T, H, V] in v.dtype. Any M and V (not only powers of two: tiles are padded and
masked).

How the prefill is cut: the sequence is split into blocks of L tokens (L a power-of-two multiple of the chunk C,
chosen so that blocks × heads fill the GPU). Three launches:
1. `_block_state`: every block's own state Σ φk ⊗ v [M, V] and normaliser Σ φk [M], all blocks in parallel.
2. `_prefix_states`: the exclusive prefix sum over blocks, in place, plus the initial state; the total is the
   final state.
3. `_block_scan`: every block in parallel walks its chunks in order with the state in registers:
   o_c = φq_c·S + tril(φq_c φk_cᵀ)·v_c, den_c = φq_c·z + rowsum(tril(φq_c φk_cᵀ)), then S += φk_cᵀ v_c, z += Σ φk_c,
   and writes o_c / den_c.
Every input is read twice at most and the output written once; nothing of size T × M × V reaches device memory.

The same kernels, run right to left (`reverse`), give the backward: with g = [∂num, ∂den] and v̄ = [v, 1],
    ∂φq_t = Σ_{s≤t} (g_t·v̄_s) φk_s,   ∂φk_s = Σ_{t≥s} (v̄_s·g_t) φq_t,   ∂v_s = Σ_{t≥s} (φk_s·φq_t) ∂num_t,
three more scans of the same shape (queries g, keys v̄, values φk, and so on).

A per-head decay (log γ [H], `naive.py`) weighs the pair (t, s) by γ^|t − s| in all of these: each block's own
state is taken as of its last position (its first, right to left), the prefix sum multiplies the running state by
γ^n before adding a block of n positions, and inside a block the state reaches a chunk's rows as γ^(c+1) (γ^(C−c)
right to left), the chunk's pairs weigh γ^|i − j| and the state moves on by γ^C. Every factor is exp(log γ × a
distance ≥ 0), so nothing overflows however strong the decay. The backward is the same three scans, decayed
alike, and ∂log γ = Σ_t t φq_t·∂φq_t − Σ_s s φk_s·∂φk_s (each pair's (t − s) times its share of the loss), plus
the initial and final states' terms (`scan_grads`). The decode steps multiply the state by γ before adding the
new key.

A gate (log g_t [B, T, H] ≤ 0, `naive.py`) weighs the pair (t, s) by exp(Σ_{s<l≤t} g_l) in the same places: each
chunk computes its own factors from its C gates (`_chunk_gate`: cumulative sums from either end, and the pairs'
spans as one dot of the gates with 0/1 masks, so every exponent sums the terms it spans, ≤ 0 and without
cancellation), each block's state moves across the next block by exp of that block's sum, and the decode step
multiplies the state by exp(g_t). ∂g_j = Σ_{t≥j} φq_t·∂φq_t − Σ_{s≥j} φk_s·∂φk_s (the pairs whose span holds j)
plus the states' terms (`gated_scan_grads`).

The hybrid (window W) runs the linear part as the scan above on the keys delayed by W (read in place, W rows back;
the backward builds delayed copies), then `_window_exact` adds, per chunk of W queries, exact softmax logits
against the raw keys of the chunk and the one before (and an attention sink's few keys, when there is one); the
parts are combined per row in log space.
Its backward (`WindowHybrid`) keeps each row's log total mass from the forward: the exact part's gradients come
from one banded kernel that recomputes its weights (`_window_exact_backward`), and the linear part's are the scans
above on the delayed keys, with the upstream gradient scaled per row by its share of the mass.

Dots run in bf16/fp16 when φq, φk and v are all 16-bit (value tiles at least 64 wide), else in tf32x3 (about
float32 accuracy); the state, sums and outputs are float32. Dots that make exponents stay near float32 accuracy
(`EXACT`): the feature projection in ieee (float32 x) or tf32x3 (16-bit x); the window's exact logits in ieee
(float32) or in 16-bit dots of the 16-bit q and k, whose products are exact. Triton is imported here, and this
module is imported only on first use (`ops.load_fused`), so importing dofattn never needs Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dofattn.ops.naive import TINY, augment_values, check_inputs, decay_log, needs_grad

CHUNK = 64           # tokens per chunk inside a block (the tril product is C × C); 32/16 for wide features
MAX_TILE = 128 * 64  # state elements a program keeps in registers: M_pad × V_tile
# Precision of the float32 dots that make exponents: the PRF projection (16-bit x against float32 directions) and,
# for float32 inputs, the window's exact logits and weights × values (forward). Float32 inputs: "ieee", exact to
# float32 rounding at exponents near 200 (on the FMA units: slow, and its operand tiles spill registers). The
# projection of 16-bit x: "tf32x3" (tensor cores, three tf32 products: near float32 accuracy, far under 16-bit
# rounding; no spills in ptxas' report, `benchmarks/kernel_registers.py`). The window's exact part on
# 16-bit q, k, v takes 16-bit dots instead: the products of 16-bit numbers are exact in float32, and the weights go
# to 16 bits for the values' dot, as in FlashAttention. `benchmarks/cuda_ops.py --exact` times alternatives.
EXACT = "ieee"
EXACT_HALF = "tf32x3"


def exact_precision(x: torch.Tensor) -> str:
    return EXACT_HALF if x.dtype in (torch.bfloat16, torch.float16) else EXACT


@triton.jit
def _chunk_gate(lg_ptr, row0, rows, T, H, C: tl.constexpr, REVERSE: tl.constexpr):
    """A gate's factors for one chunk of C positions `rows` (those ≥ T have a gate of 1), with log gates g at
    lg_ptr [B, T, H] (row0 = b·T·H + h). Pair (t, s), s ≤ t, weighs exp(Σ_{s<l≤t} g_l). Returns
    (rows' factor [C], keys' factor [C], pairs' factor [C, C] (0 off the causal side), the chunk's factor):
    left to right the state enters row i as exp(Σ_{l≤i} g_l) and key j reaches the chunk's end as
    exp(Σ_{l>j} g_l); right to left (the backward's scans) the state, taken as of the chunk's first position, enters
    row i as exp(Σ_{l>i} g_l) and key j reaches it as exp(Σ_{l≤j} g_l). The chunk moves the state on by
    exp(Σ g). Every exponent is a sum of the terms it spans (no difference of running sums): ≤ 0, no overflow and
    no cancellation; the pairs' sums are a dot of 0/1 masks with the gates, in tf32x3 (about float32)."""
    oc = tl.arange(0, C)
    g = tl.load(lg_ptr + row0 + rows.to(tl.int64) * H, mask=rows < T, other=0.0)                 # [C]
    following = tl.load(lg_ptr + row0 + (rows + 1).to(tl.int64) * H, mask=(oc < C - 1) & (rows + 1 < T),
                        other=0.0)                                                             # g_{i+1}, in the chunk
    upto = tl.cumsum(g, 0)                                                                     # Σ_{l≤i}
    after = tl.cumsum(following, 0, reverse=True)                                              # Σ_{l>i}
    if REVERSE:   # pair (row r, key c ≥ r): Σ_{r<l≤c} g_l = Σ_l [l > r] g_l [l ≤ c]
        spans = tl.dot(tl.where(oc[None, :] > oc[:, None], g[None, :], 0.0),
                       tl.where(oc[:, None] <= oc[None, :], 1.0, 0.0), input_precision="tf32x3")
        inner = tl.where(oc[:, None] <= oc[None, :], tl.exp(spans), 0.0)
        return tl.exp(after), tl.exp(upto), inner, tl.exp(tl.sum(g, 0))
    spans = tl.dot(tl.where(oc[None, :] <= oc[:, None], g[None, :], 0.0),    # pair (row i, key j ≤ i): Σ_{j<l≤i}
                   tl.where(oc[:, None] > oc[None, :], 1.0, 0.0), input_precision="tf32x3")
    inner = tl.where(oc[:, None] >= oc[None, :], tl.exp(spans), 0.0)
    return tl.exp(upto), tl.exp(after), inner, tl.exp(tl.sum(g, 0))


@triton.jit
def _block_state(k_ptr, v_ptr, s_ptr, z_ptr, ld_ptr, lg_ptr, T, H, K, V, delay, L: tl.constexpr,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_Z: tl.constexpr, DOT: tl.constexpr,
                 PREC: tl.constexpr, HAS_DECAY: tl.constexpr, REVERSE: tl.constexpr, HAS_GATE: tl.constexpr):
    """One block's Σ k ⊗ v [K, V] (and Σ k [K]) -> s_ptr [B·H, NB, K, V], z_ptr [B·H, NB, K]. Position s takes
    key and value s − delay (none before 0). With a decay (ld_ptr [H], log γ) position s weighs γ^(e − s), e the
    block's last position before T (γ^(s − f), f its first, if REVERSE). With a gate (lg_ptr [B, T, H], no delay)
    it weighs exp(Σ_{s<l≤e} g_l) (exp(Σ_{f≤l≤s} g_l) if REVERSE): chunk by chunk towards that end, the state so far
    times the chunk's factor plus its keys, each times its factor (`_chunk_gate`)."""
    blk, bh, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB = (T + L - 1) // L
    b, h = bh // H, bh % H
    ok, ov, oc = tl.arange(0, BK), iv * BV + tl.arange(0, BV), tl.arange(0, C)
    mk, mv = ok < K, ov < V
    k_base = k_ptr + (b.to(tl.int64) * T * H + h) * K
    v_base = v_ptr + (b.to(tl.int64) * T * H + h) * V
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    log_decay = 0.0
    if HAS_DECAY:
        log_decay = tl.load(ld_ptr + h)
    for i in range(0, L // C):
        if HAS_GATE and REVERSE:
            pos = blk * L + (L // C - 1 - i) * C + oc
        else:
            pos = blk * L + i * C + oc
        rows = pos - delay
        mr = (rows >= 0) & (rows < T - delay)
        kc = tl.load(k_base + rows[:, None].to(tl.int64) * H * K + ok[None, :], mask=mr[:, None] & mk[None, :],
                     other=0.0)                                                                # [C, BK]
        if HAS_GATE:
            _, k_factor, _, chunk_factor = _chunk_gate(lg_ptr, b.to(tl.int64) * T * H + h, pos, T, H, C, REVERSE)
            kc = kc.to(tl.float32) * k_factor[:, None]
            S = S * chunk_factor
            z = z * chunk_factor
        if HAS_DECAY:
            if REVERSE:
                dist = pos - blk * L
            else:
                dist = tl.minimum(blk * L + L, T) - 1 - pos
            kc = kc.to(tl.float32) * tl.exp(log_decay * tl.maximum(dist, 0).to(tl.float32))[:, None]
        kc = kc.to(DOT)
        vc = tl.load(v_base + rows[:, None].to(tl.int64) * H * V + ov[None, :], mask=mr[:, None] & mv[None, :],
                     other=0.0).to(DOT)                                                        # [C, BV]
        S += tl.dot(tl.trans(kc), vc, input_precision=PREC)
        if HAS_Z:
            z += tl.sum(kc.to(tl.float32), 0)
    out = (bh.to(tl.int64) * NB + blk) * K
    tl.store(s_ptr + (out + ok[:, None]) * V + ov[None, :], S, mask=mk[:, None] & mv[None, :])
    if HAS_Z:
        if iv == 0:
            tl.store(z_ptr + out + ok, z, mask=mk)


@triton.jit
def _prefix_states(s_ptr, z_ptr, s0_ptr, f_ptr, ld_ptr, bg_ptr, NB, T, H, K, V, L, BK: tl.constexpr,
                   BV: tl.constexpr, HAS_Z: tl.constexpr, HAS_S0: tl.constexpr, REVERSE: tl.constexpr,
                   FINAL: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_GATE: tl.constexpr):
    """In place over one (batch·head, value tile): the blocks' own states s_ptr [B·H, NB, K, V] (z_ptr [B·H, NB, K])
    become the states entering each block (exclusive prefix sum from the left, or suffix sum if REVERSE) plus the
    initial state s0_ptr [B·H, K, V+1]; the total goes to f_ptr [B·H, K, V+1] if FINAL. With a decay (ld_ptr [H])
    the running sum is multiplied by γ^n before each block of n positions is added (L, or what is left of T); with
    a gate, by exp of the block's sum of log gates (bg_ptr [B·H, NB])."""
    bh, iv = tl.program_id(0), tl.program_id(1)
    log_decay = 0.0
    if HAS_DECAY:
        log_decay = tl.load(ld_ptr + bh % H)
    ok, ov = tl.arange(0, BK), iv * BV + tl.arange(0, BV)
    mk, mv = ok < K, ov < V
    ms = mk[:, None] & mv[None, :]
    s_tile = ok[:, None] * V + ov[None, :]
    aug_tile = ok[:, None] * (V + 1) + ov[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(s0_ptr + bh.to(tl.int64) * K * (V + 1) + aug_tile, mask=ms, other=0.0)
        if HAS_Z:
            z = tl.load(s0_ptr + bh.to(tl.int64) * K * (V + 1) + ok * (V + 1) + V, mask=mk, other=0.0)
    i = 0
    while i < NB:                                      # a while loop: Triton's interpreter rejects range(runtime int)
        if REVERSE:
            blk = NB - 1 - i
        else:
            blk = i
        i += 1
        base = (bh.to(tl.int64) * NB + blk) * K
        x = tl.load(s_ptr + base * V + s_tile, mask=ms, other=0.0)
        tl.store(s_ptr + base * V + s_tile, S, mask=ms)
        factor = 1.0
        if HAS_GATE:
            factor = tl.exp(tl.load(bg_ptr + bh.to(tl.int64) * NB + blk))
        if HAS_DECAY:
            if REVERSE:
                factor = tl.exp(log_decay * L)
            else:
                factor = tl.exp(log_decay * tl.minimum(L, T - blk * L).to(tl.float32))
        S = S * factor + x
        if HAS_Z:
            if iv == 0:
                xz = tl.load(z_ptr + base + ok, mask=mk, other=0.0)
                tl.store(z_ptr + base + ok, z, mask=mk)
                z = z * factor + xz
    if FINAL:
        tl.store(f_ptr + bh.to(tl.int64) * K * (V + 1) + aug_tile, S, mask=ms)
        if HAS_Z:
            if iv == 0:
                tl.store(f_ptr + bh.to(tl.int64) * K * (V + 1) + ok * (V + 1) + V, z, mask=mk)


@triton.jit
def _block_scan(q_ptr, k_ptr, v_ptr, s_ptr, z_ptr, o_ptr, d_ptr, ld_ptr, lg_ptr, T, H, K, V, delay,
                L: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_Z: tl.constexpr,
                REVERSE: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                HAS_DECAY: tl.constexpr, HAS_GATE: tl.constexpr):
    """One block's outputs o_t = Σ_s (q_t·k_s) v_s [and d_t = Σ_s q_t·k_s] over s ≤ t (s ≥ t if REVERSE), starting
    from the state of everything before (after) the block: s_ptr [B·H, NB, K, V], z_ptr [B·H, NB, K].
    NORMALIZE (needs HAS_Z): o_t / max(d_t, tiny) is stored instead of o_t, in o_ptr's dtype. Position s takes key
    and value s − delay (none before 0; forward only). With a decay (ld_ptr [H], log γ) each pair weighs
    γ^|t − s|: the state reaches the chunk's rows as γ^(c+1) (γ^(C−c) if REVERSE), the chunk's own pairs as
    γ^|i − j|, and moves on by γ^C a chunk; every factor is exp(log γ × a distance ≥ 0) ≤ 1. With a gate
    (lg_ptr [B, T, H], log gates g; no delay) the pair weighs exp(Σ_{min<l≤max} g_l), in the same places with the
    chunk's own factors (`_chunk_gate`)."""
    blk, bh, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB = (T + L - 1) // L
    b, h = bh // H, bh % H
    ok, ov, oc = tl.arange(0, BK), iv * BV + tl.arange(0, BV), tl.arange(0, C)
    mk, mv = ok < K, ov < V
    row0 = b.to(tl.int64) * T * H + h
    q_base, k_base = q_ptr + row0 * K, k_ptr + row0 * K
    v_base, o_base = v_ptr + row0 * V, o_ptr + row0 * V
    state = (bh.to(tl.int64) * NB + blk) * K
    S = tl.load(s_ptr + (state + ok[:, None]) * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    z = tl.zeros([BK], dtype=tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + state + ok, mask=mk, other=0.0)
    if REVERSE:
        keep = oc[:, None] <= oc[None, :]                                                      # s ≥ t
    else:
        keep = oc[:, None] >= oc[None, :]                                                      # s ≤ t
    if HAS_DECAY:
        log_decay = tl.load(ld_ptr + h)
        ocf = oc.to(tl.float32)
        if REVERSE:
            q_factor, k_factor = tl.exp(log_decay * (C - ocf)), tl.exp(log_decay * ocf)        # [C]
        else:
            q_factor, k_factor = tl.exp(log_decay * (ocf + 1.0)), tl.exp(log_decay * (C - 1.0 - ocf))
        inner = tl.where(keep, tl.exp(log_decay * tl.abs(ocf[:, None] - ocf[None, :])), 0.0)  # [C, C]
        chunk_factor = tl.exp(log_decay * C)
    for i in range(0, L // C):                                                                 # chunks past T are all masked
        if REVERSE:
            rows = blk * L + (L // C - 1 - i) * C + oc
        else:
            rows = blk * L + i * C + oc
        mr = rows < T
        keys = rows - delay
        mkr = mr & (keys >= 0)
        if HAS_GATE:
            q_factor, k_factor, inner, chunk_factor = _chunk_gate(lg_ptr, row0, rows, T, H, C, REVERSE)
        qc = tl.load(q_base + rows[:, None].to(tl.int64) * H * K + ok[None, :], mask=mr[:, None] & mk[None, :],
                     other=0.0).to(DOT)                                                        # [C, BK]
        kc = tl.load(k_base + keys[:, None].to(tl.int64) * H * K + ok[None, :], mask=mkr[:, None] & mk[None, :],
                     other=0.0).to(DOT)                                                        # [C, BK]
        vc = tl.load(v_base + keys[:, None].to(tl.int64) * H * V + ov[None, :], mask=mkr[:, None] & mv[None, :],
                     other=0.0).to(DOT)                                                        # [C, BV]
        A = tl.dot(qc, tl.trans(kc), input_precision=PREC)                                     # [C, C]
        if HAS_DECAY or HAS_GATE:
            A = A * inner
            o = tl.dot(qc, S.to(DOT), input_precision=PREC) * q_factor[:, None]
            o += tl.dot(A.to(DOT), vc, input_precision=PREC)
        else:
            A = tl.where(keep, A, 0.0)
            o = tl.dot(qc, S.to(DOT), input_precision=PREC) + tl.dot(A.to(DOT), vc, input_precision=PREC)
        if HAS_DECAY or HAS_GATE:                      # the chunk's keys as of its end (start if REVERSE)
            kc = (kc.to(tl.float32) * k_factor[:, None]).to(DOT)
        if HAS_Z:
            d = tl.sum(qc.to(tl.float32) * z[None, :], 1)                                      # [C]
            if HAS_DECAY or HAS_GATE:
                d = d * q_factor
            d += tl.sum(A, 1)
            if iv == 0:
                tl.store(d_ptr + row0 + rows.to(tl.int64) * H, d, mask=mr)
            if NORMALIZE:
                o = o / tl.maximum(d, 1.1754943508222875e-38)[:, None]
            if HAS_DECAY or HAS_GATE:
                z = z * chunk_factor
            z += tl.sum(kc.to(tl.float32), 0)
        tl.store(o_base + rows[:, None].to(tl.int64) * H * V + ov[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mr[:, None] & mv[None, :])
        if HAS_DECAY or HAS_GATE:
            S = S * chunk_factor
        S += tl.dot(tl.trans(kc), vc, input_precision=PREC)


@triton.jit
def _decode_step(q_ptr, k_ptr, v_ptr, s_ptr, s_out_ptr, o_ptr, ld_ptr, H, K, V,
                 BK: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr, HAS_DECAY: tl.constexpr,
                 HAS_GATE: tl.constexpr):
    """One token per (batch, head): S' = γ S + k ⊗ [v, 1] (γ = exp(ld_ptr[h]) with a decay, exp(ld_ptr[b·H + h])
    with a gate, else 1; s_out may be s: in place), then o = (q·S')[:V] / max((q·S')[V], tiny), or [num, den] if
    not NORMALIZE."""
    bh = tl.program_id(0)
    ok, ov = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv, mv1 = ok < K, ov < V, ov <= V
    q = tl.load(q_ptr + bh * K + ok, mask=mk, other=0.0).to(tl.float32)                       # [BK]
    k = tl.load(k_ptr + bh * K + ok, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + bh * V + ov, mask=mv, other=0.0).to(tl.float32)                       # [BV]
    v = tl.where(ov == V, 1.0, v)                                                              # [v, 1]
    s_off = bh.to(tl.int64) * K * (V + 1) + ok[:, None] * (V + 1) + ov[None, :]
    S = tl.load(s_ptr + s_off, mask=mk[:, None] & mv1[None, :], other=0.0)
    if HAS_DECAY:
        S = S * tl.exp(tl.load(ld_ptr + bh % H))
    if HAS_GATE:
        S = S * tl.exp(tl.load(ld_ptr + bh))
    S += k[:, None] * v[None, :]
    tl.store(s_out_ptr + s_off, S, mask=mk[:, None] & mv1[None, :])
    num = tl.sum(q[:, None] * S, 0)                                                            # [BV]
    if NORMALIZE:
        den = tl.sum(tl.where(ov == V, num, 0.0), 0)
        tl.store(o_ptr + bh * V + ov, num / tl.maximum(den, 1.1754943508222875e-38), mask=mv)
    else:
        tl.store(o_ptr + bh * (V + 1) + ov, num, mask=mv1)


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


@triton.jit
def _prf_ring_step(q_ptr, k_ptr, v_ptr, w_ptr, lw_ptr, cnt_ptr, ks_ptr, gain_ptr, rate_ptr, s_ptr, rk_ptr, rv_ptr,
                   rvalid_ptr, pos_ptr, sk_ptr, sv_ptr, svalid_ptr, arrive_ptr, o_ptr, H, G, D, M, V, W, NS,
                   root_s, scaling, max_excess, BD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
                   BW: tl.constexpr, BS: tl.constexpr, BKV: tl.constexpr, HAS_DECAY: tl.constexpr,
                   HAS_SINK: tl.constexpr):
    """A window hybrid's whole static decode step for one (batch, head) (`LinearAttention.ring_step`): the key in
    ring slot p mod W (p = pos_ptr[0], read here) leaves the window: its PRF features (on query head h's map) join
    the state in place, S ← γ S + φk ⊗ [v, 1] (γ = exp(−min(exp(rate_ptr[h]), 1e4)) with a decay; nothing if the
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
        decay = tl.exp(-tl.minimum(tl.exp(tl.load(rate_ptr + h).to(tl.float32)), 1e4))
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


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: the kernels then run on CPU tensors (slowly), for tests without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


INTERPRETER_SMS = 8   # the streaming multiprocessors the block plan assumes off CUDA (tests/gpu_dots.py sets a GPU's)


def _plan(T: int, BH: int, K: int, V: int, device: torch.device, block: int | None = None) -> tuple[int, int, int]:
    """(L, BK, BV): block length (a power-of-two multiple of CHUNK, or `block`), padded feature tile, value tile."""
    BK = _pow2(K)
    BV = min(_pow2(V), max(16, MAX_TILE // BK))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_SMS
    if block is not None:
        if block < CHUNK or block & (block - 1):
            raise ValueError(f"block must be a power of two >= {CHUNK}, got {block}")
        return block, BK, BV
    L = CHUNK
    while L < 1024 and -(-T // (2 * L)) * BH >= 2 * sms:   # longer blocks while two programs per SM remain
        L *= 2
    return L, BK, BV


def _value_tile(BV: int, *dots) -> int:
    """The value tile for kernels whose dots run in `dots`: 16-bit dots against a tile under 64 columns fault
    (illegal address) or go wrong on an H100 with Triton 3.6, so those get 64 (masked)."""
    return max(BV, 64) if any(dot != tl.float32 for dot in dots) else BV


def _scan_launch(BK: int, gate: bool = False) -> tuple[int, int, int]:
    """(chunk, pipeline stages, warps) of the scan's kernels for a feature tile of BK (with a gate or without).
    Wide tiles: shorter chunks and no pipelining keep the chunk tiles inside shared memory (227 KB), and 8 warps
    spill a fifth to a half as much (ptxas, sm_90). A gate adds C × C tiles (its pairs' spans and factors): at
    chunks of 64 on 4 warps the gated scan spills 6–9 KB a thread, at chunks of 32 on 8 warps 0 (M = 64) or about
    0.2 KB (M = 128) (`benchmarks/kernel_registers.py --gate`; not timed on a GPU yet)."""
    if BK <= 128:
        return (32, 2, 8) if gate else (CHUNK, 2, 4)
    return (32 if BK <= 256 else 16), 1, 8


def _prf_tiles(M: int) -> tuple[int, int]:
    """(feature tile, token tile) of the feature-map kernel."""
    BM = _pow2(M)
    return BM, (64 if BM <= 128 else 32)


PRF_WARPS = 8      # the feature map: no spills in ptxas' report at 8 warps with tf32x3 (sm_90)
WINDOW_WARPS = 8   # the window's exact part: no spills at 8 warps on 16-bit inputs, 560 bytes at 4 (ptxas, sm_90)
RING_WARPS = 8     # the window hybrid's decode step: no spills at 8 warps for M = 64-256, 68-1300 bytes at 4 (sm_90)


def _dot_dtype(*xs: torch.Tensor):
    half = all(x.dtype in (torch.bfloat16, torch.float16) for x in xs) and len({x.dtype for x in xs}) == 1
    if half:
        return (tl.bfloat16 if xs[0].dtype == torch.bfloat16 else tl.float16), "tf32"   # PREC unused for 16-bit
    return tl.float32, "tf32x3"


def scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor | None = None,
         with_den: bool = False, reverse: bool = False, final_state: bool = False, normalize: bool = False,
         out_dtype: torch.dtype = torch.float32, block: int | None = None, delay: int = 0,
         log_decay: torch.Tensor | None = None, log_gate: torch.Tensor | None = None):
    """o_t = Σ_{s≤t} (q_t·k_s) v_s (s ≥ t if reverse), from the initial state S0 [B, H, K, V+1] (its last column:
    the normaliser, used with `with_den`). With `delay` = W > 0 (forward only) position s holds key and value s − W
    instead, none before W: the keys as the window hybrid's linear part sees them, read in place. With `log_decay`
    [H] (float32, in [-1e4, 0]) the pair (t, s) weighs γ^|t − s| more, and S0 reaches t as γ^(t+1) (forward only).
    With `log_gate` [B, T, H] (float32, in [-1e4, 0]; not with a decay or a delay) it weighs exp(Σ_{s<l≤t} g_l)
    (exp(Σ_{t<l≤s} g_l) if reverse) more, and S0 reaches t as exp(Σ_{l≤t} g_l) (forward only).

    q, k [B, T, H, K], v [B, T, H, V] -> (o [B, T, H, V] in out_dtype, divided by max(den, tiny) if normalize;
    den [B, T, H] float32 or None; the state after all tokens [B, H, K, V+1] float32 (last column Σ k, with_den
    only) or None). `block` fixes the block length (tests).
    """
    if normalize and not with_den:
        raise ValueError("normalize needs with_den")
    if delay and reverse:
        raise ValueError("delay is for the forward scan only")
    if (log_decay is not None or log_gate is not None) and reverse and (S0 is not None or final_state):
        raise ValueError("with a decay or a gate, an initial or final state is for the forward scan only")
    if log_gate is not None and (log_decay is not None or delay):
        raise ValueError("a gate takes no decay and no delay")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, T, H, K = q.shape
    V = v.shape[-1]
    L, BK, BV = _plan(T, B * H, K, V, q.device, block)
    DOT, PREC = _dot_dtype(q, k, v)
    BV = _value_tile(BV, DOT)             # also for wide features, whose register budget would narrow the tile
    NB, NV = triton.cdiv(T, L), triton.cdiv(V, BV)
    f32 = dict(device=q.device, dtype=torch.float32)
    grid = (NB, B * H, NV)
    C, stages, warps = _scan_launch(BK, log_gate is not None)
    if S0 is not None:
        S0 = S0.float().contiguous()
    if log_decay is not None:
        log_decay = log_decay.float().contiguous()
    gated = log_gate is not None
    if gated:
        log_gate = log_gate.float().contiguous()

    final = torch.empty(B, H, K, V + 1, **f32) if final_state else None
    if NB == 1 and not final_state:                                    # one block: it starts from S0 (or zeros)
        if S0 is None:
            s_in = torch.zeros(B * H, 1, K, V, **f32)
            z_in = torch.zeros(B * H, 1, K, **f32) if with_den else s_in
        else:
            s_in = S0[..., :V].reshape(B * H, 1, K, V).contiguous()
            z_in = S0[..., V].reshape(B * H, 1, K).contiguous() if with_den else s_in
    else:
        s_in = torch.empty(B * H, NB, K, V, **f32)
        z_in = torch.empty(B * H, NB, K, **f32) if with_den else s_in
        ld = s_in if log_decay is None else log_decay
        lg = log_gate if gated else s_in
        bg = block_gates(log_gate, L) if gated else s_in
        _block_state[grid](k, v, s_in, z_in, ld, lg, T, H, K, V, delay, L, C=C, BK=BK, BV=BV, HAS_Z=with_den,
                           DOT=DOT, PREC=PREC, HAS_DECAY=log_decay is not None,
                           REVERSE=reverse and (log_decay is not None or gated), HAS_GATE=gated,
                           num_stages=stages, num_warps=warps)
        _prefix_states[(B * H, NV)](s_in, z_in, S0 if S0 is not None else s_in, final if final_state else s_in,
                                    ld, bg, NB, T, H, K, V, L, BK=BK, BV=BV, HAS_Z=with_den, HAS_S0=S0 is not None,
                                    REVERSE=reverse, FINAL=final_state, HAS_DECAY=log_decay is not None,
                                    HAS_GATE=gated, num_warps=warps)
        if final_state and not with_den:
            final[..., V] = 0.0
    o = torch.empty(B, T, H, V, device=q.device, dtype=out_dtype)
    den = torch.empty(B, T, H, **f32) if with_den else o
    _block_scan[grid](q, k, v, s_in, z_in, o, den, o if log_decay is None else log_decay, log_gate if gated else o,
                      T, H, K, V, delay, L, C=C, BK=BK, BV=BV, HAS_Z=with_den, REVERSE=reverse, NORMALIZE=normalize,
                      DOT=DOT, PREC=PREC, HAS_DECAY=log_decay is not None, HAS_GATE=gated, num_stages=stages,
                      num_warps=warps)
    return o, (den if with_den else None), final


def block_gates(log_gate: torch.Tensor, L: int) -> torch.Tensor:
    """[B, T, H] log gates -> [B·H, NB] float32: each block of L positions' sum (what moves the state across it)."""
    B, T, H = log_gate.shape
    NB = -(-T // L)
    padded = torch.nn.functional.pad(log_gate, (0, 0, 0, NB * L - T))                         # gate 1 past T
    return padded.view(B, NB, L, H).sum(2).permute(0, 2, 1).reshape(B * H, NB).contiguous()


class LinearScan(torch.autograd.Function):
    """Causal linear attention from the initial state S0 [B, H, M, V+1], with a decay (log_decay [H] float32, in
    [-1e4, 0]), a gate (log_gate [B, T, H] float32, in [-1e4, 0]) or neither: o [B, T, H, V] in v.dtype
    (normalize) or [num, den] [B, T, H, V+1] float32, and the final state [B, H, M, V+1] (want_state) or None."""

    @staticmethod
    def run(phi_q, phi_k, v, S0, log_decay, log_gate, want_state: bool, normalize: bool):
        """The forward's kernels: (o, or [num, den] if not normalize; the final state or None; den)."""
        o, den, final = scan(phi_q, phi_k, v, S0, with_den=True, final_state=want_state, normalize=normalize,
                             out_dtype=v.dtype if normalize else torch.float32, log_decay=log_decay,
                             log_gate=log_gate)
        return (o if normalize else torch.cat([o, den[..., None]], -1)), final, den           # [B, T, H, V+1]

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, S0, log_decay, log_gate, want_state: bool, normalize: bool):
        out, final, den = LinearScan.run(phi_q, phi_k, v, S0, log_decay, log_gate, want_state, normalize)
        ctx.normalize = normalize
        if normalize:
            ctx.save_for_backward(phi_q, phi_k, v, S0, log_decay, log_gate, out, den)
        else:
            ctx.save_for_backward(phi_q, phi_k, v, S0, log_decay, log_gate)
        return out, final

    @staticmethod
    def backward(ctx, g_out, g_state):
        phi_q, phi_k, v, S0, log_decay, log_gate = ctx.saved_tensors[:6]
        if ctx.normalize:                             # o = num / max(den, tiny): back to ∂num, ∂den
            o, den = ctx.saved_tensors[6:]
            g_o = g_out.float()
            den_c = den.clamp_min(TINY)[..., None]                                             # [B, T, H, 1]
            g_den = torch.where(den[..., None] >= TINY, -(g_o * o.float()).sum(-1, keepdim=True) / den_c, 0.0)
            g_aug = torch.cat([g_o / den_c, g_den], -1)                                        # [B, T, H, V+1]
        else:
            g_aug = g_out.float()
        if log_gate is not None:
            dq, dk, dv, dS0, d_log_gate = gated_scan_grads(phi_q, phi_k, v, S0, g_aug, g_state, log_gate)
            return dq.to(phi_q.dtype), dk.to(phi_k.dtype), dv.to(v.dtype), dS0, None, d_log_gate, None, None
        dq, dk, dv, dS0, d_log_decay = scan_grads(phi_q, phi_k, v, S0, g_aug, g_state, log_decay)
        return dq.to(phi_q.dtype), dk.to(phi_k.dtype), dv.to(v.dtype), dS0, d_log_decay, None, None, None


def scan_grads(phi_q, phi_k, v, S0, g_aug, g_state, log_decay=None):
    """Gradients of the unnormalised scan [num, den]_t = φq_t·(γ^(t+1) S0 + Σ_{s≤t} γ^(t−s) φk_s ⊗ [v_s, 1]) and
    of its final state, given g_aug = [∂num, ∂den] [B, T, H, V+1] float32, g_state [B, H, M, V+1] or None and
    log_decay [H] (log γ) or None (γ = 1): (∂φq, ∂φk, ∂v, ∂S0 or None, ∂log γ or None), three scans (decayed by
    the same γ^|t − s|) plus the initial and final states' terms.

    ∂log γ = Σ over pairs of (t − s) × the pair's share of the loss. With φq_t·∂φq_t the sum of row t's pair terms
    and φk_s·∂φk_s the sum of column s's, that is Σ_t t φq_t·∂φq_t − Σ_s s φk_s·∂φk_s over the pairs, plus
    (t + 1) for S0's terms in row t, T − 1 − s for key s's term in the final state, and T for S0's there; the
    position sums run in float64."""
    dtype = phi_q.dtype if phi_q.dtype == phi_k.dtype == v.dtype else torch.float32
    g = g_aug.to(dtype)                                                                        # [B, T, H, V+1]
    v_aug = augment_values(v, dtype)                                                           # [B, T, H, V+1]
    decay = {} if log_decay is None else {"log_decay": log_decay}
    dq = scan(g, v_aug, phi_k.to(dtype), **decay)[0]                                           # [B, T, H, M]
    dk = scan(v_aug, g, phi_q.to(dtype), reverse=True, **decay)[0]                             # [B, T, H, M]
    dv = scan(phi_k.to(dtype), phi_q.to(dtype), g[..., :-1], reverse=True, **decay)[0]         # [B, T, H, V]
    T = phi_q.shape[1]
    if log_decay is not None:
        steps = torch.arange(T + 1, device=phi_q.device, dtype=torch.float64)
        to_row = torch.exp(log_decay.double()[None, :] * steps[1:, None]).float()              # [T, H]: γ^(t+1)
        to_end = torch.exp(log_decay.double()[None, :] * steps[:T].flip(0)[:, None]).float()   # [T, H]: γ^(T−1−s)
        lag = (phi_q.double() * dq.double()).sum(-1) - (phi_k.double() * dk.double()).sum(-1)   # [B, T, H]
        d_log_decay = torch.einsum("bth,t->h", lag, steps[:T])
    dS0 = None
    if S0 is not None:
        g_row = g_aug if log_decay is None else g_aug * to_row[..., None]                      # γ^(t+1) g_t
        dq_state = torch.einsum("bthv,bhmv->bthm", g_row, S0.float())
        dq = dq + dq_state
        dS0 = torch.einsum("bthm,bthv->bhmv", phi_q.float(), g_row)
        if log_decay is not None:
            d_log_decay += torch.einsum("bth,t->h", (phi_q.double() * dq_state.double()).sum(-1), steps[1:])
    if g_state is not None:                           # the final state γ^T S0 + Σ γ^(T−1−s) φk ⊗ v̄ is differentiable too
        g_state = g_state.float()
        v_end = v_aug.float() if log_decay is None else v_aug.float() * to_end[..., None]      # γ^(T−1−s) v̄_s
        dk_state = torch.einsum("bthv,bhmv->bthm", v_end, g_state)
        dk = dk + dk_state
        dv = dv + torch.einsum("bthm,bhmv->bthv", phi_k.float(), g_state[..., :-1]) * (
            1.0 if log_decay is None else to_end[..., None])
        if S0 is not None:
            state_factor = 1.0 if log_decay is None else torch.exp(log_decay * T)[:, None, None]   # γ^T
            dS0 = dS0 + state_factor * g_state
        if log_decay is not None:
            d_log_decay += torch.einsum("bth,t->h", (phi_k.double() * dk_state.double()).sum(-1), steps[:T].flip(0))
            if S0 is not None:
                d_log_decay += T * torch.exp(log_decay.double() * T) * (S0.double() * g_state.double()).sum((0, 2, 3))
    return dq, dk, dv, dS0, (None if log_decay is None else d_log_decay.to(log_decay.dtype))


def gated_scan_grads(phi_q, phi_k, v, S0, g_aug, g_state, log_gate):
    """`scan_grads` with a gate: the unnormalised scan [num, den]_t = φq_t·(a_t S0 + Σ_{s≤t} w_ts φk_s ⊗ [v_s, 1])
    with w_ts = exp(Σ_{s<l≤t} g_l) and a_t = exp(Σ_{l≤t} g_l), log_gate g [B, T, H] (float32, in [-1e4, 0]):
    (∂φq, ∂φk, ∂v, ∂S0 or None, ∂g), three gated scans plus the initial and final states' terms.

    ∂g_j sums the shares of the loss of every pair whose span holds j (s < j ≤ t). With R_t = φq_t·∂φq_t (row t's
    pairs and S0's term) and K_s = φk_s·∂φk_s (column s's pairs), that is Σ_{t≥j} R_t − Σ_{s≥j} K_s; key s's term
    in the final state (a span s < j ≤ T − 1) adds Σ_{s<j} φk_s·∂φk_s of those terms, and S0's in the final state
    (every j) its share. The sums run in float64."""
    dtype = phi_q.dtype if phi_q.dtype == phi_k.dtype == v.dtype else torch.float32
    g = g_aug.to(dtype)                                                                        # [B, T, H, V+1]
    v_aug = augment_values(v, dtype)                                                           # [B, T, H, V+1]
    dq = scan(g, v_aug, phi_k.to(dtype), log_gate=log_gate)[0].float()                         # [B, T, H, M]
    dk = scan(v_aug, g, phi_q.to(dtype), reverse=True, log_gate=log_gate)[0].float()
    dv = scan(phi_k.to(dtype), phi_q.to(dtype), g[..., :-1], reverse=True, log_gate=log_gate)[0].float()
    lg = log_gate.double()
    upto = lg.cumsum(1)                                                                        # Σ_{l≤t} [B, T, H]
    after = torch.nn.functional.pad(lg.flip(1).cumsum(1).flip(1)[:, 1:], (0, 0, 0, 1))        # Σ_{l>s}
    pairs_k = (phi_k.double() * dk.double()).sum(-1)                                           # K_s [B, T, H]
    dS0 = None
    if S0 is not None:
        g_row = g_aug.float() * torch.exp(upto).float()[..., None]                             # a_t g_t
        dq = dq + torch.einsum("bthv,bhmv->bthm", g_row, S0.float())
        dS0 = torch.einsum("bthm,bthv->bhmv", phi_q.float(), g_row)
    rows = (phi_q.double() * dq.double()).sum(-1)                                              # R_t
    d_gate = (rows - pairs_k).flip(1).cumsum(1).flip(1)                                        # Σ_{t≥j} − Σ_{s≥j}
    if g_state is not None:        # final state: a_T S0 + Σ_s exp(Σ_{l>s} g_l) φk_s ⊗ [v_s, 1]
        g_state = g_state.float()
        to_end = torch.exp(after).float()[..., None]                                           # [B, T, H, 1]
        dk_state = torch.einsum("bthv,bhmv->bthm", v_aug.float() * to_end, g_state)
        dk = dk + dk_state
        dv = dv + torch.einsum("bthm,bhmv->bthv", phi_k.float(), g_state[..., :-1]) * to_end
        ends = (phi_k.double() * dk_state.double()).sum(-1)                                    # [B, T, H]
        d_gate = d_gate + torch.nn.functional.pad(ends.cumsum(1)[:, :-1], (0, 0, 1, 0))       # Σ_{s<j}
        if S0 is not None:
            whole = torch.exp(upto[:, -1])                                                     # a_T [B, H]
            dS0 = dS0 + whole.float()[..., None, None] * g_state
            d_gate = d_gate + (whole * (S0.double() * g_state.double()).sum((2, 3)))[:, None, :]
    return dq, dk, dv, dS0, d_gate.to(log_gate.dtype)


def triton_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                            initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                            normalize: bool = True, log_decay: torch.Tensor | None = None,
                            log_gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention with dofattn's Triton kernels (CUDA; forward and backward).

    phi_q, phi_k: [B, T, H, M]; v: [B, T, H, V]; initial_state: [B, H, M, V+1] or None (zeros); log_decay [H]
    (≤ 0) or log_gate [B, T, H] (≤ 0) or neither, as in `naive_linear_attention`.
    Returns o [B, T, H, V] in v.dtype (or [num, den] [B, T, H, V+1] float32 if not normalize) and the final state
    [B, H, M, V+1] float32 if output_final_state, else None. Gradients flow to φq, φk, v, the initial state and
    log_decay or log_gate from both outputs.
    """
    check_inputs(phi_q, phi_k, v, initial_state, log_decay, log_gate)
    if not (phi_q.is_cuda or interpreting()):
        raise RuntimeError(f"triton_linear_attention needs CUDA tensors, got {phi_q.device}; use backend='chunk'")
    if log_decay is not None:
        log_decay = decay_log(log_decay, torch.float32)                # differentiable clamp to [-1e4, 0]
    if log_gate is not None:
        log_gate = decay_log(log_gate, torch.float32)                  # the same clamp, per token
    grad = needs_grad(phi_q, phi_k, v, initial_state, log_decay, log_gate)
    if phi_q.shape[1] == 1 and not grad:                              # decode: one kernel, a new state
        B, _, H, M = phi_q.shape
        S0 = (torch.zeros(B, H, M, v.shape[-1] + 1, device=v.device) if initial_state is None
              else initial_state.float().contiguous())
        S1 = torch.empty_like(S0)
        o = triton_decode_step(phi_q, phi_k, v, S0, S1, normalize=normalize, log_decay=log_decay, log_gate=log_gate)
        return (o.to(v.dtype) if normalize else o), (S1 if output_final_state else None)
    S0 = None if initial_state is None else initial_state.float().contiguous()
    if not grad:                              # a prefill: the forward alone, without autograd's bookkeeping
        out, final, _ = LinearScan.run(phi_q, phi_k, v, S0, log_decay, log_gate, output_final_state, normalize)
        return out, final
    return LinearScan.apply(phi_q, phi_k, v, S0, log_decay, log_gate, output_final_state, normalize)


def triton_decode_step(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                       out_state: torch.Tensor | None = None, normalize: bool = True,
                       log_decay: torch.Tensor | None = None, log_gate: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step in one kernel: out_state = γ state + φk ⊗ [v, 1] (γ = exp(log_decay) per head with a decay,
    exp(log_gate) per batch row and head with a gate, else 1) and the output read from it.

    phi_q, phi_k [B, 1, H, M]; v [B, 1, H, V]; state [B, H, M, V+1] float32 contiguous; out_state: where the new
    state goes (pass `state` itself to update in place); log_decay [H], log_gate [B, 1, H] or neither. Returns
    o [B, 1, H, V] float32, or [num, den] [B, 1, H, V+1] if not normalize. No autograd: for training use
    `triton_linear_attention`.
    """
    check_inputs(phi_q, phi_k, v, state, log_decay, log_gate)
    if phi_q.shape[1] != 1 or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"triton_decode_step takes one token (T = 1) and a contiguous float32 state, got "
                         f"T = {phi_q.shape[1]}, state {state.dtype}")
    if out_state is None:
        out_state = torch.empty_like(state)
    elif out_state.shape != state.shape or out_state.dtype != torch.float32 or not out_state.is_contiguous():
        raise ValueError(f"out_state must be a contiguous float32 tensor shaped like the state "
                         f"{tuple(state.shape)}, got {tuple(out_state.shape)} {out_state.dtype}")
    B, _, H, K = phi_q.shape
    V = v.shape[-1]
    o = torch.empty(B, 1, H, V + (0 if normalize else 1), device=v.device, dtype=torch.float32)
    ld = o if log_decay is None else decay_log(log_decay, torch.float32).contiguous()
    if log_gate is not None:
        ld = decay_log(log_gate, torch.float32).contiguous()                                 # [B, 1, H]: b·H + h
    _decode_step[(B * H,)](phi_q.contiguous(), phi_k.contiguous(), v.contiguous(), state, out_state, o, ld, H, K, V,
                           BK=_pow2(K), BV=_pow2(V + 1), NORMALIZE=normalize, HAS_DECAY=log_decay is not None,
                           HAS_GATE=log_gate is not None)
    return o


def _prf_args(fmap):
    """Directions [H, M, D], log-weights [H, M] (float32, contiguous) and per-head counts [H] (int32) of a PRF map.

    Kept on the map between calls (a decode step is launch-bound: no conversions per token) and rebuilt when the
    parameters change (their version counter moves on every in-place update) or move."""
    w, lw = fmap.directions, fmap.log_weights
    key = (w.data_ptr(), w._version, lw.data_ptr(), lw._version, w.dtype, lw.dtype)
    cached = getattr(fmap, "_fused_args", None)
    if cached is None or cached[0] != key:
        counts = fmap.head_dims if fmap.head_dims is not None else [fmap.dim] * fmap.num_heads
        args = (w.detach().float().contiguous(), lw.detach().float().contiguous(),
                torch.tensor(counts, dtype=torch.int32, device=w.device))
        cached = (key, args)
        fmap._fused_args = cached
    return cached[1]


def prf_features(fmap, x: torch.Tensor, role: str, max_excess: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`PositiveRandomFeatures.features` in one kernel, without autograd: x [B, T, H, D] -> (φ [B, T, H, M] in x's
    dtype if 16-bit else float32, the query log-scale [B, T, H] float32 or None for keys). Keys use the map's current
    `key_shift`, which must be finite (calibrated)."""
    B, T, H, D = x.shape
    M = fmap.dim
    w, lw, counts = _prf_args(fmap)
    dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    phi = torch.empty(B, T, H, M, device=x.device, dtype=dtype)
    query = role == "query"
    scale = torch.empty(B, T, H, device=x.device, dtype=torch.float32) if query else phi
    BM, BT = _prf_tiles(M)
    grid = (triton.cdiv(T, BT), B * H)
    _prf_features[grid](x.contiguous(), w, lw, counts, fmap.key_shift, phi, scale, T, H, D, M,
                        fmap.scaling ** 0.5, max_excess, BT=BT, BD=_pow2(D), BM=BM, QUERY=query,
                        EXACT_PREC=exact_precision(x), num_warps=PRF_WARPS)
    return phi, (scale if query else None)


def prf_decode_step(fmap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
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
    Hkv, V, M = k.shape[2], v.shape[-1], fmap.dim
    if state.shape != (B, H, M, V + 1) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"prf_decode_step needs a contiguous float32 state [B, H, M, V+1] = {(B, H, M, V + 1)}, got "
                         f"{tuple(state.shape)} {state.dtype}")
    w, lw, counts = _prf_args(fmap)
    o = torch.empty(B, 1, H, V, device=q.device, dtype=q.dtype)
    valid = None if key_valid is None else key_valid.reshape(B).contiguous()
    ld = state if log_decay is None else decay_log(log_decay, torch.float32).contiguous()
    _prf_decode_step[(B * H,)](q.contiguous(), k.contiguous(), v.contiguous(), w, lw, counts, fmap.key_shift, state, o,
                               state if valid is None else valid, ld, H, H // Hkv, D, M, V, fmap.scaling ** 0.5,
                               max_excess, BD=_pow2(D), BM=_pow2(M), BV=_pow2(V + 1), HAS_VALID=valid is not None,
                               HAS_DECAY=log_decay is not None)
    return o


def _tile(n: int) -> int:
    """A power-of-two tile of at least 2 for n rows (ring slots, sink slots): no dot needs 16."""
    return max(2, triton.next_power_of_2(n))


def prf_ring_step(fmap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, key_valid: torch.Tensor, position: torch.Tensor, log_gain: torch.Tensor,
                  max_excess: float, decay_rate: torch.Tensor | None = None, sink_keys: torch.Tensor | None = None,
                  sink_values: torch.Tensor | None = None, sink_valid: torch.Tensor | None = None,
                  arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """`LinearAttention.ring_step` of a PRF window hybrid in one kernel: the state, the ring and its flags updated in
    place, the position read on the device (no host sync: a CUDA graph can replay it).

    q [B, 1, H, D] (after RoPE); k, v [B, 1, Hkv, D | V] on kv heads (H a multiple of Hkv); state [B, H, M, V+1]
    float32 contiguous; keys, values [B, W, Hkv, D | V] and key_valid [B, W] bool: the ring (slot p mod W holds the
    key at position p), contiguous; position [1] int64: p, the token being decoded; log_gain [H]; decay_rate [H] or
    None: log γ_h = −min(exp(decay_rate_h), 1e4) (`LinearAttention.log_decay`), computed in the kernel; sink_keys,
    sink_values [B, S, Hkv, D | V] and sink_valid [B, S] or None: exact keys beside the ring, never folded;
    arrivals [B] int32 zeros (kept between steps, `RingWindowLayer.arrivals`; None: a new one). The map's key_shift
    must be finite. Returns o [B, 1, H, V] in q.dtype.

    One program per (batch, query head), each reading its kv head's W ring slots: the G query heads of a kv head
    all read the slot that the step overwrites, and every head of a batch row its flag. So nobody writes until
    everyone has read: each program uses the new key from registers, and when done (a barrier, then an acq_rel
    atomic) counts itself in arrivals[b]; the last of the row writes the new keys, values and flag and resets the
    count. One program per kv head looping over its query heads would still share the flag across kv heads (and
    would run G heads one after the other).
    """
    B, _, H, D = q.shape
    Hkv, V, M, W = k.shape[2], v.shape[-1], fmap.dim, keys.shape[1]
    if state.shape != (B, H, M, V + 1) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"prf_ring_step needs a contiguous float32 state [B, H, M, V+1] = {(B, H, M, V + 1)}, got "
                         f"{tuple(state.shape)} {state.dtype}")
    for x, shape in ((keys, (B, W, Hkv, D)), (values, (B, W, Hkv, V)), (key_valid, (B, W))):
        if x.shape != shape or not x.is_contiguous():
            raise ValueError(f"prf_ring_step updates the ring in place: it needs contiguous buffers shaped {shape}, "
                             f"got {tuple(x.shape)} (contiguous: {x.is_contiguous()})")
    sink = sink_keys is not None and sink_keys.shape[1] > 0
    if sink:   # read only: copied if not contiguous (`RingWindowLayer.from_layer` makes them so)
        S = sink_keys.shape[1]
        if sink_keys.shape != (B, S, Hkv, D) or sink_values.shape != (B, S, Hkv, V) or sink_valid.shape != (B, S):
            raise ValueError(f"prf_ring_step needs sink keys, values and flags shaped {(B, S, Hkv, D)}, "
                             f"{(B, S, Hkv, V)} and {(B, S)}, got {tuple(sink_keys.shape)}, "
                             f"{tuple(sink_values.shape)} and {tuple(sink_valid.shape)}")
        sink_keys, sink_values, sink_valid = sink_keys.contiguous(), sink_values.contiguous(), sink_valid.contiguous()
    if not (q.is_cuda or interpreting()):
        raise RuntimeError(f"prf_ring_step needs CUDA tensors, got {q.device}; use the PyTorch ring step")
    w, lw, counts = _prf_args(fmap)
    if arrivals is None:
        arrivals = torch.zeros(B, dtype=torch.int32, device=q.device)
    o = torch.empty(B, 1, H, V, device=q.device, dtype=q.dtype)
    flags = key_valid.view(torch.uint8)
    _prf_ring_step[(B * H,)](
        q.contiguous(), k.contiguous(), v.contiguous(), w, lw, counts, fmap.key_shift, log_gain,
        log_gain if decay_rate is None else decay_rate, state, keys, values, flags, position,
        sink_keys if sink else keys, sink_values if sink else values, sink_valid.view(torch.uint8) if sink else flags,
        arrivals, o, H, H // Hkv, D, M, V, W, S if sink else 0, fmap.scaling ** 0.5, fmap.scaling, max_excess,
        BD=_pow2(D), BM=_pow2(M), BV=_pow2(V), BW=_tile(W), BS=_tile(S) if sink else 2,
        BKV=triton.next_power_of_2(Hkv * max(D, V)), HAS_DECAY=decay_rate is not None, HAS_SINK=sink,
        num_warps=RING_WARPS)
    return o


WINDOWS = (16, 32, 64)   # window sizes the fused hybrid takes (the window is its exact part's chunk)


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
        raise ValueError("sink_mask and log_decay do not combine: pass one of them")
    S0 = None if initial_state is None else initial_state.float().contiguous()
    if log_decay is not None:
        log_decay = decay_log(log_decay, torch.float32)                # differentiable clamp to [-1e4, 0]
    from dofattn.ops.window import _and

    linear_valid, sink_pos = key_valid, None
    if sink_mask is not None:
        linear_valid, sink_pos = _and(key_valid, ~sink_mask), sink_positions(_and(key_valid, sink_mask))
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
        from dofattn.ops.window import delayed_keys

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
