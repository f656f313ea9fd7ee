"""Static greedy decoding (`dofattn.engine`): the same tokens as HF generate, for every family; clear refusals.

On CUDA the decoder replays a CUDA graph per token; on CPU it runs the same static step eagerly.
"""

import pytest
import torch

from dofattn.attention.hybrid import WindowForms
from dofattn.attention import LinearAttention
from dofattn.engine import StaticDecoder
from dofattn.errors import UserError
from dofattn.model.student import attention_modules, linearize
from dofattn.spec import Attention
from tests.conftest import tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 4, 16])       # 16: the 11-token prompt leaves the ring part empty
@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_same_tokens_as_hf_generate(family, window, device):
    model = tiny_model(family)
    linearize(model, [9, 16, 5], Attention(feature="prf", window=window, sink=0), seed=1)
    model.generation_config.eos_token_id = None
    model = model.to(device)
    prompt = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    decoder = StaticDecoder(model)
    assert decoder.graph == (device == "cuda")
    tokens = decoder.generate(prompt, 20)
    assert torch.equal(tokens, ref)
    timings = decoder.timings             # the prefill and the 19 decode steps, each timed itself
    assert timings["decode_steps"] == 19 and timings["prefill_s"] > 0 and timings["decode_s"] > 0
    if decoder.graph:                     # 1 token from the prefill, 2 eager warm-up steps, the rest replays
        assert timings["replays"] == 17 and 0 < timings["replay_s"] <= timings["decode_s"]
    else:
        assert "replays" not in timings
    assert decoder.cache.get_seq_length() == 11 + 19
    assert torch.equal(decoder.generate(prompt, 1), ref[:, :12])          # prefill only


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_prefill_keeps_only_the_last_logits(family):
    """The prompt's logits for every position would be [B, T, vocab]: at 32K tokens of SmolLM2, 3.2 GB in bf16, more
    than the state and the teacher's whole KV cache. The prefill asks for the last position's alone."""
    model = tiny_model(family)
    linearize(model, [9, 16, 5], Attention(feature="prf", window=0, sink=0), seed=1)
    shapes = []
    model.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.logits.shape)))
    prompt = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    StaticDecoder(model).generate(prompt, 3)
    assert shapes == [(2, 1, 300)] * 3          # the prefill, then two steps of one token


def assert_static_equals_hf(model, device: str) -> None:
    """20 greedy tokens after an 11-token prompt (batch 2): the static decoder's equal HF generate's."""
    model.generation_config.eos_token_id = None
    model = model.to(device)
    prompt = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(StaticDecoder(model).generate(prompt, 20), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature,decay,window", [("hedgehog", False, 0), ("prf", True, 0), ("hedgehog", True, 0),
                                                   ("prf", True, 4), ("prf", "gate", 0)])
def test_same_tokens_without_the_one_kernel_step(feature, decay, window, device):
    """Maps and decays that the one-kernel step does not take run the op's decode path (a window hybrid: the ring
    step, which decays its state in place; a gate: the recurrent op). On CUDA the state update is captured in
    place, so the replayed graph reads and writes the same buffer every token (what this checks there); on CPU the
    static step runs eagerly."""
    model = tiny_model("llama")
    gate = decay == "gate"
    linearize(model, [9, 16, 5], Attention(feature=feature, window=window, sink=0,
              decay="gate" if gate else "head" if bool(decay) else "none"), seed=1)
    if decay:      # strong decays, so that a step that skipped or doubled one would change the tokens
        with torch.no_grad():
            for module in attention_modules(model):
                module.dofattn.decay.decay_rate.copy_(torch.linspace(0.5, -4, module.dofattn.num_heads))
                if gate:   # and gates that differ from token to token
                    module.dofattn.decay.gate_weight.normal_(0, 3, generator=torch.Generator().manual_seed(4))
    assert_static_equals_hf(model, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 4])
