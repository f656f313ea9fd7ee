"""Linear-attention ops against the naive reference (the spec): outputs, final states and gradients.

    python -m pytest tests/test_ops.py -q        # CPU, a few seconds; the fla test runs only on CUDA with fla

`ref` comes from `naive_linear_attention`, `tri` from the op under test; `assert_close` compares them by relative
error ‖ref − tri‖ / ‖ref‖, over odd lengths and feature dims (M = 1, 5, 130) as well as round ones.
"""

import pytest
import torch

from dofattn.ops import (chunk_linear_attention, fla_available, fla_linear_attention, linear_attention,
                         naive_linear_attention, pick_backend, recurrent_linear_attention, triton_available)

# (B, T, H, M, V, chunk_size, with_initial_state): odd T, odd and non-power-of-two M, chunk sizes that do not
# divide T, that equal 1, and that exceed T.
CASES = [
    (1, 1, 1, 1, 1, 64, False),
    (1, 1, 3, 5, 16, 64, True),
    (2, 7, 1, 5, 16, 4, False),
    (1, 7, 3, 64, 1, 64, True),
    (2, 63, 3, 1, 64, 16, False),
    (1, 63, 1, 130, 16, 64, True),
    (2, 100, 3, 5, 1, 32, True),
    (1, 100, 1, 64, 64, 7, False),
    (1, 100, 3, 130, 16, 1, False),
    (2, 100, 1, 1, 16, 128, True),
    (1, 257, 3, 5, 64, 64, False),
    (2, 257, 1, 64, 16, 64, True),
    (1, 257, 1, 130, 1, 100, True),
    (2, 257, 3, 64, 64, 300, False),
    (1, 257, 3, 1, 16, 16, True),
]
CASE_IDS = [f"B{b}-T{t}-H{h}-M{m}-V{v}-C{c}{'-S0' if s else ''}" for b, t, h, m, v, c, s in CASES]


def assert_close(name: str, ref: torch.Tensor, tri: torch.Tensor, ratio: float,
                 floor: float = 1e-8) -> float:
    """Fail unless ‖ref − tri‖ / max(‖ref‖, floor) ≤ ratio and tri is finite; return the relative error."""
    assert tri.shape == ref.shape, f"{name}: shape {tuple(tri.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(tri).all(), f"{name}: non-finite values"
    ref, tri = ref.detach().double(), tri.detach().double()
    err = ((ref - tri).norm() / ref.norm().clamp_min(floor)).item()
    print(f"{name:>8} rel err {err:.2e}")
    assert err <= ratio, f"{name}: relative error {err:.3e} > {ratio:.1e}"
    return err


def make_inputs(B, T, H, M, V, with_state=True, dtype=torch.float32, seed=0):
    """Nonnegative features, Gaussian values, and a state that some 5 earlier tokens would have left."""
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(B, T, H, M, generator=g, dtype=torch.float64)
    phi_k = torch.randn(B, T, H, M, generator=g, dtype=torch.float64).abs().neg().exp()
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    state = None
    if with_state:
        k0 = torch.rand(B, 5, H, M, generator=g, dtype=torch.float64)
        v0 = torch.randn(B, 5, H, V, generator=g, dtype=torch.float64)
        state = torch.einsum("bthm,bthv->bhmv", k0, torch.cat([v0, torch.ones_like(v0[..., :1])], -1))
        state = state.float() if dtype != torch.float64 else state
    return phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), state


def forward_backward(op, phi_q, phi_k, v, state, seed=1, **kwargs):
    """Run op with a random upstream gradient on o and on the final state: (o, final state, grads by name)."""
    leaves = {"dq": phi_q, "dk": phi_k, "dv": v, "dh0": state}
    leaves = {name: x.detach().clone().requires_grad_() for name, x in leaves.items() if x is not None}
    o, final = op(leaves["dq"], leaves["dk"], leaves["dv"], initial_state=leaves.get("dh0"),
                  output_final_state=True, **kwargs)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype)
    dht = torch.randn(final.shape, generator=g, dtype=torch.float64).to(final.device, final.dtype)
    ((o * do).sum() + (final * dht).sum()).backward()
    return o, final, {name: x.grad for name, x in leaves.items()}


