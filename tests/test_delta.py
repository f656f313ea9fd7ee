"""The delta-rule linear attention (`ops.delta`): the chunked form against the recurrence (outputs, states,
gradients), the recurrence against hand computations, β = 0 against gated linear attention, and the layer's use.

    python -m pytest tests/test_delta.py -q
"""

import pytest
import torch

from dofattn.spec import Attention
from dofattn.attention import DELTA_START, LinearAttention, LinearStateLayer
from dofattn.errors import UserError
from dofattn.features import make_feature_map
from dofattn.ops import naive_linear_attention
from dofattn.ops.delta import chunk_delta_attention, delta_attention, recurrent_delta_attention
from tests.test_ops import assert_close

# (B, T, H, M, V, chunk_size, with_initial_state, gated): odd lengths and dims, chunks that do not divide T, of one
# token, and longer than T.
CASES = [
    (1, 1, 1, 1, 1, 64, False, False),
    (2, 7, 3, 5, 4, 3, True, True),
    (1, 33, 2, 1, 16, 8, False, True),
    (2, 64, 1, 17, 1, 64, True, False),
    (1, 100, 3, 9, 7, 1, True, True),
    (2, 129, 2, 33, 5, 32, False, True),
    (1, 70, 1, 6, 3, 200, True, True),
]
CASE_IDS = [f"B{b}-T{t}-H{h}-M{m}-V{v}-C{c}{'-S0' if s else ''}{'-gate' if g else ''}"
            for b, t, h, m, v, c, s, g in CASES]


def delta_inputs(B, T, H, M, V, with_state, gated, dtype=torch.float64, seed=0):
    """Nonnegative features (some keys exactly zero), values, erase strengths over all of [0, 1] and gate logs."""
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(B, T, H, M, generator=g, dtype=torch.float64)
    phi_k = torch.rand(B, T, H, M, generator=g, dtype=torch.float64) ** 2
    phi_k[:, ::5] = 0                                                   # padding-like keys: no erase, no write
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    beta[:, ::3] = 1.0
    log_gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64) if gated else None
    state = None
    if with_state:
        state = torch.cat([torch.randn(B, H, M, V, generator=g, dtype=torch.float64),
                           torch.rand(B, H, M, 1, generator=g, dtype=torch.float64)], -1)
    cast = [x if x is None else x.to(dtype) for x in (phi_q, phi_k, v, beta, log_gate, state)]
    return cast


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_chunk_matches_recurrent(case):
    B, T, H, M, V, C, with_state, gated = case
    inputs = delta_inputs(B, T, H, M, V, with_state, gated)
    o_ref, s_ref = recurrent_delta_attention(*inputs, output_final_state=True)
    o, s = chunk_delta_attention(*inputs, output_final_state=True, chunk_size=C)
    assert_close("o", o_ref, o, 1e-12)
    assert_close("state", s_ref, s, 1e-12)


@pytest.mark.parametrize("case", CASES[1:], ids=CASE_IDS[1:])
def test_chunk_gradients_match_recurrent(case):
    B, T, H, M, V, C, with_state, gated = case
    inputs = [x if x is None else x.requires_grad_() for x in delta_inputs(B, T, H, M, V, with_state, gated)]
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    grads = []
    for op, extra in ((recurrent_delta_attention, {}), (chunk_delta_attention, {"chunk_size": C})):
        o, s = op(*inputs, output_final_state=True, **extra)
        loss = (o * weights).sum() + s.square().sum() / 100
        grads.append(torch.autograd.grad(loss, [x for x in inputs if x is not None]))
    # floor: with M = 1 the output does not depend on φq (φq·S / φq·c), and its gradient is rounding noise
    for name, ref, got in zip(("phi_q", "phi_k", "v", "beta", "log_gate", "state"), *grads):
        assert_close(name, ref, got, 1e-9, floor=1e-3)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("op", [recurrent_delta_attention, chunk_delta_attention])
