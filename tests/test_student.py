"""The linearized student in HF models: swap, numerics, generation with a constant-size state, save/load."""

import math

import pytest
import torch

from dofattn.attention import LinearStateLayer
from dofattn.errors import UserError
from dofattn.features import FEATURES, make_feature_map
from dofattn.student import (StudentConfig, attach_student, attention_modules, fingerprint, linearize,
                             load_student, read_config, resolve_dims, save_student)
from tests.conftest import tiny_model

FAMILIES = ["llama", "gpt2", "gpt_neox"]


def ids(batch=2, length=19, seed=0):
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- feature maps ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", FEATURES)
@pytest.mark.parametrize("dim", [2, 7, 64, 130])
def test_feature_maps_are_positive_and_shaped(kind, dim):
    fmap = make_feature_map(kind, num_heads=3, head_dim=16, dim=dim, scaling=0.25, seed=1)
    x = torch.randn(2, 5, 3, 16)
    for role in ("query", "key"):
        phi = fmap(x, role)
        assert phi.shape == (2, 5, 3, dim) and (phi >= 0).all() and torch.isfinite(phi).all()
    trainable = {n for n, p in fmap.named_parameters() if p.requires_grad}
    assert (trainable == set()) == (kind == "performer")


@pytest.mark.parametrize("kind", ["prf", "performer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prf_is_finite_at_exponent_195(kind, dtype):
    # q·k/√d = 195 with d = 64: norms of ~35, the largest seen on SmolLM2
    d = 64
    g = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    x = (direction * math.sqrt(195 * math.sqrt(d)))[None, None, None, :].expand(1, 8, 1, d).clone()
    x[:, ::2] *= 0.3  # a mix of huge and moderate vectors
    fmap = make_feature_map(kind, 1, d, 64, d ** -0.5)
    from dofattn.ops import linear_attention

    pq, pk = fmap(x.to(dtype), "query"), fmap(x.to(dtype), "key")
    out, state = linear_attention(pq, pk, torch.randn(1, 8, 1, d).to(dtype), output_final_state=True)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()


def test_key_shift_cancels_in_the_attention_ratio():
    from dofattn.ops import linear_attention

    fmap = make_feature_map("prf", 2, 16, 32, 0.25, seed=3)
    q, k, v = torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
    fmap(k, "key")  # calibrates the shift
    out1, _ = linear_attention(fmap(q, "query"), fmap(k, "key"), v)
    fmap.key_shift += 5.0
    out2, _ = linear_attention(fmap(q, "query"), fmap(k, "key"), v)
    torch.testing.assert_close(out1, out2, rtol=1e-5, atol=1e-6)


# --- swapping layers --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_swapped_gives_stock_logits(family):
    model = tiny_model(family)
    x = ids()
    stock = model(x, use_cache=False).logits
    linearize(model, dims=[8, 8, 8], layers=[])
    assert model.config._attn_implementation == "dofattn"
    assert torch.equal(model(x, use_cache=False).logits, stock)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_layer_swap_changes_only_that_layer(family):
    teacher, student = tiny_model(family), tiny_model(family)
    linearize(student, dims=[8, 8, 8], layers=[1])
    x = ids()
    with torch.no_grad():
        ref = teacher(x, output_hidden_states=True, use_cache=False).hidden_states
        got = student(x, output_hidden_states=True, use_cache=False).hidden_states
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])  # embeddings, after layer 0
    assert not torch.allclose(ref[2], got[2])
    assert [hasattr(m, "dofattn") for m in attention_modules(student)] == [False, True, False]


@pytest.mark.parametrize("family", FAMILIES)
def test_taking_the_linear_part_off_gives_the_layer_softmax_back(family):
    whole, partial = tiny_model(family), tiny_model(family)
    linearize(whole, dims=[8, 8, 8])
    linearize(partial, dims=[8, 8, 8], layers=[0, 2])
    del attention_modules(whole)[1].dofattn            # e.g. benchmarks/layer_sensitivity.py
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(whole(x, use_cache=False).logits, partial(x, use_cache=False).logits)
        got = whole.generate(x, max_new_tokens=5, do_sample=False)
        assert torch.equal(got, partial.generate(x, max_new_tokens=5, do_sample=False))