def compare(op, case, dtype=torch.float32, ratio=1e-4, log_decay=None, log_gate=None, **kwargs):
    """op against the naive reference on `case`: outputs, final states and gradients (of log_decay or log_gate
    too, if given)."""
    B, T, H, M, V, _, with_state = case
    inputs = make_inputs(B, T, H, M, V, with_state, dtype)
    name, given = ("log_gate", log_gate) if log_gate is not None else ("log_decay", log_decay)
    decays = [None if given is None else given.clone().requires_grad_() for _ in range(2)]
    ref_o, ref_s, ref_grads = forward_backward(naive_linear_attention, *inputs,
                                               **({} if given is None else {name: decays[0]}))
    tri_o, tri_s, tri_grads = forward_backward(op, *inputs, **kwargs,
                                               **({} if given is None else {name: decays[1]}))
    assert tri_o.dtype == dtype and tri_s.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close("o", ref_o, tri_o, ratio)
    assert_close("ht", ref_s, tri_s, ratio)
    for name in ref_grads:
        # With M = 1, φq cancels in the ratio and dq is rounding noise around 0: measure it on dk's scale.
        floor = ref_grads["dk"].norm().item() if (name == "dq" and M == 1) else 1e-8
        assert_close(name, ref_grads[name], tri_grads[name], ratio, floor)
    if given is not None:
        assert_close(f"d{name}", decays[0].grad, decays[1].grad, ratio)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_chunk_matches_naive(case):
    compare(chunk_linear_attention, case, chunk_size=case[5])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_recurrent_matches_naive(case):
    compare(recurrent_linear_attention, case)


@pytest.mark.parametrize("case", CASES[::3], ids=CASE_IDS[::3])
def test_float64_tight(case):
    compare(chunk_linear_attention, case, dtype=torch.float64, ratio=1e-12, chunk_size=case[5])
    compare(recurrent_linear_attention, case, dtype=torch.float64, ratio=1e-12)


def test_naive_by_hand():
    """The reference against the definition written out for T = 2, M = 1, V = 1."""
    phi_q = torch.tensor([2.0, 3.0]).view(1, 2, 1, 1)
    phi_k = torch.tensor([1.0, 4.0]).view(1, 2, 1, 1)
    v = torch.tensor([5.0, -1.0]).view(1, 2, 1, 1)
    o, state = naive_linear_attention(phi_q, phi_k, v, output_final_state=True)
    # o_1 = (2·1·5)/(2·1) = 5; o_2 = 3·(1·5 + 4·(-1)) / (3·(1 + 4)) = 0.2
    torch.testing.assert_close(o.flatten(), torch.tensor([5.0, 0.2]))
    torch.testing.assert_close(state.flatten(), torch.tensor([1.0 * 5 + 4 * -1, 1.0 + 4]))


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 99, 100, 101, 1000])
def test_chunk_sizes(chunk_size):
    """chunk_size dividing T or not, equal to T, larger than T."""
    phi_q, phi_k, v, state = make_inputs(2, 100, 3, 5, 16)
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    o, s = chunk_linear_attention(phi_q, phi_k, v, state, output_final_state=True, chunk_size=chunk_size)
    assert_close("o", ref_o, o, 1e-5)
    assert_close("ht", ref_s, s, 1e-5)


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("with_state", [False, True])
def test_split_equals_full(backend, with_state):
    """Running [0, a), [a, b), ... and passing the state on gives the full run's outputs and state."""
    phi_q, phi_k, v, state = make_inputs(2, 100, 3, 5, 16, with_state)
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    outputs, s = [], state
    for start, stop in zip([0, 1, 37, 64, 99], [1, 37, 64, 99, 100]):
        o, s = linear_attention(phi_q[:, start:stop], phi_k[:, start:stop], v[:, start:stop], s,
                                output_final_state=True, backend=backend)
        outputs.append(o)
    assert_close("o", ref_o, torch.cat(outputs, dim=1), 1e-5)
    assert_close("ht", ref_s, s, 1e-5)


