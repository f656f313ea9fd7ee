"""The attention layer (`dofattn.attention`): every path of `LinearAttention` against the ops' naive forms, and
inside HF models generation through the cache equal to the full forward, padding, and each mechanism (decay, gate,
short convolution) with its round trip."""

import pytest
import torch
import torch.nn.functional as F

from dofattn.spec import Attention
from dofattn.attention import CONV_NAMES, LinearAttention, LinearStateLayer, Part
from dofattn.attention.part import KERNELS
from dofattn.attention.cache import PartState, keep_buffer
from dofattn.attention.decay import Decay
from dofattn.errors import UserError
from dofattn.features import make_feature_map
from dofattn.ops.naive import naive_linear_attention
from dofattn.ops.softmax import expand_kv
from dofattn.ops.window import first_keys, naive_window_linear_attention
from dofattn.spec import StudentSpec
from dofattn.model.student import attention_modules, fingerprint, linearize, load_student, save_student
from tests.conftest import tiny_model

FAMILIES = ["llama", "gpt2", "gpt_neox"]


def ids(batch=2, length=19, seed=0):
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- the layer against the naive forms -------------------------------------------------------------------------

# odd shapes: 13 tokens, 6 query heads on 2 kv heads, head dim 5, 7 features, a window of 4, a sink of 2
B, T, H, HKV, D, M = 2, 13, 6, 2, 5, 7
LAYERS = {"pure": {}, "decay": {"decay": "head"}, "gate": {"decay": "gate"}, "window": {"window": 4},
          "window+decay": {"window": 4, "decay": "head"}, "window+sink": {"window": 4, "sink": 2},
          "window+sink+decay": {"window": 4, "sink": 2, "decay": "head"},
          "conv+gate": {"conv": 3, "decay": "gate"}, "conv+window+sink": {"conv": 3, "window": 4, "sink": 2}}


def odd_layer(variant: str, feature: str) -> LinearAttention:
    return off_its_start(Attention(**{"window": 0, "sink": 0, **LAYERS[variant]}), feature)


def off_its_start(attention: Attention, feature: str = "prf") -> LinearAttention:
    """A float64 layer of the odd shapes whose every parameter is off its start, so that each mechanism shows in the
    output."""
    torch.manual_seed(0)
    layer = LinearAttention(attention, make_feature_map(feature, H, D, M, scaling=D ** -0.5, seed=1),
                            num_kv_heads=HKV).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if not name.startswith("feature_map."):
                p.add_(0.5 * torch.randn_like(p))
    return layer