# --- generation ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("feature", ["prf", "hedgehog"])
def test_generation_matches_full_forward_for_64_steps(family, feature):
    model = tiny_model(family)
    linearize(model, dims=[9, 16, 5], feature=feature, seed=1)
    prompt = ids(batch=1, length=11, seed=1)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences, use_cache=False).logits
    steps = torch.stack(out.logits, 1)                                         # [1, 64, vocab]
    ref = full[:, prompt.shape[1] - 1: -1]
    assert steps.shape == ref.shape
    torch.testing.assert_close(steps, ref, rtol=1e-4, atol=1e-4)
    cache = out.past_key_values
    assert all(isinstance(layer, LinearStateLayer) for layer in cache.layers)
    heads = model.config.num_attention_heads
    head_dim = model.config.hidden_size // heads
    assert cache.layers[0].state.shape == (1, heads, 9, head_dim + 1) and cache.layers[0].keys is None
    assert cache.get_seq_length() == prompt.shape[1] + 63


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("window", [0, 4, "decay", "4+decay"])   # 4: the cached keys carry their padding mask
def test_batched_left_padded_generation_equals_one_by_one(family, tokenizer, window):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None  # every row generates all 12 tokens
    decay = "decay" in str(window)  # left padding passes while the state is zero: the decay changes nothing there
    window = 4 if window == "4+decay" else 0 if window == "decay" else window
    linearize(model, dims=[16, 16, 16], seed=2, window=window, decay=decay)
    if decay:
        with torch.no_grad():
            for module in attention_modules(model):
                module.dofattn.decay_rate.copy_(torch.linspace(0.5, -6, module.dofattn.num_heads))
    prompts = [ids(1, 5, seed=3)[0], ids(1, 12, seed=4)[0], ids(1, 9, seed=5)[0]]
    singles = []
    with torch.no_grad():
        for p in prompts:
            singles.append(model.generate(p[None], max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):])
        width = max(len(p) for p in prompts)
        batch = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for i, p in enumerate(prompts):
            batch[i, width - len(p):], mask[i, width - len(p):] = p, 1
        together = model.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for i, single in enumerate(singles):
        assert torch.equal(together[i, width:], single)


def test_kv_cache_of_past_tokens_is_refused():
    from transformers import DynamicCache

    from dofattn.hf import cache_kwargs

    model = tiny_model("llama")
    teacher = tiny_model("llama")
    cache = DynamicCache(config=teacher.config)
    with torch.no_grad():
        teacher(ids(1, 6), use_cache=True, **cache_kwargs(teacher, cache))
    linearize(model, dims=[8, 8, 8])
    with pytest.raises(UserError, match="cannot continue a DynamicLayer cache with 6 tokens"):
        model(ids(1, 1), use_cache=True, **cache_kwargs(model, cache))


# --- save / load -------------------------------------------------------------------------------------------------

def make_student(family, tmp_path, model_dirs, feature="prf"):
    model = tiny_model(family)
    dims = resolve_dims([5, 12, 7], model)
    linearize(model, dims, feature=feature, seed=4)
    with torch.no_grad():  # make the features differ from a fresh init
        for name, p in model.named_parameters():
            if ".dofattn." in name:
                p.add_(0.01 * torch.randn_like(p))
        model(ids(1, 8), use_cache=False)  # calibrates key shifts
    config = StudentConfig(base_model=str(model_dirs[family]), feature=feature, dims=dims, layers=[0, 1, 2],
                           seed=4, base=fingerprint(model))
    folder = save_student(model, tmp_path / f"student-{family}", config)
    return model, folder


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip_is_exact(family, tmp_path, model_dirs):
    from dofattn.hf import load_model

    base, _ = load_model(str(model_dirs[family]))
    model = tiny_model(family)
    assert torch.equal(base.get_input_embeddings().weight, model.get_input_embeddings().weight)
    model, folder = make_student(family, tmp_path, model_dirs)
    loaded, tokenizer, config = load_student(folder)
    assert config.dims == [5, 12, 7] and config.dofattn_version
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, loaded(x, use_cache=False).logits)
    assert sorted(p.name for p in folder.iterdir()) == ["dofattn.json", "features.safetensors"]   # no staging


