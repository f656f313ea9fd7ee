"""The sliding-window hybrid (`ops.window`): fast form against the spec, the spec against its definition, streaming
against one call, numerics at exponent 195, and the hybrid inside HF models (generation, padding, save/load)."""

import math

import pytest
import torch

from dofattn.spec import Attention
from dofattn.attention import LinearAttention, LinearStateLayer
from dofattn.features import make_feature_map
from dofattn.ops.window import block_window_linear_attention, naive_window_linear_attention, window_linear_attention
from dofattn.spec import StudentSpec
from dofattn.model.student import attention_modules, fingerprint, linearize, load_student, save_student
from tests.conftest import tiny_model

# (B, T, P, H, D, V, M, W): odd lengths, windows larger and smaller than T, a window of 1, cached keys (P > 0)
SHAPES = [(1, 17, 0, 2, 4, 5, 5, 4), (2, 33, 0, 3, 8, 3, 7, 8), (2, 9, 5, 2, 4, 4, 3, 5), (1, 1, 4, 2, 4, 4, 3, 4),
          (1, 1, 0, 1, 4, 2, 1, 4), (2, 40, 0, 1, 3, 3, 2, 64), (2, 40, 0, 1, 3, 2, 2, 1), (1, 70, 3, 2, 6, 7, 9, 16)]


def inputs(B, T, P, H, D, V, M, W, dtype=torch.float64, seed=0, padded=False, state=False):
    g = torch.Generator().manual_seed(seed)
    Tk = T + P
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, Tk, H, D, generator=g)
    v = torch.randn(B, Tk, H, V, generator=g)
    phi_q, phi_k = torch.rand(B, T, H, M, generator=g), torch.rand(B, Tk, H, M, generator=g)
    q_scale, offset = torch.randn(B, T, H, generator=g), torch.randn(H, generator=g)
    tensors = [x.to(dtype).requires_grad_(True) for x in (q, k, v, phi_q, phi_k, q_scale, offset)]
    valid = None
    if padded:
        valid = torch.ones(B, Tk, dtype=torch.bool)
        valid[0, :min(3, Tk)] = False                                  # left padding in the first row
    S0 = torch.rand(B, H, M, V + 1, generator=g).to(dtype) if state else None
    return tensors, valid, S0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padded,state", [(False, False), (True, True)])
def test_fast_form_matches_the_spec(shape, padded, state):
    W = shape[-1]
    tensors, valid, S0 = inputs(*shape, padded=padded, state=state)
    ref, ref_state = naive_window_linear_attention(*tensors, 0.3, W, valid, S0, output_final_state=True)
    out, out_state = window_linear_attention(*tensors, 0.3, W, valid, S0, output_final_state=True, backend="chunk")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_state, ref_state, rtol=1e-12, atol=1e-12)
    weights = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(9))
    grads_ref = torch.autograd.grad((ref * weights).sum(), tensors)
    grads = torch.autograd.grad((out * weights).sum(), tensors)
    for name, a, b in zip(("q", "k", "v", "phi_q", "phi_k", "q_log_scale", "log_offset"), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def strong_and_weak_decays(H: int, dtype=torch.float64) -> torch.Tensor:
    """[H] log γ from -1.5 (gone in a few steps) to -0.01 (long memory)."""
    return torch.linspace(-1.5, -0.01, H, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padded,state", [(False, False), (True, True)])
def test_fast_form_matches_the_spec_with_a_decay(shape, padded, state):
    """Outputs, final states and every gradient, the decay's included, on the same odd shapes."""
    W, H = shape[-1], shape[3]
    tensors, valid, S0 = inputs(*shape, padded=padded, state=state)
    decays = [strong_and_weak_decays(H).requires_grad_(True) for _ in range(2)]
    ref, ref_state = naive_window_linear_attention(*tensors, 0.3, W, valid, S0, output_final_state=True,
                                                   log_decay=decays[0])
    out, out_state = window_linear_attention(*tensors, 0.3, W, valid, S0, output_final_state=True, backend="chunk",
                                             log_decay=decays[1])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_state, ref_state, rtol=1e-12, atol=1e-12)
    weights = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(9))
    grads_ref = torch.autograd.grad((ref * weights).sum(), [*tensors, decays[0]])
    grads = torch.autograd.grad((out * weights).sum(), [*tensors, decays[1]])
    for name, a, b in zip(("q", "k", "v", "phi_q", "phi_k", "q_log_scale", "log_offset", "log_decay"), grads,
                          grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padded,state", [(False, False), (True, True)])
@pytest.mark.parametrize("decay,sink", [(False, False), (True, False), (False, True), (True, True)])
def test_block_form_matches_the_spec(shape, padded, state, decay, sink):
    """The CPU prefill's form (`block_window_linear_attention`, one softmax a block of W queries): outputs and final
    states against the spec, with a decay, sinks anywhere (the cached keys' first ones as the lead, as a cached call
    puts them), padding and a state; it computes no gradients (training takes the blocked form)."""
    B, T, P, H, W = shape[0], shape[1], shape[2], shape[3], shape[-1]
    tensors, valid, S0 = inputs(*shape, padded=padded, state=state)
    decays = [strong_and_weak_decays(H).requires_grad_(True) for _ in range(2)] if decay else [None, None]
    sinks, lead = None, 0
    if sink:
        sinks = torch.rand(B, T + P, generator=torch.Generator().manual_seed(3)) < 0.3
        lead = min(P, 2)
        sinks[:, :lead] = True
    ref, ref_state = naive_window_linear_attention(*tensors, 0.3, W, valid, S0, output_final_state=True,
                                                   log_decay=decays[0], sink_mask=sinks, lead=lead)
    out, out_state = block_window_linear_attention(*tensors, 0.3, W, valid, S0, output_final_state=True,
                                                   log_decay=decays[1], sink_mask=sinks, lead=lead)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_state, ref_state, rtol=1e-12, atol=1e-12)
    assert not out.requires_grad