def test_prefill_then_decode():
    """Chunked prefill, then token-by-token decode through `linear_attention`'s auto dispatch."""
    phi_q, phi_k, v, _ = make_inputs(1, 60, 3, 64, 16, with_state=False)
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, output_final_state=True)
    o, s = linear_attention(phi_q[:, :50], phi_k[:, :50], v[:, :50], output_final_state=True)
    outputs = [o]
    for t in range(50, 60):
        o, s = linear_attention(phi_q[:, t:t + 1], phi_k[:, t:t + 1], v[:, t:t + 1], s, output_final_state=True)
        outputs.append(o)
    assert_close("o", ref_o, torch.cat(outputs, dim=1), 1e-5)
    assert_close("ht", ref_s, s, 1e-5)


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
def test_bfloat16(backend):
    """bf16 inputs: finite bf16 outputs near the float32 result, a float32 state."""
    phi_q, phi_k, v, state = make_inputs(2, 100, 3, 64, 16)
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    low = [x.bfloat16() for x in (phi_q, phi_k, v)]
    o, s = linear_attention(*low, state, output_final_state=True, backend=backend)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close("o", ref_o, o, 2e-2)
    assert_close("ht", ref_s, s, 2e-2)
    o, s = linear_attention(*low, state.bfloat16(), output_final_state=True, backend=backend)
    assert s.dtype == torch.float32 and torch.isfinite(o).all()


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
def test_zero_keys_give_zero_not_nan(backend):
    """All φk = 0 (and no state): the denominator is 0, the output 0, never NaN."""
    phi_q, _, v, _ = make_inputs(2, 37, 3, 5, 16, with_state=False)
    o, s = linear_attention(phi_q, torch.zeros_like(phi_q), v, output_final_state=True, backend=backend)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(s, torch.zeros_like(s))
    o, _ = linear_attention(phi_q, torch.zeros_like(phi_q), v.bfloat16(), backend=backend)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
def test_tiny_features_keep_the_ratio(backend):
    """o is invariant to scaling φq and φk: denominators near 1e-20 are still divided by, not floored."""
    phi_q, phi_k, v, _ = make_inputs(2, 37, 3, 5, 16, with_state=False)
    ref_o, _ = naive_linear_attention(phi_q, phi_k, v)
    o, _ = linear_attention(phi_q * 1e-10, phi_k * 1e-10, v, backend=backend)
    assert_close("o", ref_o, o, 1e-5)


def test_final_state_only_when_asked():
    phi_q, phi_k, v, _ = make_inputs(1, 7, 1, 5, 16, with_state=False)
    for backend in ("naive", "chunk", "recurrent"):
        assert linear_attention(phi_q, phi_k, v, backend=backend)[1] is None


def test_dispatch():
    phi_q, phi_k, v, state = make_inputs(1, 7, 3, 5, 16)
    assert pick_backend(phi_q) == "chunk"                        # CPU, T > 1
    assert pick_backend(phi_q[:, :1]) == "recurrent"
    assert pick_backend(phi_q, "naive") == "naive"
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    for backend in ("auto", "naive", "chunk", "recurrent"):
        o, s = linear_attention(phi_q, phi_k, v, state, output_final_state=True, backend=backend)
        assert_close("o", ref_o, o, 1e-5)
        assert_close("ht", ref_s, s, 1e-5)