def test_kept_softmax_layers_decode_on_static_slots(window, device):
    """Softmax layers kept beside linear ones (`student.keep_softmax`, here the first and the last) decode on
    buffers of T + max_new_tokens slots (`StaticKVLayer`): HF generate's tokens, the prompt's keys at the front
    and every step's in place; afterwards the modules are unbound, so HF generate reads its own cache again."""
    from dofattn.attention import StaticKVLayer

    model = tiny_model("llama")
    linearize(model, [9, 16, 5], Attention(feature="prf", window=window, sink=2 if window else 0), seed=1, layers=[1])
    model.generation_config.eos_token_id = None
    model = model.to(device)
    prompt = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    outputs = []           # the first kept layer's attention output, call by call: tokens alone would not show
    hook = attention_modules(model)[0].register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    hf_outputs, outputs[:] = outputs[:], []
    decoder = StaticDecoder(model)
    assert torch.equal(decoder.generate(prompt, 12), ref)
    hook.remove()
    if device == "cpu":    # on CUDA the captured step's calls are replays: no hook runs
        assert len(outputs) == len(hf_outputs) == 12
        for out, hf_out in zip(outputs, hf_outputs):
            torch.testing.assert_close(out, hf_out, rtol=1e-4, atol=1e-5)
    kept = [decoder.cache.layers[i] for i in (0, 2)]
    assert all(isinstance(layer, StaticKVLayer) and layer.keys.shape[2] == 23 for layer in kept)
    assert all(not hasattr(m, "dofattn_static_kv") for m in attention_modules(model))
    with torch.no_grad():
        again = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(again, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_a_teacher_decodes_on_static_slots(device):
    """A model with no linear layer (`softmax_only`, a teacher timed as its student is: `benchmarks/scale.py`), its
    attention through dofattn's: every layer on static slots, HF generate's tokens."""
    from dofattn.attention import StaticKVLayer
    from dofattn.model.install import install

    model = tiny_model("llama").to(device)
    model.generation_config.eos_token_id = None
    prompt = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    install(model)
    decoder = StaticDecoder(model, softmax_only=True)
    assert torch.equal(decoder.generate(prompt, 12), ref)
    assert all(isinstance(layer, StaticKVLayer) for layer in decoder.cache.layers)


@pytest.mark.parametrize("prompt_length", [3, 11])     # shorter than the window of 6, and longer
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "mistral"])
def test_a_models_own_sliding_window_layers_decode_on_a_ring(family, prompt_length):
    """A model's own sliding-window layers (every other layer of Gemma 2/3, every layer of Mistral) decode on a
    ring of the model's window (`StaticBoundedLayer.from_window`): each step's key in place, HF generate's tokens
    once the window has moved on (20 new tokens past a window of 6); and a teacher of that family on static slots."""
    from dofattn.model.bounded import StaticBoundedLayer
    from dofattn.model.hf import local_layers
    from dofattn.model.install import install
    from tests.test_families import WINDOW, student_layers, tiny

    model = tiny(family)
    layers = [1, 3] if family == "mistral" else student_layers(family)     # Mistral: half its local layers stay
    linearize(model, [9] * 4, Attention(feature="prf", window=4, sink=1), seed=1, layers=layers)
    local = [i for i in local_layers(model.config) if i not in layers]
    prompt = torch.randint(3, 300, (2, prompt_length), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    decoder = StaticDecoder(model)
    assert torch.equal(decoder.generate(prompt, 20), ref)
    rings = [decoder.cache.layers[i] for i in local]
    assert rings and all(isinstance(r, StaticBoundedLayer) and r.keys.shape[2] == WINDOW for r in rings)
    teacher = tiny(family)
    with torch.no_grad():
        ref = teacher.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    install(teacher)
    assert torch.equal(StaticDecoder(teacher, softmax_only=True).generate(prompt, 20), ref)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_a_student_linearizing_nothing_decodes_on_static_slots(family):
    """The default on a model with its own sliding-window layers linearizes nothing (every global layer bounded
    exact): static decoding takes it (bounded slots and the model's rings) and gives HF generate's tokens on a prompt
    past its bounds (sink 1 + window 4 + 3 chosen keys); a model whose every cache grows is still refused."""
    from dofattn.spec import Kept
    from tests.test_families import tiny

    model = tiny(family)
    linearize(model, [9] * 4, Attention(feature="prf", window=4, sink=1), kept=Kept(select=3), seed=1, layers=[])
    prompt = torch.randint(3, 300, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(StaticDecoder(model).generate(prompt, 12), ref)
    with pytest.raises(UserError, match="every layer of this model is softmax attention with a cache that grows"):
        StaticDecoder(tiny(family))


def test_rows_are_cut_after_their_first_eos():
    model = tiny_model("llama")
    linearize(model, [8, 8, 8], Attention(window=0, sink=0), seed=2)
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(2))
    tokens = StaticDecoder(model).generate(prompt, 12)
    eos = int(tokens[0, 9])                                                  # call the third new token EOS
    cut = StaticDecoder(model).generate(prompt, 12, eos_token_id=eos)
    first = int((tokens[0, 7:] == eos).nonzero()[0])
    assert torch.equal(cut[0, :7 + first + 1], tokens[0, :7 + first + 1])
    assert (cut[0, 7 + first:] == eos).all()


def test_refuses_what_it_cannot_keep_static():
    model = tiny_model("llama")
    with pytest.raises(UserError, match="every layer of this model is softmax attention"):
        StaticDecoder(model)
    model = tiny_model("llama")
    linearize(model, [8, 8, 8], Attention(window=0, sink=0))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA graphs need the model on a CUDA device"):
            StaticDecoder(model, graph=True)


@pytest.mark.parametrize("ids, max_new, message", [
    ([[1, 2, 3]], 4, "input_ids must be a tensor of token ids"),
    (torch.zeros(0, 3, dtype=torch.long), 4, "at least one token, got shape \\[0, 3\\]"),
    (torch.zeros(3, dtype=torch.long), 4, "input_ids must be \\[batch, length\\]"),
    (torch.zeros(1, 3), 4, "integer token ids, got torch.float32"),
    (torch.tensor([[1, 300]]), 4, "must lie in \\[0, 300\\)"),
    (torch.tensor([[-1, 2]]), 4, "must lie in"),
    (torch.zeros(1, 3, dtype=torch.long), 0, "max_new_tokens must be a whole number of at least 1, got 0"),
    (torch.zeros(1, 3, dtype=torch.long), 2.5, "max_new_tokens must be a whole number of at least 1, got 2.5"),
    (torch.zeros(1, 3, dtype=torch.long), float("nan"), "max_new_tokens must be a whole number"),
])
def test_generate_checks_its_arguments(ids, max_new, message):
    model = tiny_model("llama")
    linearize(model, [8, 8, 8], Attention(window=0, sink=0))
    with pytest.raises(UserError, match=message):
        StaticDecoder(model).generate(ids, max_new)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 4])
