"""The model families dofattn linearizes, each as a tiny random-weight model of its own config class: with nothing
swapped its logits are stock transformers'; linearized (window + sink hybrids), `generate` gives what the full
forward predicts, left-padded rows what they give alone, and a saved student loads back to the same logits.

Each family's attention has its own twist, and each config sets it where a tiny model allows: grouped-query heads
everywhere but GPT-2 and GPT-NeoX, q/k/v biases (Qwen2), q/k norms (Qwen3, OLMo-2, Gemma 3), fused projections (Phi-3,
GPT-2, GPT-NeoX), partial rotary embeddings (GPT-NeoX), no rotary embedding (GPT-2), a softmax scale of its own
(Gemma's query_pre_attn_scalar), soft-capped attention and final logits (Gemma 2), and a model's own sliding-window
layers (Gemma 2 and 3: every other layer; Mistral: every layer), which stay exact by default.
"""

import pytest
import json

import torch
import transformers as tf
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from dofattn.model.hf import causal_lm_class
from dofattn.spec import Attention
from dofattn.attention import LinearStateLayer
from dofattn.errors import UserError
from dofattn.model.hf import SUPPORTED, check_supported, local_layers
from dofattn.model.lora import add_lora
from dofattn.spec import StudentSpec
from dofattn.model.student import build, fingerprint, global_layers, load_student, save_student
from tests.test_attention import assert_batched_as_alone

VOCAB, LAYERS, WINDOW = 300, 4, 6    # sliding windows of WINDOW tokens, shorter than the prompts
ATTENTION = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                 eos_token_id=0, pad_token_id=0)
ALTERNATE = ["sliding_attention", "full_attention"] * (LAYERS // 2)

FAMILIES = {
    "llama": lambda: tf.LlamaConfig(**ATTENTION, tie_word_embeddings=True),
    "mistral": lambda: tf.MistralConfig(**ATTENTION, sliding_window=WINDOW),
    "qwen2": lambda: tf.Qwen2Config(**ATTENTION),
    "qwen3": lambda: tf.Qwen3Config(**ATTENTION, head_dim=16),
    "gemma2": lambda: tf.Gemma2Config(**ATTENTION, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                      attn_logit_softcapping=5.0, final_logit_softcapping=30.0, layer_types=ALTERNATE),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**ATTENTION, head_dim=16, sliding_window=WINDOW,
                                               query_pre_attn_scalar=24, layer_types=ALTERNATE),
    "phi3": lambda: tf.Phi3Config(**ATTENTION),
    "olmo2": lambda: tf.Olmo2Config(**ATTENTION),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=256,
                                  bos_token_id=0, eos_token_id=0),
    "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=256,
                                         bos_token_id=0, eos_token_id=0,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.25}),
}
LOCAL = {"mistral": [0, 1, 2, 3], "gemma2": [0, 2], "gemma3_text": [0, 2]}   # the rest have none


def tiny(family: str, seed: int = 0):
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    model = causal_lm_class(config)._from_config(config).eval()      # the class dofattn makes a model with
    if family == "qwen2":   # q/k/v biases start at 0: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.generation_config.eos_token_id = None     # random weights: generate every token asked for
    return model


def student_layers(family: str) -> list[int]:
    """The layers each test linearizes: the default (every global layer), or for Mistral, whose layers are all
    local, every layer."""
    return list(range(LAYERS)) if family == "mistral" else global_layers(tiny(family))