def odd_inputs(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, T, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False                                                        # left padding in the second row
    return q, k, v, valid


def reference_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution by F.conv1d: weight [K, C, D], weight[j] on the token j back."""
    K, (b, t, c, d) = weight.shape[0], x.shape
    kernel = weight.flip(0).permute(1, 2, 0).reshape(c * d, 1, K)
    y = F.conv1d(F.pad(x.reshape(b, t, c * d).transpose(1, 2), (K - 1, 0)), kernel, groups=c * d)
    return y.transpose(1, 2).reshape(b, t, c, d)


def head_decay(layer: LinearAttention) -> torch.Tensor | None:
    """The layer's decay per head, log γ [H], read off its part (None without one)."""
    return None if layer.decay is None else layer.decay.log_decay()


def reference(layer: LinearAttention, q, k, v, valid) -> torch.Tensor:
    """The layer's output by the ops' naive forms (quadratic or token by token), none of the layer's dispatch."""
    fmap = layer.feature_map
    if layer.conv is not None:
        keep = valid[:, :, None, None].to(q.dtype)
        q, k, v = (reference_conv(x * keep, getattr(layer.conv, name)) for x, name in zip((q, k, v), CONV_NAMES))
    k, v = expand_kv(k, H), expand_kv(v, H)
    if layer.attention.window:
        phi_q, q_scale = fmap.features(q, "query")
        phi_k, k_scale = fmap.features(k, "key")
        sink = first_keys(valid, B, T, layer.attention.sink, q.device) if layer.attention.sink else None
        return naive_window_linear_attention(q, k, v, phi_q, phi_k, q_scale, k_scale + layer.window.log_gain,
                                             fmap.scaling, layer.attention.window, valid, log_decay=head_decay(layer),
                                             sink_mask=sink)[0]
    phi_q, phi_k = fmap(q, "query"), fmap(k, "key") * valid[:, :, None, None]
    log_gate = layer.decay.log_gates(v) if (layer.attention.decay == "gate") else None
    return naive_linear_attention(phi_q, phi_k, v,
                                  log_decay=None if (layer.attention.decay == "gate") else head_decay(layer),
                                  log_gate=log_gate)[0]


@pytest.mark.parametrize("feature", ["prf", "hedgehog"])
@pytest.mark.parametrize("variant", LAYERS)
def test_every_path_matches_the_naive_forms(variant, feature):
    """On odd shapes with left padding: the prefill (output and gradients), a cached prefill continued by single
    steps and a chunk, and for a hybrid static ring steps, each against the ops' naive forms."""
    layer = odd_layer(variant, feature)
    q, k, v, valid = odd_inputs()
    layer(q, k, v, valid)                                          # training mode: a PRF map calibrates its shift
    layer.eval()
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    weights = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = []
    for forward in (lambda *x: layer(*x, valid), lambda *x: reference(layer, *x, valid)):
        out = forward(*inputs)
        grads.append(torch.autograd.grad((out * weights).sum(), inputs + list(layer.parameters()), allow_unused=True))
        if len(grads) == 1:
            got = out.detach()
    ref = out.detach()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert (got - layer(q, k, v, valid, backend="naive")).abs().max() < 1e-6
    for mine, theirs in zip(*grads):
        if theirs is None:                                          # a parameter the output does not use
            assert mine is None or not mine.any()
            continue
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        cache = LinearStateLayer()
        pieces = [slice(0, 5), *(slice(t, t + 1) for t in range(5, 9)), slice(9, T)]
        steps = [layer(q[:, s], k[:, s], v[:, s], valid[:, s], cache=cache) for s in pieces]
        torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-6, atol=1e-6)
        if layer.attention.window:
            continue_static(layer, q, k, v, valid, ref)


def continue_static(layer, q, k, v, valid, want, reorder: bool = False, tol: float = 1e-6) -> None:
    """A prefill of 6 tokens into a cache, then static decoding on its static form (`to_static`: a window's ring),
    each step against `want`. `reorder`: the batch rows swapped twice first (the slot reorders every part's state)."""
    cache = LinearStateLayer()
    layer(q[:, :6], k[:, :6], v[:, :6], valid[:, :6], cache=cache)
    cache.seen = 6
    for _ in range(2 if reorder else 0):
        cache.batch_select_indices(torch.tensor([1, 0]))
    position = torch.tensor([6])
    static = cache.to_static(position)
    for t in range(6, T):
        out = layer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache=static)
        torch.testing.assert_close(out, want[:, t:t + 1], rtol=tol, atol=tol)
        position.add_(1)


def naive_output(layer: LinearAttention, q, k, v) -> torch.Tensor:
    """The layer's output from its naive form: each query's row of `naive` (composed from every part) times the
    values as the parts leave them (a convolution's filtered values)."""
    k, v = expand_kv(k, H), expand_kv(v, H)
    weights = layer.naive(q, k, v).exp().to(v.dtype)                              # [B, H, T, T]
    for part in layer.parts():
        _, _, v = part.inputs(q, k, v, None)
    return torch.einsum("bhts,bshd->bthd", weights, v)


@pytest.mark.parametrize("variant", LAYERS)
def test_naive_is_the_layer_composed_from_every_part(variant):
    """`naive`, the matrix the layerwise loss and the gain calibration read, gives the ops' naive forms' output: the
    convolution (off its start) and the gate included."""
    layer = odd_layer(variant, "prf").float()                     # the naive form computes in float32
    q, k, v = (x.float() for x in odd_inputs()[:3])
    valid = torch.ones(B, T, dtype=torch.bool)
    layer(q, k, v, valid)
    layer.eval()
    torch.testing.assert_close(naive_output(layer, q, k, v), reference(layer, q, k, v, valid), rtol=1e-4, atol=1e-5)