def test_same_tokens_with_a_conv(window, device):
    """A short convolution's last K-1 inputs ride in the cache beside the state (and the ring): on CUDA they are
    captured in place like the state, so every replay reads the previous token's inputs."""
    model = tiny_model("gpt_neox")
    linearize(model, [9, 16, 5], Attention(feature="prf", window=window, sink=0, conv=3), seed=1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for module in attention_modules(model):
            for name in ("conv_q", "conv_k", "conv_v"):
                getattr(module.dofattn.conv, name).normal_(0, 0.6, generator=g)
    assert_static_equals_hf(model, device)



@pytest.mark.parametrize("device", DEVICES)
def test_ring_kernel_gives_the_eager_tokens(device, monkeypatch):
    """A window + sink student's static decoding with the one-kernel ring step (`ops.triton.window.prf_ring_step`; on CPU
    asked for by name, in Triton's interpreter: slow, so few tokens) gives the tokens of the PyTorch ring step, after
    the ring has wrapped. GQA: 4 query heads on 2 kv heads, batch 2."""
    pytest.importorskip("triton", reason="needs the triton package")
    from dofattn.ops import load_triton

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("Triton's interpreter runs only without a GPU (tests/conftest.py); the CUDA case runs the kernel")
    model = tiny_model("llama")
    linearize(model, [9, 16, 5], Attention(feature="prf", window=4, sink=2), seed=1)
    with torch.no_grad():
        for module in attention_modules(model):
            module.dofattn.window.log_gain.normal_(0, 1, generator=torch.Generator().manual_seed(3))
    model = model.to(device)
    prompt = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    with monkeypatch.context() as patch:         # the PyTorch ring step, on any device
        patch.setattr(WindowForms, "one_kernel_ring", lambda layer, q, cache, backend: False)
        decoder = StaticDecoder(model)
        ref = decoder.generate(prompt, 6)
        ref_cache = decoder.cache
    hybrid, calls = load_triton()[0].window, []
    step = hybrid.prf_ring_step
    monkeypatch.setattr(hybrid, "prf_ring_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    if device == "cpu":
        ring_step = WindowForms.ring_step
        monkeypatch.setattr(WindowForms, "ring_step", lambda layer, q, k, v, cache, backend="auto":
                            ring_step(layer, q, k, v, cache, "triton"))
    decoder = StaticDecoder(model)
    assert torch.equal(decoder.generate(prompt, 6), ref)
    assert len(calls) == 3 * (5 if device == "cpu" else 3)       # CUDA: 2 warm-up steps and the capture
    for ref_layer, layer in zip(ref_cache.layers, decoder.cache.layers):   # what the tokens may not show
        torch.testing.assert_close(layer.state, ref_layer.state, rtol=1e-4, atol=1e-5)
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(layer.parts["window"], name), getattr(ref_layer.parts["window"], name),
                                       rtol=1e-4, atol=1e-5)
        assert torch.equal(layer.parts["window"].valid, ref_layer.parts["window"].valid)


@pytest.mark.parametrize("gate", [False, True])
def test_a_static_step_takes_no_mask(gate):
    """A static decode step's token is a generated one, so the layer drops its mask: while a CUDA graph is captured
    HF builds the mask as a tensor, and a decay's padding check on it would sync and break the capture (seen on an
    H200). A mask that says padding changes nothing; the growing cache's step still refuses padding after a real
    token."""
    from dofattn.attention import LinearAttention, LinearStateLayer, StaticStateLayer
    from dofattn.features import make_feature_map

    torch.manual_seed(0)
    layer = LinearAttention(Attention(window=0, sink=0, decay="gate" if gate else "head" if True else "none"),
                            make_feature_map("hedgehog", 2, 8, 6, scaling=8 ** -0.5))
    q, k, v = (torch.randn(1, 6, 2, 8) for _ in range(3))
    outs = []
    with torch.no_grad():
        for mask in (None, torch.zeros(1, 1, dtype=torch.bool)):
            cache = LinearStateLayer()
            layer(q[:, :5], k[:, :5], v[:, :5], cache=cache)
            outs.append(layer(q[:, 5:], k[:, 5:], v[:, 5:], mask, cache=StaticStateLayer.freeze(cache)))
        assert torch.equal(outs[0], outs[1])
        with pytest.raises(UserError, match="cannot continue its state through padding"):
            layer(q[:, 5:], k[:, 5:], v[:, 5:], torch.zeros(1, 1, dtype=torch.bool), cache=cache)


@pytest.mark.parametrize("feature,decay,window,sink,layers", [("prf", False, 0, 0, None), ("prf", False, 4, 2, None),
                                                              ("hedgehog", True, 0, 0, None), ("prf", False, 4, 2, [1])])
def test_compiled_step_gives_the_eager_tokens(feature, decay, window, sink, layers):
    """compile=True (`torch.compile` of the step, for the CPU): the tokens of the eager static step, for a pure
    linear student, a window + sink one (after its ring has wrapped), one with a decay and one with two softmax
    layers kept, with a different feature count per layer. The first call compiles once (its first step timed apart), and a second call of the same shape
    not again: no host state may change per token."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    linearize(model, [9, 16, 5], Attention(feature=feature, window=window, sink=sink,
              decay="head" if decay else "none"), seed=1, layers=layers)
    model.eval()
    model.generation_config.eos_token_id = None
    prompt = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    ref = StaticDecoder(model).generate(prompt, 12)
    graphs = counters["stats"]["unique_graphs"]
    decoder = StaticDecoder(model, compile=True)
    assert not decoder.graph
    assert torch.equal(decoder.generate(prompt, 12), ref)
    assert decoder.timings["compile_s"] > 0 and decoder.timings["decode_steps"] == 10
    assert torch.equal(decoder.generate(prompt, 12), ref)
    assert "compile_s" not in decoder.timings and decoder.timings["decode_steps"] == 11
    assert counters["stats"]["unique_graphs"] == graphs + 1 and decoder.cache.get_seq_length() == 11 + 11
    with pytest.raises(UserError, match="compile and graph do not combine"):
        StaticDecoder(model, graph=True, compile=True)
