"""The attention sink beside the window (`sink_mask` in `ops.window`, `--sink` in the model): the fast form against
the spec, the spec against its definition, streaming and static decoding against one call, and its errors."""

import math

import pytest
import torch

from dofattn.attention.hybrid import WindowForms
from dofattn.spec import Attention
from dofattn.attention import LinearAttention, LinearStateLayer
from dofattn.errors import UserError
from dofattn.features import make_feature_map
from dofattn.ops.window import first_keys, naive_window_linear_attention, window_linear_attention
from dofattn.spec import StudentSpec
from dofattn.model.student import attention_modules, fingerprint, linearize, load_student, save_student
from tests.conftest import tiny_model
from tests.test_window import SHAPES, ids, inputs

NAMES = ("q", "k", "v", "phi_q", "phi_k", "q_log_scale", "log_offset")


def random_sinks(B, Tk, seed=3):
    return torch.rand(B, Tk, generator=torch.Generator().manual_seed(seed)) < 0.3


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padded,state", [(False, False), (True, True)])
@pytest.mark.parametrize("decay", [False, True])
def test_fast_form_matches_the_spec_with_a_sink(shape, padded, state, decay):
    """Sinks anywhere among the keys (cached ones included), with and without a decay on the linear part: outputs,
    final states and every gradient."""
    B, T, P, W = shape[0], shape[1], shape[2], shape[-1]
    tensors, valid, S0 = inputs(*shape, padded=padded, state=state)
    sinks = random_sinks(B, T + P)
    H = tensors[0].shape[2]
    log_decay = -torch.linspace(0.05, 0.6, H, dtype=torch.float64) if decay else None
    ref, ref_state = naive_window_linear_attention(*tensors, 0.3, W, valid, S0, output_final_state=True,
                                                   sink_mask=sinks, log_decay=log_decay)
    out, out_state = window_linear_attention(*tensors, 0.3, W, valid, S0, output_final_state=True, backend="chunk",
                                             sink_mask=sinks, log_decay=log_decay)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_state, ref_state, rtol=1e-12, atol=1e-12)
    weights = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(9))
    grads_ref = torch.autograd.grad((ref * weights).sum(), tensors)
    grads = torch.autograd.grad((out * weights).sum(), tensors)
    for name, a, b in zip(NAMES, grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_the_spec_gives_a_far_sink_its_exact_weight(gamma):
    """One query, W = 2, sink key 0 far back: its weight is exp(s·q·k_0) beside the window's, undecayed, and the
    linear part holds only the keys that are neither, key j at γ^(t − W − j); written out by hand."""
    torch.manual_seed(0)
    T, D, M, W, s = 9, 4, 3, 2, 0.5
    q, k, v = torch.randn(1, T, 1, D, dtype=torch.float64), torch.randn(1, T, 1, D, dtype=torch.float64), \
        torch.randn(1, T, 1, 2, dtype=torch.float64)
    phi_q, phi_k = torch.rand(1, T, 1, M, dtype=torch.float64), torch.rand(1, T, 1, M, dtype=torch.float64)
    q_scale, offset = torch.randn(1, T, 1, dtype=torch.float64), torch.randn(1, dtype=torch.float64)
    sinks = torch.zeros(1, T, dtype=torch.bool)
    sinks[0, 0] = True
    log_decay = None if gamma == 1.0 else torch.tensor([math.log(gamma)], dtype=torch.float64)
    out, state = naive_window_linear_attention(q, k, v, phi_q, phi_k, q_scale, offset, s, W, sink_mask=sinks,
                                               output_final_state=True, log_decay=log_decay)
    t = T - 1
    exact = [0, t - 1, t]
    linear = list(range(1, t - 1))
    weights = {j: torch.exp(s * q[0, t, 0] @ k[0, j, 0]) for j in exact}
    weights |= {j: phi_q[0, t, 0] @ phi_k[0, j, 0] * torch.exp(q_scale[0, t, 0] + offset[0]) * gamma ** (t - W - j)
                for j in linear}
    expected = sum(w * v[0, j, 0] for j, w in weights.items()) / sum(weights.values())
    torch.testing.assert_close(out[0, t, 0], expected, rtol=1e-12, atol=1e-12)
    folded = sum(gamma ** (T - 1 - W - j) * torch.outer(phi_k[0, j, 0], torch.cat([v[0, j, 0],
                                                                                    torch.ones(1, dtype=torch.float64)]))
                 for j in range(1, T - W))                   # every key but the last W, the sink left out
    torch.testing.assert_close(state[0, 0], folded, rtol=1e-12, atol=1e-12)


def test_no_sink_key_is_no_sink():
    tensors, valid, S0 = inputs(2, 33, 0, 3, 8, 3, 7, 8, padded=True, state=True)
    plain = window_linear_attention(*tensors, 0.3, 8, valid, S0, output_final_state=True, backend="chunk")
    none = window_linear_attention(*tensors, 0.3, 8, valid, S0, output_final_state=True, backend="chunk",
                                   sink_mask=torch.zeros(2, 33, dtype=torch.bool))
    sunk = window_linear_attention(*tensors, 0.3, 8, valid, S0, output_final_state=True, backend="chunk",
                                   sink_mask=first_keys(valid, 2, 33, 4, "cpu"))
    for a, b in zip(plain, none):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert (sunk[0] - plain[0]).abs().max() > 1e-3       # a sink changes what the far queries see


def test_first_keys_skips_padding():
    valid = torch.tensor([[False, False, True, True, True, True], [True, True, True, True, True, True],
                          [False, False, False, False, False, True]])
    expected = torch.tensor([[False, False, True, True, True, False], [True, True, True, False, False, False],
                             [False, False, False, False, False, True]])
    assert torch.equal(first_keys(valid, 3, 6, 3, "cpu"), expected)
    assert torch.equal(first_keys(None, 2, 5, 2, "cpu"), torch.tensor([[True, True, False, False, False]] * 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_stays_finite_at_exponent_195(dtype):
    """A sink key whose kernel exponent reaches ~195 (SmolLM2's largest) far behind the window: no inf or NaN."""
    torch.manual_seed(0)
    D = 64
    fmap = make_feature_map("prf", 1, D, 16, D ** -0.5)
    linear = LinearAttention(Attention(window=8, sink=2), fmap)
    x = torch.randn(1, 60, 1, D)
    x[:, 0] = x[:, 0] / x[:, 0].norm() * (195 * D ** 0.5) ** 0.5
    x[:, 40:] = x[:, 0:1]                                 # queries aligned with the sink: exponent 195
    with torch.no_grad():
        out = linear(x.to(dtype), x.to(dtype), torch.randn(1, 60, 1, D).to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("chunk", [2, 7])
def test_generation_with_a_sink_matches_the_full_forward(family, chunk):
    """Prefill in chunks shorter than the sink (its slots fill over calls) and longer, then 30 decode steps."""
    model = tiny_model(family)
    linearize(model, [9, 16, 5], Attention(window=6, sink=4), seed=1)
    prompt = ids(1, 11, seed=1)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, prefill_chunk_size=chunk)
        full = model(out.sequences, use_cache=False).logits
        plain = tiny_model(family)
        linearize(plain, [9, 16, 5], Attention(window=6, sink=0), seed=1)
        without = plain(out.sequences, use_cache=False).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, prompt.shape[1] - 1: -1], rtol=1e-4, atol=1e-4)
    assert (full - without).abs().max() > 1e-3           # the sink is there to be checked
    layer = out.past_key_values.layers[0]
    assert isinstance(layer,
                      LinearStateLayer) and layer.parts["window"].keys.shape[1] == 6 and layer.parts["sink"].valid.all()


def test_a_prefill_with_a_sink_hands_the_op_its_own_keys(monkeypatch):
    """The first cached call puts no empty sink slots before its keys (as many keys as queries: on CUDA the Triton
    hybrid's case); later calls put the filled slots first. Both give the uncached result."""
    fmap = make_feature_map("prf", 2, 8, 6, 0.5)
    layer = LinearAttention(Attention(window=4, sink=3), fmap)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 13, 2, 8, generator=g) for _ in range(3))
    keys_seen = []
    with torch.no_grad():
        full = layer.attend(q, k, v)[0]
    attend = WindowForms.attend
    monkeypatch.setattr(WindowForms, "attend",
                        lambda layer, q, k, *a, **kw: keys_seen.append(k.shape[1]) or attend(layer, q, k, *a, **kw))
    cache = LinearStateLayer()
    with torch.no_grad():
        streamed = torch.cat([layer(q[:, :9], k[:, :9], v[:, :9], cache=cache),
                              layer(q[:, 9:], k[:, 9:], v[:, 9:], cache=cache)], 1)
    assert keys_seen == [9, 3 + 4 + 4]                    # then: 3 sink slots, 4 window keys, 4 new keys
    torch.testing.assert_close(streamed, full, rtol=1e-5, atol=1e-5)