def test_load_errors(tmp_path, model_dirs):
    model, folder = make_student("llama", tmp_path, model_dirs)
    other = tiny_model("llama", seed=9)  # same shapes, other weights
    with pytest.raises(UserError, match="does not fit this model.*embedding_norm"):
        attach_student(other, folder)
    with pytest.raises(UserError, match="does not fit this model"):
        attach_student(tiny_model("gpt2"), folder)
    (folder / "features.safetensors").unlink()
    with pytest.raises(UserError, match="features.safetensors is missing"):
        read_config(folder)


def test_resolve_dims(tmp_path):
    model = tiny_model("llama")
    assert resolve_dims("fix", model) == [16, 16, 16]
    assert resolve_dims("fix:5", model) == [5, 5, 5]
    for bad, message in [("fix:0", "bad --dims"), ("nope", "bad --dims"), ([1, 2], "gives 2 layers"),
                         (str(tmp_path / "x.json"), "does not exist")]:
        with pytest.raises(UserError, match=message):
            resolve_dims(bad, model)
    from dofattn.dof import DofResult, LayerDof

    path = tmp_path / "dof.json"
    path.write_text(DofResult(model="other", layers=[LayerDof(i, 1.0, [1.0], 4, [4]) for i in range(3)]).to_json())
    with pytest.raises(UserError, match="computed for model 'other'"):
        resolve_dims(str(path), model, "mine")
    assert resolve_dims(str(path), model, "other") == [4, 4, 4]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conv", [0, 4])    # 4: the filters' last inputs carry over from chunk to chunk
def test_chunked_prefill_continues_the_state(family, conv):
    model = tiny_model(family)
    linearize(model, dims=[6, 6, 6], seed=3, conv=conv)
    if conv:
        set_convs(model)
    prompt = ids(2, 23, seed=6)
    with torch.no_grad():
        whole = model.generate(prompt, max_new_tokens=8, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        chunked = model.generate(prompt, max_new_tokens=8, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0, prefill_chunk_size=5)
    torch.testing.assert_close(torch.stack(chunked.logits), torch.stack(whole.logits), rtol=1e-4, atol=1e-4)
    assert chunked.past_key_values.layers[0].seen == 23 + 7


def test_per_head_dims_equal_separate_maps_of_those_sizes():
    from dofattn.ops import linear_attention

    torch.manual_seed(0)
    fmap = make_feature_map("prf", 3, 8, 7, scaling=8 ** -0.5, seed=2, head_dims=[7, 2, 4])
    q, k, v = torch.randn(2, 11, 3, 8), torch.randn(2, 11, 3, 8), torch.randn(2, 11, 3, 8)
    phi_q, q_scale = fmap.features(q, "query")
    phi_k, k_scale = fmap.features(k, "key")
    assert (phi_q[..., 1, 2:] == 0).all() and (phi_k[..., 2, 4:] == 0).all() and (phi_q[..., 0, :] > 0).all()
    out, _ = linear_attention(phi_q, phi_k, v)
    for h, d in enumerate([7, 2, 4]):
        own = make_feature_map("prf", 1, 8, d, scaling=8 ** -0.5)
        with torch.no_grad():
            own.directions.copy_(fmap.directions[h:h + 1, :d])
            own.log_weights.copy_(fmap.log_weights[h:h + 1, :d])
        pq, sq = own.features(q[:, :, h:h + 1], "query")
        pk, sk = own.features(k[:, :, h:h + 1], "key")
        torch.testing.assert_close(linear_attention(pq, pk, v[:, :, h:h + 1])[0], out[:, :, h:h + 1])
        # the kernel's scale (1/d, shifts) matches too, which the window hybrid and the l2 loss rely on
        torch.testing.assert_close(q_scale[..., h] + k_scale[h], sq[..., 0] + sk[0])
    with pytest.raises(UserError, match="head_dims"):
        make_feature_map("prf", 3, 8, 7, scaling=0.3, head_dims=[7, 8, 1])
    with pytest.raises(UserError, match="per-head dims need prf"):
        make_feature_map("hedgehog", 3, 8, 7, scaling=0.3, head_dims=[7, 2, 4])


def test_student_file_holds_only_trained_state(tmp_path, model_dirs):
    from dofattn.hf import load_model
    from dofattn.student import student_state

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 7, 3], seed=4, head_dims=[[5, 1, 2, 5], [7, 7, 7, 7], [1, 1, 3, 2]])
    names = sorted(student_state(model))
    assert names and all(n.rsplit(".", 1)[-1] in ("directions", "log_weights", "key_shift") for n in names)
    config = StudentConfig(str(model_dirs["llama"]), "prf", [5, 7, 3], [0, 1, 2], 4, fingerprint(model),
                           head_dims=[[5, 1, 2, 5], [7, 7, 7, 7], [1, 1, 3, 2]])
    save_student(model, tmp_path / "s", config)
    loaded, _, _ = load_student(tmp_path / "s")
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, loaded(x, use_cache=False).logits)