def test_no_erasing_is_linear_attention(op, gated):
    """β = 0: the delta rule writes as linear attention does, with the gate or without."""
    phi_q, phi_k, v, beta, log_gate, state = delta_inputs(2, 45, 3, 7, 5, True, gated)
    o, s = op(phi_q, phi_k, v, torch.zeros_like(beta), log_gate, state, output_final_state=True)
    o_ref, s_ref = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True, log_gate=log_gate)
    assert_close("o", o_ref, o, 1e-12)
    assert_close("state", s_ref, s, 1e-12)


def test_recurrence_by_hand():
    """Two tokens on one unit key direction, β_2 = 1 and then β_2 = 0.5: the second write replaces the first in
    the numerator, all of it or half of it, while the normaliser counts both keys."""
    phi_q = torch.tensor([[[[1.0, 2.0]]], [[[1.0, 2.0]]]], dtype=torch.float64).transpose(0, 1)   # [1, 2, 1, 2]
    phi_k = torch.tensor([[3.0, 4.0], [6.0, 8.0]], dtype=torch.float64)[None, :, None]         # one direction
    v = torch.tensor([[1.0, -1.0], [2.0, 5.0]], dtype=torch.float64)[None, :, None]
    unit = torch.tensor([0.6, 0.8], dtype=torch.float64)
    for b2 in (1.0, 0.5):
        beta = torch.tensor([[[0.3], [b2]]], dtype=torch.float64)
        o, s = recurrent_delta_attention(phi_q, phi_k, v, beta, output_final_state=True)
        S1 = torch.outer(phi_k[0, 0, 0], v[0, 0, 0])                   # the first token: nothing to erase
        S2 = S1 - b2 * torch.outer(unit, unit @ S1) + torch.outer(phi_k[0, 1, 0], v[0, 1, 0])
        c2 = phi_k[0, 0, 0] + phi_k[0, 1, 0]
        q = phi_q[0, 1, 0]
        assert torch.allclose(o[0, 0, 0], v[0, 0, 0])
        assert torch.allclose(o[0, 1, 0], (q @ S2) / (q @ c2))
        assert torch.allclose(s[0, 0], torch.cat([S2, c2[:, None]], -1))
        if b2 == 1.0:                                                  # the first value is gone from the numerator
            assert torch.allclose(o[0, 1, 0], (q @ phi_k[0, 1, 0]) * v[0, 1, 0] / (q @ c2))


@pytest.mark.parametrize("op", [recurrent_delta_attention, chunk_delta_attention])
def test_split_equals_full(op):
    phi_q, phi_k, v, beta, log_gate, state = delta_inputs(2, 50, 2, 6, 4, True, True)
    o_full, s_full = op(phi_q, phi_k, v, beta, log_gate, state, output_final_state=True)
    o1, s1 = op(phi_q[:, :21], phi_k[:, :21], v[:, :21], beta[:, :21], log_gate[:, :21], state, True)
    o2, s2 = op(phi_q[:, 21:], phi_k[:, 21:], v[:, 21:], beta[:, 21:], log_gate[:, 21:], s1, True)
    assert_close("o", o_full, torch.cat([o1, o2], 1), 1e-12)
    assert_close("state", s_full, s2, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", [recurrent_delta_attention, chunk_delta_attention])
def test_extreme_inputs_stay_finite(op, dtype):
    """Features up to 1e30, zero keys, β = 1 on every token and gates that clear the state: finite outputs."""
    phi_q, phi_k, v, beta, log_gate, _ = delta_inputs(1, 80, 2, 8, 4, False, True, dtype=torch.float32)
    phi_k, phi_q = phi_k * 1e30, phi_q * 1e-30
    log_gate = log_gate * 1e4
    o, s = op(phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), torch.ones_like(beta).to(dtype), log_gate, None, True)
    assert o.dtype == dtype and torch.isfinite(o.float()).all() and torch.isfinite(s).all()
    zero = op(phi_q.to(dtype), torch.zeros_like(phi_k).to(dtype), v.to(dtype), beta.to(dtype))[0]
    assert torch.equal(zero.float(), torch.zeros_like(zero.float()))