class EchoState(PartState):
    """A throwaway part's cache state: the last value of the previous call."""

    NAMES = ("last",)


class Echo(Part):
    """A throwaway stateful part, in no package file: each value gets `mix` times the one before it (the state
    carries the last one across calls)."""

    name, State, layerwise = "echo", EchoState, False
    kernels = KERNELS                     # it acts on the inputs, before any form

    @classmethod
    def build(cls, attention, num_heads, num_kv_heads, head_dim):
        return cls(num_kv_heads)

    def __init__(self, heads: int):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.linspace(0.3, 0.9, heads))

    def inputs(self, q, k, v, key_valid, cache=None):
        state = None if cache is None else cache.part(self.name)
        before = v.new_zeros(v[:, :1].shape) if state is None or state.last is None else state.last
        if state is not None:
            keep_buffer(state, "last", v[:, -1:])
        mix = expand_kv(self.mix.to(v.dtype)[None, :, None], v.shape[2], dim=1)   # [1, heads, 1]
        return q, k, v + mix[:, None] * torch.cat([before, v[:, :-1]], 1)


@pytest.mark.parametrize("variant", ["pure", "window+sink+decay"])
def test_a_new_stateful_part_needs_only_its_module_and_a_row_of_parts(variant, monkeypatch):
    """Adding a part is its module and one entry of `layer.PARTS` (its recipe key aside): the layer runs it in every
    path, its naive form includes it, the cache slot keeps, batches and freezes its state for static decoding."""
    import dofattn.attention.layer as layer_module

    plain = odd_layer(variant, "prf").float()                       # the same layer without the part
    monkeypatch.setattr(layer_module, "PARTS", layer_module.PARTS + (Echo,))
    layer = odd_layer(variant, "prf").float()                       # the same draws, then the part's own
    assert isinstance(layer.echo, Echo) and layer.parts()[-1] is layer.echo
    q, k, v = (x.float() for x in odd_inputs()[:3])
    valid = torch.ones(B, T, dtype=torch.bool)
    for each in (plain, layer):
        each(q, k, v, valid)                                        # training mode: calibrates the key shift
        each.eval()
    with torch.no_grad():
        full = layer(q, k, v, valid)
        assert (full - plain(q, k, v, valid)).abs().max() > 1e-3     # the part's own effect shows
        echo = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], 1) * layer.echo.mix[:, None]   # kv heads
        torch.testing.assert_close(full, plain(q, k, v + echo, valid), rtol=1e-5, atol=1e-6)   # and only it
        torch.testing.assert_close(naive_output(layer, q, k, v), full, rtol=1e-4, atol=1e-5)
        cache = LinearStateLayer()
        pieces = [slice(0, 6), *(slice(t, t + 1) for t in range(6, 9)), slice(9, T)]
        steps = [layer(q[:, s], k[:, s], v[:, s], valid[:, s], cache=cache) for s in pieces]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
        assert set(cache.parts) >= {"echo"} and "echo.last" in cache.tensors()
        continue_static(layer, q, k, v, valid, full, reorder=True, tol=1e-5)


# --- generation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("feature", ["prf", "hedgehog"])
def test_generation_matches_full_forward_for_64_steps(family, feature):
    model = tiny_model(family)
    linearize(model, [9, 16, 5], Attention(feature=feature, window=0, sink=0), seed=1)
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
    linearize(model, [16, 16, 16], Attention(window=window, sink=0, decay="head" if decay else "none"), seed=2)
    if decay:
        with torch.no_grad():
            for module in attention_modules(model):
                module.dofattn.decay.decay_rate.copy_(torch.linspace(0.5, -6, module.dofattn.num_heads))
    assert_batched_as_alone(model, 12)