def test_a_cpu_prefill_takes_the_block_form(monkeypatch):
    """backend auto on a CPU without autograd, past the dense form's queries: `block_window_linear_attention`
    (named backends and autograd: the blocked form on that linear op)."""
    import dofattn.ops.window as window

    called = []
    for name in ("block", "blocked"):
        monkeypatch.setattr(window, f"{name}_window_linear_attention",
                            lambda *a, name=name, **kw: called.append(name) or (None, None))
    tensors, _, _ = inputs(1, 40, 0, 2, 4, 4, 3, 4)
    with torch.no_grad():
        window.window_linear_attention(*tensors, 0.3, 4)
        window.window_linear_attention(*tensors, 0.3, 4, backend="chunk")
    window.window_linear_attention(*tensors, 0.3, 4)              # autograd: training's form, the blocked one
    assert called == ["block", "blocked", "blocked"]


@pytest.mark.parametrize("P", [0, 2, 3])       # no cached keys, fewer than W, exactly W
def test_spec_with_a_decay_follows_its_definition_query_by_query(P):
    """The linear part's pair (t, s) weighs γ^(t − W − s), the state γ^(t + 1 − min(P, W)); the window is exact."""
    W, T = 3, 8
    (q, k, v, phi_q, phi_k, q_scale, offset), _, S0 = inputs(1, T, P, 1, 4, 3, 5, W, state=True)
    q, k, v, phi_q, phi_k, q_scale, offset = (x.detach() for x in (q, k, v, phi_q, phi_k, q_scale, offset))
    log_gamma = -0.4
    out, _ = naive_window_linear_attention(q, k, v, phi_q, phi_k, q_scale, offset, 0.5, W, initial_state=S0,
                                           log_decay=torch.tensor([log_gamma], dtype=torch.float64))
    for i in range(T):
        t = P + i                                                      # the query's position among the keys
        weights, values = [], []
        for s in range(t + 1):
            if s > t - W:
                weights.append(math.exp(0.5 * float(q[0, i, 0] @ k[0, s, 0])))
            else:
                weights.append(float(phi_q[0, i, 0] @ phi_k[0, s, 0]) * math.exp(q_scale[0, i, 0] + offset[0])
                               * math.exp(log_gamma * (t - W - s)))
            values.append(v[0, s, 0])
        state_mass = (float(phi_q[0, i, 0] @ S0[0, 0, :, -1]) * math.exp(q_scale[0, i, 0] + offset[0])
                      * math.exp(log_gamma * (t + 1 - min(P, W))))
        weights.append(state_mass)
        values.append((phi_q[0, i, 0] @ S0[0, 0, :, :-1]) / float(phi_q[0, i, 0] @ S0[0, 0, :, -1]))
        expected = sum(w * x for w, x in zip(weights, values)) / sum(weights)
        torch.testing.assert_close(out[0, i, 0], expected.detach(), rtol=1e-12, atol=1e-12)


