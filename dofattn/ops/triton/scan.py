"""The chunked linear-attention scan in Triton: causal linear attention for prefill and training (forward and
backward), with a per-head decay or a per-token gate, its autograd Function, and the plain decode step.

    o, state = triton_linear_attention(phi_q, phi_k, v, initial_state=None, output_final_state=True)
    o = triton_decode_step(phi_q1, phi_k1, v1, state, state)   # T = 1, the state [B, H, M, V+1] updated in place
Both take an optional per-head decay, `log_decay` [H], or a gate instead, `log_gate` [B, T, H] (a decay per token).

Same layout, math and result as `naive.py` (the spec): phi_q, phi_k [B, T, H, M], v [B, T, H, V], state
[B, H, M, V+1] float32, o [B, T, H, V] in v.dtype. Any M and V (not only powers of two: tiles are padded and
masked).

How the prefill is cut: the sequence is split into blocks of L tokens (L a power-of-two multiple of the chunk C,
chosen so that blocks × heads fill the GPU, `common._plan`). Three launches:
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

The window hybrid (`window.py`) runs its linear part as this scan on keys delayed by W (`delay`, read in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dofattn.ops.naive import TINY, augment_values, check_inputs, decay_log, needs_grad
from dofattn.ops.triton.common import CHUNK, _dot_dtype, _plan, _pow2, _value_tile, interpreting


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


def _scan_launch(BK: int, gate: bool = False) -> tuple[int, int, int]:
    """(chunk, pipeline stages, warps) of the scan's kernels for a feature tile of BK (with a gate or without).
    Wide tiles: shorter chunks and no pipelining keep the chunk tiles inside an H100's shared memory, and 8 warps
    spill less than 4 (ptxas, sm_90). A gate adds C × C tiles (its pairs' spans and factors): the gated scan spills
    heavily at chunks of 64 on 4 warps and little or nothing at chunks of 32 on 8 warps. Chosen from ptxas' report
    (`benchmarks/kernel_registers.py --gate`), not from timings; see docs/log/experiments.md, "Registers and spills of
    the kernels"."""
    if BK <= 128:
        return (32, 2, 8) if gate else (CHUNK, 2, 4)
    return (32 if BK <= 256 else 16), 1, 8


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