def test_key_shift_calibration_flag_follows_the_buffer():
    """`shift_calibrated` is cached per buffer version: calibrating, loading and resetting all move it."""
    from dofattn.features import make_feature_map

    fmap = make_feature_map("prf", 2, 8, 5, scaling=0.25)
    assert not fmap.shift_calibrated()
    fmap.features(torch.randn(1, 4, 2, 8), "key")                       # training mode: calibrates
    assert fmap.shift_calibrated()
    fmap.key_shift.fill_(-torch.inf)
    assert not fmap.shift_calibrated()
    fmap.load_state_dict({**fmap.state_dict(), "key_shift": torch.zeros(2)})
    assert fmap.shift_calibrated()


# --- decay -------------------------------------------------------------------------------------------------------------

def assert_40_steps_equal_the_full_forward(model, prompt: torch.Tensor) -> None:
    """Greedy generation's logits, step by step through the cache, against one forward over the whole sequence."""
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences, use_cache=False).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, prompt.shape[1] - 1: -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("feature", ["prf", "hedgehog"])
def test_decay_generation_matches_full_forward(family, feature):
    """With a learned per-head decay the state still carries everything: 40 decode steps equal the full forward."""
    model = tiny_model(family)
    linearize(model, dims=[9, 16, 5], feature=feature, seed=1, decay=True)
    with torch.no_grad():
        for module in attention_modules(model):      # strong and weak decays, so the test sees them
            module.dofattn.decay_rate.copy_(torch.linspace(0.5, -6, module.dofattn.num_heads))
    assert_40_steps_equal_the_full_forward(model, ids(batch=1, length=11, seed=1))


@pytest.mark.parametrize("window", [0, 4])
def test_decay_changes_the_output_and_round_trips(tmp_path, model_dirs, window):
    from dofattn.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    plain, _ = load_model(str(model_dirs["llama"]))
    linearize(model, dims=[5, 12, 7], decay=True, seed=2, window=window)
    linearize(plain, dims=[5, 12, 7], seed=2, window=window)
    with torch.no_grad():
        for module in attention_modules(model):
            module.dofattn.decay_rate.add_(torch.arange(module.dofattn.num_heads) * 0.1)   # not the init
    x = ids()
    with torch.no_grad():
        logits = model(x, use_cache=False).logits
        assert not torch.allclose(logits, plain(x, use_cache=False).logits)
    config = StudentConfig(str(model_dirs["llama"]), "prf", [5, 12, 7], [0, 1, 2], 2, fingerprint(model), decay=True,
                           window=window)
    folder = save_student(model, tmp_path / "s", config)
    loaded, _, config = load_student(folder)
    assert config.decay and config.window == window
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, logits)


def test_decay_refuses_padding_it_would_count():
    from dofattn.attention import check_decay_padding, check_left_padding

    left = torch.tensor([[False, True, True], [True, True, True]])
    check_decay_padding(left, None)                                   # left padding of a first chunk: exact
    check_decay_padding(torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 4, 5, 3))   # no padding: any state
    with pytest.raises(UserError, match="needs left padding"):
        check_decay_padding(torch.tensor([[True, False, True]]), None)
    with pytest.raises(UserError, match="cannot continue its state through padding"):
        check_decay_padding(left, torch.zeros(2, 4, 5, 3))
    # beside a window a call sees its cached keys too: padding before every real one is exact, state or not
    check_left_padding(left)
    with pytest.raises(UserError, match="needs left padding"):
        check_left_padding(torch.tensor([[True, True], [True, False]]))


# --- gate (a decay per token) -------------------------------------------------------------------------------------------