def test_a_zero_decay_is_no_decay():
    tensors, valid, S0 = inputs(2, 37, 4, 3, 8, 5, 6, 8, padded=True, state=True)
    plain = window_linear_attention(*tensors, 0.3, 8, valid, S0, output_final_state=True, backend="chunk")
    zero = window_linear_attention(*tensors, 0.3, 8, valid, S0, output_final_state=True, backend="chunk",
                                   log_decay=torch.zeros(3, dtype=torch.float64))
    for a, b in zip(plain, zero):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_decay_is_refused_by_the_fla_backend_by_name():
    tensors, _, _ = inputs(1, 20, 0, 2, 4, 4, 3, 4)
    with pytest.raises(ValueError, match="backend 'fla' has no decay"):
        window_linear_attention(*tensors, 0.3, 4, backend="fla", log_decay=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"log_decay must be a floating-point \[H\] = \(2,\) tensor"):
        window_linear_attention(*tensors, 0.3, 4, log_decay=torch.zeros(3))


def test_fast_form_matches_in_float32_with_every_backend():
    tensors, valid, S0 = inputs(2, 37, 0, 3, 8, 8, 6, 8, dtype=torch.float32, padded=True, state=True)
    ref, _ = naive_window_linear_attention(*tensors, 0.3, 8, valid, S0)
    for backend in ("naive", "chunk", "recurrent"):
        out, _ = window_linear_attention(*tensors, 0.3, 8, valid, S0, backend=backend)
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6, msg=backend)


def test_spec_follows_its_definition_query_by_query():
    (q, k, v, phi_q, phi_k, q_scale, offset), _, S0 = inputs(1, 9, 0, 1, 4, 3, 5, 3, state=True)
    q, k, v, phi_q, phi_k, q_scale, offset = (x.detach() for x in (q, k, v, phi_q, phi_k, q_scale, offset))
    out, _ = naive_window_linear_attention(q, k, v, phi_q, phi_k, q_scale, offset, 0.5, 3, initial_state=S0)
    for t in range(9):
        weights, values = [], []
        for s in range(t + 1):
            if s > t - 3:
                weights.append(math.exp(0.5 * float(q[0, t, 0] @ k[0, s, 0])))
            else:
                weights.append(float(phi_q[0, t, 0] @ phi_k[0, s, 0]) * math.exp(q_scale[0, t, 0] + offset[0]))
            values.append(v[0, s, 0])
        state_mass = float(phi_q[0, t, 0] @ S0[0, 0, :, -1]) * math.exp(q_scale[0, t, 0] + offset[0])
        weights.append(state_mass)
        values.append((phi_q[0, t, 0] @ S0[0, 0, :, :-1]) / float(phi_q[0, t, 0] @ S0[0, 0, :, -1]))
        expected = sum(w * x for w, x in zip(weights, values)) / sum(weights)
        torch.testing.assert_close(out[0, t, 0], expected.detach(), rtol=1e-12, atol=1e-12)


def test_a_window_covering_everything_is_softmax_attention():
    (q, k, v, phi_q, phi_k, q_scale, offset), _, _ = inputs(2, 21, 0, 3, 8, 8, 4, 32)
    out, _ = window_linear_attention(q, k, v, phi_q, phi_k, q_scale, offset, 0.25, 32)
    exact = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("pieces", [[1] * 13, [5, 1, 7], [13], [2, 9, 2], [1, 20, 1, 17], [39]])