def assert_batched_as_alone(model, new_tokens: int, check_alone=None) -> None:
    """Three prompts of 5, 12 and 9 tokens, left-padded into one batch, generate the tokens each does alone;
    `check_alone(prompt, output)` looks at each lone generation too."""
    prompts = [ids(1, 5, seed=3)[0], ids(1, 12, seed=4)[0], ids(1, 9, seed=5)[0]]
    singles = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(p[None], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            if check_alone:
                check_alone(p, out)
            singles.append(out[0, len(p):])
        width = max(len(p) for p in prompts)
        batch = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for i, p in enumerate(prompts):
            batch[i, width - len(p):], mask[i, width - len(p):] = p, 1
        together = model.generate(batch, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0)
    for i, single in enumerate(singles):
        assert torch.equal(together[i, width:], single)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_kept_softmax_layer_generates_batched_as_one_by_one(family):
    """Layer 1 kept softmax between window hybrids (`student.keep_softmax`): its KV cache grows beside the linear
    layers' states, and left-padded rows generate what they generate alone, and what the full forward predicts."""
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    linearize(model, [16, 16, 16], Attention(window=4, sink=1), seed=2, layers=[0, 2])

    def like_the_full_forward(prompt, out):
        assert torch.equal(model(out).logits[0, len(prompt) - 1:-1].argmax(-1), out[0, len(prompt):])

    assert_batched_as_alone(model, 10, like_the_full_forward)


def test_kv_cache_of_past_tokens_is_refused():
    from transformers import DynamicCache

    from dofattn.attention.cache import cache_kwargs

    model = tiny_model("llama")
    teacher = tiny_model("llama")
    cache = DynamicCache(config=teacher.config)
    with torch.no_grad():
        teacher(ids(1, 6), use_cache=True, **cache_kwargs(teacher, cache))
    linearize(model, [8, 8, 8], Attention(window=0, sink=0))
    with pytest.raises(UserError, match="cannot continue a DynamicLayer cache with 6 tokens"):
        model(ids(1, 1), use_cache=True, **cache_kwargs(model, cache))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conv", [0, 4])    # 4: the filters' last inputs carry over from chunk to chunk
def test_chunked_prefill_continues_the_state(family, conv):
    model = tiny_model(family)
    linearize(model, [6, 6, 6], Attention(window=0, sink=0, conv=conv), seed=3)
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


# --- decay -----------------------------------------------------------------------------------------------------

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
    linearize(model, [9, 16, 5], Attention(feature=feature, window=0, sink=0, decay="head"), seed=1)
    with torch.no_grad():
        for module in attention_modules(model):      # strong and weak decays, so the test sees them
            module.dofattn.decay.decay_rate.copy_(torch.linspace(0.5, -6, module.dofattn.num_heads))
    assert_40_steps_equal_the_full_forward(model, ids(batch=1, length=11, seed=1))


@pytest.mark.parametrize("window", [0, 4])
def test_decay_changes_the_output_and_round_trips(tmp_path, model_dirs, window):
    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    plain, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 12, 7], Attention(window=window, sink=0, decay="head"), seed=2)
    linearize(plain, [5, 12, 7], Attention(window=window, sink=0), seed=2)
    with torch.no_grad():
        for module in attention_modules(model):
            module.dofattn.decay.decay_rate.add_(torch.arange(module.dofattn.num_heads) * 0.1)   # not the init
    x = ids()
    with torch.no_grad():
        logits = model(x, use_cache=False).logits
        assert not torch.allclose(logits, plain(x, use_cache=False).logits)
    config = StudentSpec(base_model=str(model_dirs["llama"]), dims=[5, 12, 7], layers=[0, 1, 2], seed=2,
                         base=fingerprint(model), attention=Attention(feature="prf", window=window, sink=0,
                                                                      decay="head"))
    folder = save_student(model, tmp_path / "s", config)
    loaded, _, config = load_student(folder)
    assert config.attention.decay == "head" and config.attention.window == window
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, logits)