def test_dispatch_errors():
    phi_q, phi_k, v, state = make_inputs(2, 7, 3, 5, 16)
    with pytest.raises(ValueError, match="unknown backend 'cuda'.*auto.*naive.*chunk.*recurrent.*triton.*fla"):
        linear_attention(phi_q, phi_k, v, backend="cuda")
    bad = {
        "phi_q and phi_k must have the same shape": (phi_q, phi_k[..., :4], v, None),
        "phi_q and phi_k must have the same shape.*2, 6": (phi_q, phi_k[:, :6], v, None),
        "v must be .B, T, H, V.": (phi_q, phi_k, v[:1], None),
        "v must be .B, T, H, V.*2, 7, 3": (phi_q, phi_k, v[:, :, :2], None),
        "phi_q must be 4-D": (phi_q[0], phi_k, v, None),
        "initial_state must be .B, H, M, V.1.": (phi_q, phi_k, v, state[..., :16]),
        "initial_state must be .B, H, M, V.1. = .2, 3, 5, 17.": (phi_q, phi_k, v, state[:, :2]),
        "T, M and V must be positive": (phi_q[:, :0], phi_k[:, :0], v[:, :0], None),
    }
    for message, args in bad.items():
        for backend in ("auto", "naive", "chunk", "recurrent", "triton", "fla"):
            with pytest.raises(ValueError, match=message):
                linear_attention(*args, backend=backend)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_linear_attention(phi_q, phi_k, v, chunk_size=0)


@pytest.mark.skipif(torch.cuda.is_available() and fla_available(), reason="fla and CUDA are both present")
def test_fla_raises_clearly_without_cuda_or_fla():
    phi_q, phi_k, v, _ = make_inputs(1, 7, 3, 5, 16)
    with pytest.raises(RuntimeError, match="fla_linear_attention needs"):
        fla_linear_attention(phi_q, phi_k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not fla_available(), reason="needs flash-linear-attention (pip install fla-core)")
@pytest.mark.parametrize("case", [(1, 63, 3, 64, 64, 0, True), (2, 257, 3, 5, 16, 0, False),
                                  (1, 500, 1, 130, 64, 0, True), (2, 2, 9, 64, 64, 0, True)],
                         ids=["T63-M64", "T257-M5", "T500-M130", "T2-H9"])
def test_fla_matches_naive(case):
    B, T, H, M, V, _, with_state = case
    inputs = [x.cuda() if x is not None else None for x in make_inputs(B, T, H, M, V, with_state)]
    ref_o, ref_s, ref_grads = forward_backward(naive_linear_attention, *inputs)
    tri_o, tri_s, tri_grads = forward_backward(fla_linear_attention, *inputs)
    assert pick_backend(inputs[0]) == ("triton" if triton_available() else "fla")   # fla: when asked, or no Triton
    # Triton's float32 dots may run in tf32: a looser bound than the pure-PyTorch ops.
    assert_close("o", ref_o, tri_o, 5e-3)
    assert_close("ht", ref_s, tri_s, 5e-3)
    for name in ref_grads:
        assert_close(name, ref_grads[name], tri_grads[name], 5e-3)


# --- decay -----------------------------------------------------------------------------------------------------------

# every other case, and one where weak decays link many chunks and the initial state (float32)
DECAY_CASES = CASES[1::2] + [(2, 257, 3, 5, 16, 16, True)]
DECAY_IDS = CASE_IDS[1::2] + ["B2-T257-H3-M5-V16-C16-S0"]


def make_log_decay(H: int, dtype=torch.float32) -> torch.Tensor:
    """Per-head log γ from strong (half-life under a token) to almost none."""
    return torch.tensor([-2.0, -0.05, -1e-4][:H] + [-0.3] * max(0, H - 3), dtype=dtype)


def compare_decay(op, case, dtype=torch.float32, ratio=1e-4, **kwargs):
    """`compare` with a decay of every strength (`make_log_decay`)."""
    compare(op, case, dtype, ratio, log_decay=make_log_decay(case[2], dtype), **kwargs)


@pytest.mark.parametrize("case", DECAY_CASES, ids=DECAY_IDS)
def test_decay_chunk_matches_naive(case):
    compare_decay(chunk_linear_attention, case, chunk_size=case[5])