def test_streaming_in_pieces_equals_one_call(pieces, decay):
    torch.manual_seed(0)
    fmap = make_feature_map("prf", 2, 8, 6, scaling=8 ** -0.5, seed=1)
    linear = LinearAttention(Attention(window=4, sink=0, decay="head" if decay else "none"), fmap,
                             num_kv_heads=1).eval()
    with torch.no_grad():
        linear.window.log_gain.copy_(torch.tensor([0.3, -0.2]))
        if decay:                                       # log γ = -e^0.3 and -e^-3: one strong, one weak
            linear.decay.decay_rate.copy_(torch.tensor([0.3, -3.0]))
    T = sum(pieces)   # 13: dense form throughout; 39: the fast form for the whole and for pieces > 16
    q, k, v = torch.randn(2, T, 2, 8), torch.randn(2, T, 1, 8), torch.randn(2, T, 1, 8)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :2] = False
    whole = linear(q, k, v, valid)
    cache, outs, start = LinearStateLayer(), [], 0
    for n in pieces:
        outs.append(linear(q[:, start:start + n], k[:, start:start + n], v[:, start:start + n],
                           valid[:, start:start + n], cache=cache))
        start += n
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-5, atol=1e-6)
    assert cache.parts["window"].keys.shape == (2, 4, 1, 8) and cache.parts["window"].valid.shape == (2, 4)
    assert cache.state.shape == (2, 2, 6, 9)


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_at_exponent_195(dtype, decay):
    D = 64
    fmap = make_feature_map("prf", 1, D, 16, scaling=D ** -0.5, seed=0).eval()
    linear = LinearAttention(Attention(window=4, sink=0, decay="head" if decay else "none"), fmap).eval()
    x = torch.randn(1, 40, 1, D)
    x = x / x.norm(dim=-1, keepdim=True) * math.sqrt(195 * math.sqrt(D))  # s·qᵀq ≈ 195 on the diagonal
    with torch.no_grad():
        out = linear(x.to(dtype), x.to(dtype), torch.randn(1, 40, 1, D).to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_window_must_be_nonnegative():
    from dofattn.errors import UserError

    with pytest.raises(UserError, match="student.window = -1: give >= 0"):
        LinearAttention(Attention(window=-1, sink=0), make_feature_map("prf", 1, 4, 4, 0.5))
    with pytest.raises(ValueError, match="window must be >= 1"):
        window_linear_attention(*inputs(1, 3, 0, 1, 4, 4, 2, 2)[0], 0.5, 0)


# --- inside HF models -----------------------------------------------------------------------------------------------

def ids(batch, length, seed):
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def strong_decays(model) -> None:
    """Decays that change the output (a weak start would hide a wrong exponent): log γ from -e^0.5 to -e^-4."""
    with torch.no_grad():
        for module in attention_modules(model):
            module.dofattn.decay.decay_rate.copy_(torch.linspace(0.5, -4, module.dofattn.num_heads))


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_generation_with_a_window_matches_the_full_forward(family, decay):
    model = tiny_model(family)
    linearize(model, [9, 16, 5], Attention(window=6, sink=0, decay="head" if decay else "none"), seed=1)
    if decay:
        strong_decays(model)
    prompt = ids(1, 11, seed=1)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, prefill_chunk_size=4)
        full = model(out.sequences, use_cache=False).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, prompt.shape[1] - 1: -1], rtol=1e-4, atol=1e-4)
    layer = out.past_key_values.layers[0]
    assert isinstance(layer,
                      LinearStateLayer) and layer.parts["window"].keys.shape[1] == 6   # W keys, whatever the context


def test_window_student_round_trip(tmp_path, model_dirs):
    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 7, 3], Attention(window=8, sink=0), seed=4)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LinearAttention):
                m.window.log_gain.uniform_(-1, 1)
    config = StudentSpec(base_model=str(model_dirs["llama"]), dims=[5, 7, 3], layers=[0, 1, 2], seed=4,
                         base=fingerprint(model), attention=Attention(feature="prf", window=8, sink=0))
    save_student(model, tmp_path / "s", config)
    loaded, _, cfg = load_student(tmp_path / "s")
    assert cfg.attention.window == 8
    x = ids(2, 19, seed=7)
    with torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, loaded(x, use_cache=False).logits)


def test_gain_calibration_puts_a_scale_free_map_on_the_kernels_scale():
    torch.manual_seed(0)
    q, k = torch.randn(2, 48, 2, 8) * 2, torch.randn(2, 48, 2, 8) * 2
    linear = LinearAttention(Attention(window=8, sink=0), make_feature_map("hedgehog", 2, 8, 6, scaling=8 ** -0.5))
    linear.calibrate_gain(q, k)
    assert linear.window.log_gain.abs().min() > 1.0         # softmax features sit far from exp(s·qᵀk) at the start
    from dofattn.ops.window import window_logits

    with torch.no_grad():                             # calibrated: the mean log-mass gap beyond the window is 0
        phi_q, q_scale = linear.feature_map.features(q, "query")
        phi_k, k_scale = linear.feature_map.features(k, "key")
        logits, _ = window_logits(q, k, phi_q, phi_k, q_scale, k_scale + linear.window.log_gain, 8 ** -0.5, 8)
    far = torch.ones(48, 48, dtype=torch.bool).tril(-8)
    exact = torch.einsum("bthd,bshd->bhts", q, k) * 8 ** -0.5
    gap = (torch.logsumexp(exact.masked_fill(~far, -torch.inf), -1)
           - torch.logsumexp(logits.masked_fill(~far, -torch.inf), -1))[..., 8:]          # rows with far keys
    torch.testing.assert_close(gap.mean((0, 2)), torch.zeros(2), rtol=0, atol=1e-4)