def test_dispatch_and_errors():
    phi_q, phi_k, v, beta, log_gate, state = delta_inputs(1, 9, 2, 3, 4, True, True)
    for backend in ("auto", "recurrent", "chunk"):
        o = delta_attention(phi_q, phi_k, v, beta, log_gate, state, backend=backend)[0]
        assert_close(backend, recurrent_delta_attention(phi_q, phi_k, v, beta, log_gate, state)[0], o, 1e-12)
    with pytest.raises(ValueError, match="the delta rule runs on"):
        delta_attention(phi_q, phi_k, v, beta, backend="triton")
    with pytest.raises(ValueError, match=r"beta must be a floating-point \[B, T, H\]"):
        delta_attention(phi_q, phi_k, v, beta[:, :3])
    with pytest.raises(ValueError, match="log_gate must be"):
        chunk_delta_attention(phi_q, phi_k, v, beta, log_gate[..., :1])


# --- the layer ----------------------------------------------------------------------------------------------------

def delta_layer(gate: bool = True, conv: int = 0, seed: int = 0, decay: bool = False) -> LinearAttention:
    fmap = make_feature_map("hedgehog", 4, 16, 8, 0.25, seed=seed)
    return LinearAttention(Attention(window=0, sink=0, decay="gate" if gate else "head" if decay else "none",
                           conv=conv, delta=True), fmap, num_kv_heads=2)


def test_layer_starts_near_the_layer_without_and_erases_once_trained():
    torch.manual_seed(0)
    layer = delta_layer()
    plain = LinearAttention(Attention(window=0, sink=0, decay="gate"), layer.feature_map, num_kv_heads=2)
    q, k, v = torch.randn(2, 40, 4, 16), torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 16)
    assert torch.allclose(layer.delta.betas(layer.expand_kv(v)), torch.sigmoid(torch.tensor(DELTA_START)))
    start = (layer(q, k, v) - plain(q, k, v)).norm() / plain(q, k, v).norm()
    assert 0 < start < 0.05, start
    with torch.no_grad():
        layer.delta.delta_bias.fill_(4.0)
    assert (layer(q, k, v) - plain(q, k, v)).norm() / plain(q, k, v).norm() > 10 * start
    layer(q, k, v).square().sum().backward()
    assert layer.delta.delta_weight.grad.abs().sum() > 0 and layer.delta.delta_bias.grad.abs().sum() > 0
    assert "delta" in repr(layer)


@pytest.mark.parametrize("conv, gate, decay", [(0, True, False), (3, True, False), (0, False, True), (3, False, False)])
def test_layer_decode_matches_prefill(conv, gate, decay):
    """A prefill of 19 tokens and 14 single-token steps through the cache give the full forward's outputs."""
    torch.manual_seed(1)
    layer = delta_layer(conv=conv, gate=gate, decay=decay)
    with torch.no_grad():
        layer.delta.delta_bias.fill_(-1.0)
        layer.delta.delta_weight.normal_()
    q, k, v = torch.randn(2, 33, 4, 16), torch.randn(2, 33, 2, 16), torch.randn(2, 33, 2, 16)
    cache = LinearStateLayer()
    with torch.no_grad():
        steps = [layer(q[:, :19], k[:, :19], v[:, :19], cache=cache)]
        steps += [layer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache=cache) for t in range(19, 33)]
        full = layer(q, k, v)
    assert_close("o", full, torch.cat(steps, 1), 1e-5)


def test_layer_refuses_a_window():
    fmap = make_feature_map("prf", 4, 16, 8, 0.25, seed=0)
    with pytest.raises(UserError, match="student.delta is for pure linear attention"):
        LinearAttention(Attention(window=8, sink=0, delta=True), fmap, num_kv_heads=2)
    with pytest.raises(UserError, match="4 query heads do not share 3 kv heads evenly"):
        LinearAttention(Attention(window=0, sink=0, delta=True), fmap, num_kv_heads=3)