def test_decay_refuses_padding_it_would_count():
    from dofattn.attention import check_decay_padding, check_left_padding

    left = torch.tensor([[False, True, True], [True, True, True]])
    check_decay_padding(left, None)                                   # left padding of a first chunk: exact
    check_decay_padding(torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 4, 5, 3))   # no padding: any state
    with pytest.raises(UserError, match="needs left padding"):
        check_decay_padding(torch.tensor([[True, False, True]]), None)
    check_decay_padding(left, torch.zeros(2, 4, 5, 3))               # a later chunk, nothing real before: exact
    with pytest.raises(UserError, match="cannot continue its state through padding"):
        check_decay_padding(left, torch.ones(2, 4, 5, 3))                # a real token before the padding
    # beside a window a call sees its cached keys too: padding before every real one is exact, state or not
    check_left_padding(left)
    with pytest.raises(UserError, match="needs left padding"):
        check_left_padding(torch.tensor([[True, True], [True, False]]))


# --- gate (a decay per token) ----------------------------------------------------------------------------------

def set_gates(model) -> None:
    """Move the gates off their start (w = 0: the plain decay), so a test sees each token's own factor."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in attention_modules(model):
            linear = module.dofattn
            linear.decay.decay_rate.copy_(torch.linspace(0.5, -6, linear.num_heads))
            linear.decay.gate_weight.copy_(3 * torch.randn(linear.decay.gate_weight.shape, generator=g))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("feature", ["prf", "hedgehog"])
def test_gate_generation_matches_full_forward(family, feature):
    """With a gate the state still carries everything: 40 decode steps (each token's gate read off its own value
    vector) equal the full forward."""
    model = tiny_model(family)
    linearize(model, [9, 16, 5], Attention(feature=feature, window=0, sink=0, decay="gate"), seed=1)
    set_gates(model)
    assert_40_steps_equal_the_full_forward(model, ids(batch=2, length=11, seed=1))


def test_gate_starts_as_the_decay_then_differs_and_round_trips(tmp_path, model_dirs):
    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    decayed, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 12, 7], Attention(window=0, sink=0, decay="gate"), seed=2)
    linearize(decayed, [5, 12, 7], Attention(window=0, sink=0, decay="head"), seed=2)
    x = ids()
    layer = attention_modules(model)[0].dofattn
    assert layer.attention.decay == "gate" and isinstance(layer.decay, Decay) and layer.decay.per_token and "gate" in repr(layer)
    with torch.no_grad():
        torch.testing.assert_close(model(x, use_cache=False).logits, decayed(x, use_cache=False).logits)
        set_gates(model)
        for module in attention_modules(decayed):
            module.dofattn.decay.decay_rate.copy_(torch.linspace(0.5, -6, module.dofattn.num_heads))
        logits = model(x, use_cache=False).logits
        assert not torch.allclose(logits, decayed(x, use_cache=False).logits, atol=1e-3)
    config = StudentSpec(base_model=str(model_dirs["llama"]), dims=[5, 12, 7], layers=[0, 1, 2], seed=2,
                         base=fingerprint(model), attention=Attention(feature="prf", window=0, sink=0, decay="gate"))
    folder = save_student(model, tmp_path / "s", config)
    loaded, _, config = load_student(folder)
    assert config.attention.decay == "gate" and attention_modules(loaded)[2].dofattn.attention.decay == "gate"
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, logits)


def test_gate_log_factors_are_bounded_and_train():
    """Each token's log factor lies in [GATE_FLOOR, 0] however large w·v grows either way, and a loss reaches w."""
    from dofattn.attention import GATE_FLOOR

    model = tiny_model("llama")
    linearize(model, [8, 8, 8], Attention(window=0, sink=0, decay="gate"))
    linear = attention_modules(model)[0].dofattn
    v = torch.randn(2, 9, linear.num_heads, linear.decay.gate_weight.shape[1])
    with torch.no_grad():
        linear.decay.gate_weight.fill_(1e4)
        logs = linear.decay.log_gates(v)
    assert logs.shape == (2, 9, linear.num_heads) and (logs <= 0).all() and (logs >= GATE_FLOOR).all()
    assert torch.isfinite(logs).all() and (logs == GATE_FLOOR).any() and (logs == 0).any()   # cleared and kept
    with torch.no_grad():
        linear.decay.gate_weight.zero_()
    linear.decay.log_gates(v).sum().backward()
    assert linear.decay.gate_weight.grad.abs().sum() > 0