def set_gates(model) -> None:
    """Move the gates off their start (w = 0: the plain decay), so a test sees each token's own factor."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in attention_modules(model):
            linear = module.dofattn
            linear.decay_rate.copy_(torch.linspace(0.5, -6, linear.num_heads))
            linear.gate_weight.copy_(3 * torch.randn(linear.gate_weight.shape, generator=g))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("feature", ["prf", "hedgehog"])
def test_gate_generation_matches_full_forward(family, feature):
    """With a gate the state still carries everything: 40 decode steps (each token's gate read off its own value
    vector) equal the full forward."""
    model = tiny_model(family)
    linearize(model, dims=[9, 16, 5], feature=feature, seed=1, gate=True)
    set_gates(model)
    assert_40_steps_equal_the_full_forward(model, ids(batch=2, length=11, seed=1))


def test_gate_starts_as_the_decay_then_differs_and_round_trips(tmp_path, model_dirs):
    from dofattn.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    decayed, _ = load_model(str(model_dirs["llama"]))
    linearize(model, dims=[5, 12, 7], gate=True, seed=2)
    linearize(decayed, dims=[5, 12, 7], decay=True, seed=2)
    x = ids()
    layer = attention_modules(model)[0].dofattn
    assert layer.gate and layer.decay and "gate" in repr(layer)
    with torch.no_grad():
        torch.testing.assert_close(model(x, use_cache=False).logits, decayed(x, use_cache=False).logits)
        set_gates(model)
        for module in attention_modules(decayed):
            module.dofattn.decay_rate.copy_(torch.linspace(0.5, -6, module.dofattn.num_heads))
        logits = model(x, use_cache=False).logits
        assert not torch.allclose(logits, decayed(x, use_cache=False).logits, atol=1e-3)
    config = StudentConfig(str(model_dirs["llama"]), "prf", [5, 12, 7], [0, 1, 2], 2, fingerprint(model), gate=True)
    folder = save_student(model, tmp_path / "s", config)
    loaded, _, config = load_student(folder)
    assert config.gate and attention_modules(loaded)[2].dofattn.gate
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, logits)


def test_gate_log_factors_are_bounded_and_train():
    """Each token's log factor lies in [GATE_FLOOR, 0] however large w·v grows either way, and a loss reaches w."""
    from dofattn.attention import GATE_FLOOR

    model = tiny_model("llama")
    linearize(model, dims=[8, 8, 8], gate=True)
    linear = attention_modules(model)[0].dofattn
    v = torch.randn(2, 9, linear.num_heads, linear.gate_weight.shape[1])
    with torch.no_grad():
        linear.gate_weight.fill_(1e4)
        logs = linear.log_gates(v)
    assert logs.shape == (2, 9, linear.num_heads) and (logs <= 0).all() and (logs >= GATE_FLOOR).all()
    assert torch.isfinite(logs).all() and (logs == GATE_FLOOR).any() and (logs == 0).any()   # cleared and kept
    with torch.no_grad():
        linear.gate_weight.zero_()
    linear.log_gates(v).sum().backward()
    assert linear.gate_weight.grad.abs().sum() > 0


def test_gate_refuses_a_window_and_padding_it_would_count():
    with pytest.raises(UserError, match="a gate is for pure linear attention"):
        linearize(tiny_model("llama"), dims=[8, 8, 8], window=4, gate=True)
    model = tiny_model("llama")
    linearize(model, dims=[8, 8, 8], gate=True)
    x, mask = ids(batch=2, length=9), torch.ones(2, 9, dtype=torch.long)
    mask[1, -2:] = 0
    with pytest.raises(UserError, match="needs left padding"), torch.no_grad():
        model(x, attention_mask=mask, use_cache=False)


def test_window_decay_refuses_right_padding_in_a_model():
    model = tiny_model("llama")
    linearize(model, dims=[8, 8, 8], window=4, decay=True)
    x, mask = ids(batch=2, length=9), torch.ones(2, 9, dtype=torch.long)
    mask[1, -2:] = 0
    with pytest.raises(UserError, match="needs left padding"), torch.no_grad():
        model(x, attention_mask=mask, use_cache=False)


# --- short convolution on q, k, v -------------------------------------------------------------------------------------