def test_batched_generation_with_a_sink_and_left_padding():
    """Each row's sink is its own first real tokens: a left-padded batch gives each row its unpadded result."""
    model = tiny_model("llama")
    linearize(model, [9, 16, 5], Attention(window=6, sink=3), seed=1)
    rows = [ids(1, 12, seed=2)[0], ids(1, 8, seed=3)[0]]
    batch = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, -len(r):], mask[i, -len(r):] = r, 1
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             prefill_chunk_size=5)
        for i, r in enumerate(rows):
            alone = model.generate(r[None], max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert torch.equal(out[i, 12:], alone[0, len(r):])


def test_static_decoding_with_a_sink_matches_hf_generate():
    from dofattn.engine import StaticDecoder

    model = tiny_model("llama")
    linearize(model, [9, 16, 5], Attention(window=6, sink=4), seed=1)
    prompt = ids(2, 13, seed=5)
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
        got = StaticDecoder(model, graph=False).generate(prompt, 20)
    assert torch.equal(got, expected)
    with pytest.raises(UserError, match="at least that many real tokens"):
        StaticDecoder(model, graph=False).generate(prompt[:, :3], 5)


def test_sink_student_round_trip(tmp_path, model_dirs):
    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 7, 3], Attention(window=8, sink=2), seed=4)
    config = StudentSpec(base_model=str(model_dirs["llama"]), dims=[5, 7, 3], layers=[0, 1, 2], seed=4,
                         base=fingerprint(model), attention=Attention(feature="prf", window=8, sink=2))
    save_student(model, tmp_path / "s", config)
    loaded, _, cfg = load_student(tmp_path / "s")
    assert cfg.attention.sink == 2 and all(m.dofattn.sink.count == 2 for m in attention_modules(loaded))
    x = ids(2, 19, seed=7)
    with torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, loaded(x, use_cache=False).logits)


def test_sink_errors():
    fmap = make_feature_map("prf", 1, 4, 4, 0.5)
    with pytest.raises(UserError, match=r"student.sink = -1: give >= 0"):
        LinearAttention(Attention(window=4, sink=-1), fmap)
    with pytest.raises(UserError, match="sits beside a softmax window"):
        LinearAttention(Attention(window=0, sink=2), fmap)
    tensors = inputs(1, 5, 0, 1, 4, 4, 2, 2)[0]
    with pytest.raises(ValueError, match="sink_mask must be bool"):
        window_linear_attention(*tensors, 0.5, 2, sink_mask=torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="lead = 1: the sink slots"):
        window_linear_attention(*tensors, 0.5, 2, lead=1)