def test_gate_refuses_a_window_and_padding_it_would_count():
    with pytest.raises(UserError, match="student.decay = 'gate' is for pure linear attention"):
        linearize(tiny_model("llama"), [8, 8, 8], Attention(window=4, sink=0, decay="gate"))
    model = tiny_model("llama")
    linearize(model, [8, 8, 8], Attention(window=0, sink=0, decay="gate"))
    x, mask = ids(batch=2, length=9), torch.ones(2, 9, dtype=torch.long)
    mask[1, -2:] = 0
    with pytest.raises(UserError, match="needs left padding"), torch.no_grad():
        model(x, attention_mask=mask, use_cache=False)


def test_window_decay_refuses_right_padding_in_a_model():
    model = tiny_model("llama")
    linearize(model, [8, 8, 8], Attention(window=4, sink=0, decay="head"))
    x, mask = ids(batch=2, length=9), torch.ones(2, 9, dtype=torch.long)
    mask[1, -2:] = 0
    with pytest.raises(UserError, match="needs left padding"), torch.no_grad():
        model(x, attention_mask=mask, use_cache=False)


# --- short convolution on q, k, v ------------------------------------------------------------------------------

def set_convs(model, seed: int = 6) -> None:
    """Move every filter off the identity (its start), with weight on the tokens before, so a test sees the mixing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in attention_modules(model):
            for name in ("conv_q", "conv_k", "conv_v"):
                weight = getattr(module.dofattn.conv, name)
                weight.copy_(0.6 * torch.randn(weight.shape, generator=g))


@pytest.mark.parametrize("family", FAMILIES)
def test_conv_starts_as_no_conv(family):
    model, plain = tiny_model(family), tiny_model(family)
    linearize(model, [9, 16, 5], Attention(window=0, sink=0, conv=4), seed=1)
    linearize(plain, [9, 16, 5], Attention(window=0, sink=0), seed=1)
    layer = attention_modules(model)[0].dofattn
    assert layer.conv.conv_q.shape == (4, model.config.num_attention_heads, 16) and "conv=4" in repr(layer)
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
    linearize(model, [9, 16, 5], Attention(feature="hedgehog", window=window, sink=2 if "sink" in variant else 0,
              decay="gate" if variant == "gate" else "none", conv=3), seed=1)
    set_convs(model)
    if variant == "gate":
        set_gates(model)
    assert_40_steps_equal_the_full_forward(model, ids(batch=2, length=11, seed=1))


@pytest.mark.parametrize("family", FAMILIES)
def test_conv_left_padding_is_the_start_of_a_sequence(family, tokenizer):
    """A padding token's inputs count as zeros in the filters: a left-padded row generates as it does alone."""
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    linearize(model, [6, 6, 6], Attention(window=0, sink=0, conv=4), seed=3)
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
    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 12, 7], Attention(window=0, sink=0, decay="gate", conv=4), seed=2)
    set_convs(model)
    x = ids()
    with torch.no_grad():
        logits = model(x, use_cache=False).logits
    config = StudentSpec(base_model=str(model_dirs["llama"]), dims=[5, 12, 7], layers=[0, 1, 2], seed=2,
                         base=fingerprint(model), attention=Attention(feature="prf", window=0, sink=0, decay="gate",
                                                                      conv=4))
    folder = save_student(model, tmp_path / "s", config)
    loaded, _, config = load_student(folder)
    assert config.attention.conv == 4 and attention_modules(loaded)[1].dofattn.attention.conv == 4
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, logits)
    for width in (1, -2):
        with pytest.raises(UserError, match="a filter is at least 2 tokens wide"):
            linearize(tiny_model("llama"), [8, 8, 8], Attention(window=0, sink=0, conv=width))
    with pytest.raises(UserError, match="4 query heads do not share 3 kv heads evenly"):
        LinearAttention(Attention(window=0, sink=0, conv=4), make_feature_map("prf", 4, 16, 8, 0.25), num_kv_heads=3)