def make_student(family: str, window: int = 4, seed: int = 0):
    """A tiny student with moved features (so a wrong load cannot pass), and its spec."""
    model = tiny(family, seed)
    spec = StudentSpec(base_model="tiny", dims=[12] * LAYERS, layers=student_layers(family), seed=1,
                       base=fingerprint(model), attention=Attention(feature="prf", window=window,
                                                                    sink=1 if window else 0))
    build(model, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".dofattn." in name:
                p.add_(0.1 * torch.randn_like(p))
    return model, spec


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_every_family_is_here():
    assert sorted(FAMILIES) == sorted(SUPPORTED)


@pytest.mark.parametrize("family", FAMILIES)
def test_local_layers_are_the_models_sliding_window_layers(family):
    model = tiny(family)
    assert local_layers(model.config) == LOCAL.get(family, [])
    if family == "mistral":
        with pytest.raises(UserError, match="every attention layer .* sliding-window attention over 6 tokens"):
            global_layers(model)
    else:
        assert global_layers(model) == [i for i in range(LAYERS) if i not in LOCAL.get(family, [])]


@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_swapped_gives_stock_logits(family):
    """dofattn's attention implementation with no layer linearized: the stock model's logits, to the bit, on a
    left-padded batch (Gemma 2's soft-capped softmax layers run on eager attention, as stock)."""
    stock, ours = tiny(family), tiny(family)
    x = ids(2, 14)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    with torch.no_grad():
        expected = stock(input_ids=x, attention_mask=mask).logits
        build(ours, StudentSpec(base_model="tiny", dims=[12] * LAYERS, layers=[], base=fingerprint(ours),
              attention=Attention(feature="prf", window=0, sink=0)))
        assert ours.config._attn_implementation.startswith("dofattn")
        torch.testing.assert_close(ours(input_ids=x, attention_mask=mask).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("window", [4, 0], ids=["hybrid", "linear"])
@pytest.mark.parametrize("family", FAMILIES)
def test_linearized_generate_is_the_full_forward(family, window):
    """Greedy generation continues from the linear layers' states (and the kept layers' KV caches, sliding ones
    included) to the logits the full forward gives the whole sequence."""
    model, spec = make_student(family, window)
    prompt, new = ids(2, 13, seed=1), 7
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model.generate(prompt, max_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, cache=cache)
        full = model(input_ids=out.sequences).logits[:, prompt.shape[1] - 1:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=1e-4)
    assert torch.equal(out.sequences[:, prompt.shape[1]:], full.argmax(-1))
    for i, layer in enumerate(cache.layers):
        if i in spec.layers:
            assert isinstance(layer, LinearStateLayer)
        elif i in LOCAL.get(family, []):
            assert isinstance(layer, DynamicSlidingWindowLayer)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_rows_generate_what_they_generate_alone(family):
    model, _ = make_student(family)
    assert_batched_as_alone(model, new_tokens=5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_student_loads_to_the_same_logits(family, tmp_path, tokenizer):
    model, spec = make_student(family)
    base = tmp_path / "base"
    tiny(family).save_pretrained(base)
    tokenizer.save_pretrained(base)
    spec = StudentSpec(**{**spec.__dict__, "base_model": str(base)})
    save_student(model, tmp_path / "student", spec)
    loaded, _, again = load_student(tmp_path / "student")
    assert again == spec and type(loaded) is type(model)
    x = ids(2, 11, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_finds_every_familys_projections(family):
    """Attention LoRA adapts 2 (fused q/k/v) or 4 projections per layer, and starts as a no-op."""
    model, _ = make_student(family)
    x = ids(1, 9)
    with torch.no_grad():
        before = model(input_ids=x).logits
    add_lora(model, rank=2)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    fused = family in ("phi3", "gpt2", "gpt_neox")
    assert len(adapted) == LAYERS * (2 if fused else 4)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, before, rtol=0, atol=0)


def full_forward_qkv(model, blocks: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The naive reference of `TeacherStream`: q/k/v of `layer` captured from the teacher's full forward."""
    from dofattn.model.capture import capture, run_forward
    from dofattn.evaluate import teacher_mode

    got = []
    with teacher_mode(model), capture(model, lambda a: got.append(a) if a.layer == layer else None, layers=[layer]):
        run_forward(model, blocks)
    a = got[0]
    return a.query.float(), a.key.float(), a.value.float()


def test_the_teacher_stream_gives_the_full_forwards_qkv(family):
    """The layerwise stage's q/k/v, made layer by layer from the blocks' hidden states (odd batch split, layers
    skipped), equal those captured from the teacher's full forward, in every family (its own masks, RoPE, norms)."""
    from dofattn.distill.teacher import TeacherStream

    model = tiny(family)
    blocks = torch.randint(1, VOCAB, (5, 37), generator=torch.Generator().manual_seed(0))
    got = dict(TeacherStream(model, blocks, batch_size=2, progress=False).walk([3, 0, 1]))
    assert sorted(got) == [0, 1, 3]
    for layer, acts in got.items():
        for mine, reference in zip(acts, full_forward_qkv(model, blocks, layer)):
            assert mine.dtype == torch.float32 and mine.shape == reference.shape
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


def test_an_unsupported_family_is_one_line_naming_the_supported_ones():
    config = tf.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(UserError) as err:
        check_supported(config, "my-bert")
    message = str(err.value)
    assert "\n" not in message and "'bert' model" in message
    for name, known_as in SUPPORTED.items():
        assert name in message and known_as in message


@pytest.mark.parametrize("local", ["keep", "linearize"])
def test_distill_keeps_a_models_own_sliding_window_layers_exact(capsys, tmp_path, tokenizer, corpus, local):
    """`dofattn distill` on Gemma 2: its local layers (0 and 2) stay exact unless student.local_layers = linearize,
    and keep_softmax = 1 keeps the layer of the largest attention DoF among the others."""
    import json

    from dofattn.cli import main
    from tests.test_distill import distill_argv

    base = tmp_path / "gemma2"
    tiny("gemma2").save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "run"
    assert main(distill_argv(base, corpus, out, "layerwise.steps=2", "student.keep_softmax=1",
                             f"student.local_layers={local}")) == 0, capsys.readouterr().err
    candidates = [1, 3] if local == "keep" else [0, 1, 2, 3]
    score = json.loads((out / "attention_dof.json").read_text())["layers"]
    best = max(candidates, key=lambda i: (score[i], -i))
    student, _, spec = load_student(out)
    assert list(spec.layers) == [i for i in candidates if i != best]
    assert spec.softmax_layers == sorted({0, 1, 2, 3} - set(candidates) | {best})
    with torch.no_grad():
        assert student.generate(ids(1, 9), max_new_tokens=3, do_sample=False).shape == (1, 12)


def test_the_default_on_a_model_with_sliding_window_layers_linearizes_nothing(capsys, tmp_path, tokenizer, corpus):
    """Issue 68, item 2: `long-context` on Gemma 3 keeps its own sliding-window layers and every global layer exact,
    bounded after the prompt; nothing is estimated or trained. The student generates what the teacher does while
    the context fits its bounds, and after a prompt past them holds a cache that no longer grows."""
    from dofattn.attention.cache import cache_bytes, cache_kwargs
    from dofattn.cli import main
    from transformers import DynamicCache

    base = tmp_path / "gemma3"
    teacher = tiny("gemma3_text")
    teacher.save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "run"
    argv = ["distill", "--model", str(base), "--data", str(corpus), "--out", str(out), "--device", "cpu",
            "--set", "eval.blocks=2", "--set", "eval.seq_len=64", "--set", "student.select=8"]
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "nothing linearized" in printed and "dof" not in json.loads((out / "log.json").read_text())["seconds"]
    student, _, spec = load_student(out)
    assert list(spec.layers) == [] and spec.softmax_layers == [0, 1, 2, 3]
    assert spec.describe()[0].startswith("0 of 4") and not any("decay" in line for line in spec.describe())
    with torch.no_grad():
        prompt = ids(1, 9)
        assert torch.equal(student.generate(prompt, max_new_tokens=4, do_sample=False),
                           teacher.generate(prompt, max_new_tokens=4, do_sample=False))
        sizes = []
        for length in (120, 240):
            cache = DynamicCache(config=student.config)
            student(input_ids=ids(1, length), use_cache=True, **cache_kwargs(student, cache))
            sizes.append(cache_bytes(cache))
        assert sizes[0] == sizes[1]