def set_convs(model, seed: int = 6) -> None:
    """Move every filter off the identity (its start), with weight on the tokens before, so a test sees the mixing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in attention_modules(model):
            for name in ("conv_q", "conv_k", "conv_v"):
                weight = getattr(module.dofattn, name)
                weight.copy_(0.6 * torch.randn(weight.shape, generator=g))


@pytest.mark.parametrize("family", FAMILIES)
def test_conv_starts_as_no_conv(family):
    model, plain = tiny_model(family), tiny_model(family)
    linearize(model, dims=[9, 16, 5], seed=1, conv=4)
    linearize(plain, dims=[9, 16, 5], seed=1)
    layer = attention_modules(model)[0].dofattn
    assert layer.conv_q.shape == (4, model.config.num_attention_heads, 16) and "conv=4" in repr(layer)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x, use_cache=False).logits, plain(x, use_cache=False).logits)
        set_convs(model)
        assert not torch.allclose(model(x, use_cache=False).logits, plain(x, use_cache=False).logits, atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", ["pure", "gate", "window", "window+sink"])
def test_conv_generation_matches_full_forward(family, variant):
    """The cache carries the last K-1 inputs of q, k and v: 40 decode steps equal the full forward, beside a gate, a
    window (whose cached keys are the filtered ones) and a sink."""
    model = tiny_model(family)
    window = 4 if "window" in variant else 0
    linearize(model, dims=[9, 16, 5], feature="hedgehog", seed=1, conv=3, window=window, gate=variant == "gate",
              sink=2 if "sink" in variant else 0)
    set_convs(model)
    if variant == "gate":
        set_gates(model)
    assert_40_steps_equal_the_full_forward(model, ids(batch=2, length=11, seed=1))


@pytest.mark.parametrize("family", FAMILIES)
def test_conv_left_padding_is_the_start_of_a_sequence(family, tokenizer):
    """A padding token's inputs count as zeros in the filters: a left-padded row generates as it does alone."""
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    linearize(model, dims=[6, 6, 6], seed=3, conv=4)
    set_convs(model)
    short, long = ids(1, 5, seed=3)[0], ids(1, 9, seed=4)[0]
    batch = torch.stack([torch.cat([torch.full((4,), 7), short]), long])
    mask = (torch.arange(9) >= torch.tensor([[4], [0]])).long()
    with torch.no_grad():
        single = model.generate(short[None], max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        together = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)
    torch.testing.assert_close(torch.stack(together.logits)[:, 0], torch.stack(single.logits)[:, 0], rtol=1e-4,
                               atol=1e-4)


def test_conv_round_trips_and_refuses_bad_widths(tmp_path, model_dirs):
    from dofattn.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, dims=[5, 12, 7], seed=2, conv=4, gate=True)
    set_convs(model)
    x = ids()
    with torch.no_grad():
        logits = model(x, use_cache=False).logits
    config = StudentConfig(str(model_dirs["llama"]), "prf", [5, 12, 7], [0, 1, 2], 2, fingerprint(model), gate=True,
                           conv=4)
    folder = save_student(model, tmp_path / "s", config)
    loaded, _, config = load_student(folder)
    assert config.conv == 4 and attention_modules(loaded)[1].dofattn.conv == 4
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, logits)
    for width in (1, -2):
        with pytest.raises(UserError, match="filter width of at least 2 tokens"):
            linearize(tiny_model("llama"), dims=[8, 8, 8], conv=width)
    from dofattn.attention import LinearAttention

    with pytest.raises(UserError, match="give the head dimension"):
        LinearAttention(make_feature_map("prf", 4, 16, 8, 0.25), 4, 2, conv=4)


# --- the delta rule -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_delta_generation_matches_full_forward(family):
    """With the delta rule the state still carries everything: 40 decode steps (each token's gate and erase strength
    read off its own value vector, strong enough to matter) equal the full forward. (Without a gate: the layer's
    own test, tests/test_delta.py.)"""
    model = tiny_model(family)
    linearize(model, dims=[9, 16, 5], feature="hedgehog", seed=1, gate=True, delta=True)
    set_gates(model)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for module in attention_modules(model):
            module.dofattn.delta_bias.zero_()
            module.dofattn.delta_weight.copy_(3 * torch.randn(module.dofattn.delta_weight.shape, generator=g))
    assert_40_steps_equal_the_full_forward(model, ids(batch=2, length=11, seed=1))