@pytest.mark.parametrize("case", DECAY_CASES, ids=DECAY_IDS)
def test_decay_recurrent_matches_naive(case):
    compare_decay(recurrent_linear_attention, case)


def test_decay_chunk_loop_equals_chunk_matrix(monkeypatch):
    """Past MATRIX_CHUNKS chunks the decayed prefix sum is a loop: the same numbers."""
    import dofattn.ops.chunk as chunk

    case = (2, 257, 3, 5, 16, 8, True)                       # 33 chunks
    compare_decay(chunk_linear_attention, case, dtype=torch.float64, ratio=1e-12, chunk_size=8)
    monkeypatch.setattr(chunk, "MATRIX_CHUNKS", 4)
    compare_decay(chunk_linear_attention, case, dtype=torch.float64, ratio=1e-12, chunk_size=8)


def test_decay_naive_by_hand():
    """o_t = Σ_s γ^(t-s) φq_t·φk_s [v_s, 1] + γ^(t+1) φq_t·S_0, the ratio of its parts; the state likewise."""
    B, T, H, M, V = 1, 6, 3, 4, 2
    phi_q, phi_k, v, state = make_inputs(B, T, H, M, V, True, torch.float64)
    log_decay = make_log_decay(H, torch.float64)
    o, final = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True, log_decay=log_decay)
    v_aug = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    for h in range(H):
        gamma = log_decay[h].exp()
        S = state[0, h].clone()
        for t in range(T):
            S = gamma * S + torch.outer(phi_k[0, t, h], v_aug[0, t, h])
            weights = [gamma ** (t - s) * phi_q[0, t, h] @ phi_k[0, s, h] for s in range(t + 1)]
            num = sum(w * v_aug[0, s, h] for s, w in enumerate(weights)) + gamma ** (t + 1) * phi_q[0, t, h] @ state[0, h]
            torch.testing.assert_close(o[0, t, h], num[:V] / num[V], rtol=1e-12, atol=0)
        torch.testing.assert_close(final[0, h], S, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
def test_zero_decay_is_no_decay(backend):
    phi_q, phi_k, v, state = make_inputs(2, 37, 3, 5, 16)
    ref_o, ref_s = linear_attention(phi_q, phi_k, v, state, True, backend=backend)
    o, s = linear_attention(phi_q, phi_k, v, state, True, backend=backend, log_decay=torch.zeros(3))
    assert_close("o", ref_o, o, 1e-6)
    assert_close("ht", ref_s, s, 1e-6)


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strong_decay_over_long_sequences_stays_finite(backend, dtype):
    """γ = e^-200 (every past key gone) and e^-1e-6 (none), over 300 tokens: no overflow, no 0/0."""
    phi_q, phi_k, v, state = make_inputs(1, 300, 2, 5, 4, True, dtype)
    log_decay = torch.tensor([-200.0, -1e-6])
    decay = log_decay.clone().requires_grad_()
    o, s = linear_attention(phi_q, phi_k, v, state, True, backend=backend, log_decay=decay)
    (o.float().sum() + s.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(s).all() and torch.isfinite(decay.grad).all()
    # head 0 forgets everything before each token: its output is that token's own value
    torch.testing.assert_close(o[0, :, 0].float(), v[0, :, 0].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
def test_decay_limits_are_clamped(backend):
    """log γ = -inf (every past key gone) and a positive value (clamped to γ = 1): finite, and as at the limits."""
    phi_q, phi_k, v, state = make_inputs(1, 70, 2, 5, 4)
    o, s = linear_attention(phi_q, phi_k, v, state, True, backend=backend,
                            log_decay=torch.tensor([-torch.inf, 3.0]))
    ref_o, ref_s = linear_attention(phi_q, phi_k, v, state, True, backend="naive",
                                    log_decay=torch.tensor([-1e4, 0.0]))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close("o", ref_o, o, 1e-5)
    assert_close("ht", ref_s, s, 1e-5)


def test_decay_dispatch_and_errors():
    phi_q, phi_k, v, state = make_inputs(2, 7, 3, 5, 16)
    assert pick_backend(phi_q, decay=True) == "chunk"
    assert pick_backend(phi_q[:, :1], decay=True) == "recurrent"
    with pytest.raises(ValueError, match="backend 'fla' has no decay; use one of"):
        linear_attention(phi_q, phi_k, v, backend="fla", log_decay=torch.zeros(3))
    for bad in (torch.zeros(2), torch.zeros(3, 1), torch.zeros(3, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"log_decay must be a floating-point \[H\] = \(3,\) tensor"):
            linear_attention(phi_q, phi_k, v, log_decay=bad)


# --- gate (a decay per token) ------------------------------------------------------------------------------------------

def make_log_gate(B: int, T: int, H: int, dtype=torch.float32, seed=3) -> torch.Tensor:
    """Per-token log factors [B, T, H]: mostly weak, some strong (a token that all but clears the state)."""
    g = torch.Generator().manual_seed(seed)
    log_gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.2
    strong = torch.rand(B, T, H, generator=g, dtype=torch.float64) < 0.05
    return log_gate.masked_fill(strong, -8.0).to(dtype)


def compare_gate(op, case, dtype=torch.float32, ratio=1e-4, **kwargs):
    B, T, H = case[:3]
    compare(op, case, dtype, ratio, log_gate=make_log_gate(B, T, H, dtype), **kwargs)


@pytest.mark.parametrize("case", DECAY_CASES, ids=DECAY_IDS)
def test_gate_chunk_matches_naive(case):
    compare_gate(chunk_linear_attention, case, chunk_size=case[5])


@pytest.mark.parametrize("case", DECAY_CASES, ids=DECAY_IDS)
def test_gate_recurrent_matches_naive(case):
    compare_gate(recurrent_linear_attention, case)


@pytest.mark.parametrize("case", CASES[::4], ids=CASE_IDS[::4])
def test_gate_float64_tight(case):
    compare_gate(chunk_linear_attention, case, dtype=torch.float64, ratio=1e-12, chunk_size=case[5])
    compare_gate(recurrent_linear_attention, case, dtype=torch.float64, ratio=1e-12)


def test_gate_chunk_loop_equals_chunk_matrix(monkeypatch):
    """Past MATRIX_CHUNKS chunks the gated prefix sum is a loop: the same numbers."""
    import dofattn.ops.chunk as chunk

    case = (2, 257, 3, 5, 16, 8, True)                       # 33 chunks
    compare_gate(chunk_linear_attention, case, dtype=torch.float64, ratio=1e-12, chunk_size=8)
    monkeypatch.setattr(chunk, "MATRIX_CHUNKS", 4)
    compare_gate(chunk_linear_attention, case, dtype=torch.float64, ratio=1e-12, chunk_size=8)


def test_gate_naive_by_hand():
    """S_t = g_t S_{t-1} + φk_t [v_t, 1] and o_t = (φq_t · S_t) as a ratio, written out token by token."""
    B, T, H, M, V = 2, 6, 3, 4, 2
    phi_q, phi_k, v, state = make_inputs(B, T, H, M, V, True, torch.float64)
    log_gate = make_log_gate(B, T, H, torch.float64)
    o, final = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True, log_gate=log_gate)
    v_aug = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    for b in range(B):
        for h in range(H):
            S = state[b, h].clone()
            for t in range(T):
                S = log_gate[b, t, h].exp() * S + torch.outer(phi_k[b, t, h], v_aug[b, t, h])
                num = phi_q[b, t, h] @ S
                torch.testing.assert_close(o[b, t, h], num[:V] / num[V], rtol=1e-12, atol=0)
            torch.testing.assert_close(final[b, h], S, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
def test_gate_limits(backend):
    """A zero gate is no gate, a gate constant over tokens is that decay, and -inf / positive logs are clamped."""
    phi_q, phi_k, v, state = make_inputs(2, 37, 3, 5, 16)
    ref_o, ref_s = linear_attention(phi_q, phi_k, v, state, True, backend=backend)
    o, s = linear_attention(phi_q, phi_k, v, state, True, backend=backend, log_gate=torch.zeros(2, 37, 3))
    assert_close("o", ref_o, o, 1e-6)
    assert_close("ht", ref_s, s, 1e-6)
    log_decay = make_log_decay(3)
    ref_o, ref_s = linear_attention(phi_q, phi_k, v, state, True, backend=backend, log_decay=log_decay)
    o, s = linear_attention(phi_q, phi_k, v, state, True, backend=backend, log_gate=log_decay.expand(2, 37, 3))
    assert_close("o", ref_o, o, 1e-5)
    assert_close("ht", ref_s, s, 1e-5)
    wild = make_log_gate(2, 37, 3)
    wild[:, 5], wild[:, 9] = -torch.inf, 3.0
    o, s = linear_attention(phi_q, phi_k, v, state, True, backend=backend, log_gate=wild)
    ref_o, ref_s = linear_attention(phi_q, phi_k, v, state, True, backend="naive", log_gate=wild.clamp(-1e4, 0))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close("o", ref_o, o, 1e-5)
    assert_close("ht", ref_s, s, 1e-5)


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strong_gates_over_long_sequences_stay_finite(backend, dtype):
    """Gates of e^-200 on every token of head 0 and e^-1e-6 on head 1, over 300 tokens: finite outputs, states and
    gradients; head 0 keeps only each token's own value."""
    phi_q, phi_k, v, state = make_inputs(1, 300, 2, 5, 4, True, dtype)
    log_gate = torch.tensor([-200.0, -1e-6]).expand(1, 300, 2).clone().requires_grad_()
    o, s = linear_attention(phi_q, phi_k, v, state, True, backend=backend, log_gate=log_gate)
    (o.float().sum() + s.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(s).all() and torch.isfinite(log_gate.grad).all()
    torch.testing.assert_close(o[0, :, 0].float(), v[0, :, 0].float(), rtol=1e-2, atol=1e-2)


def test_gate_dispatch_and_errors():
    phi_q, phi_k, v, state = make_inputs(2, 7, 3, 5, 16)
    gate = torch.zeros(2, 7, 3)
    assert pick_backend(phi_q, gate=True) == "chunk"
    assert pick_backend(phi_q[:, :1], gate=True) == "recurrent"
    with pytest.raises(ValueError, match="backend 'fla' has no gate; use one of"):
        linear_attention(phi_q, phi_k, v, backend="fla", log_gate=gate)
    for bad in (torch.zeros(3), torch.zeros(2, 6, 3), torch.zeros(2, 7, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"log_gate must be a floating-point \[B, T, H\] = \(2, 7, 3\) tensor"):
            linear_attention(phi_q, phi_k, v, log_gate=bad)
    with pytest.raises(ValueError, match="log_decay and log_gate do not combine"):
        linear_attention(phi_q, phi_k, v, log_decay=torch.zeros(3), log_gate=gate)


def test_window_pairs_split_the_causal_triangle_as_the_spec_says():
    """`ops.window.window_pairs`, the one window/sink rule: exact and linear pairs are disjoint, cover the causal
    triangle, exact = the last W keys and the sink keys not after the query, counted by hand on 9 tokens."""
    from dofattn.ops.window import window_pairs

    pos = torch.arange(9)
    sink = pos[None, :] < 2
    exact, linear = window_pairs(pos[:, None], pos[None, :], 3, sink)
    causal = pos[None, :] <= pos[:, None]
    assert not (exact & linear).any() and torch.equal(exact | linear, causal)
    for t in range(9):
        assert set(pos[exact[t]].tolist()) == {s for s in range(t + 1) if s > t - 3 or s < 2}, t
