"""`dofattn distill --dry-run`: the plan of a run from the model's config alone, and its memory against measured
end-to-end steps of small students.

The configs of Qwen2.5-1.5B and Llama-3.1-8B in tests/configs are the public ones (no weights beside them): a plan
that tried to read weights, a tokenizer or text would fail on them.
"""

import contextlib
import json
from pathlib import Path

import pytest
import torch

from dofattn.model import hf
from dofattn import recipe as recipes
from dofattn.cli import main
from dofattn.distill.choose import linear_layers
from dofattn.distill.end_to_end import layers_checkpointed, loss
from dofattn.distill.plan import make_plan
from dofattn.distill.teacher import TeacherStream
from dofattn.errors import UserError
from dofattn.memory import LiveBytes
from dofattn.model.student import build, is_student_tensor
from tests import test_families as families
from tests.conftest import tiny_model

CONFIGS = Path(__file__).parent / "configs"
# public figures: parameters, layers, what the layerwise stage holds with the window recipe (64 blocks x 256 tokens:
# their float32 hidden states, and one layer's float32 q/k/v of H + 2 Hkv heads of 128)
PUBLIC = {"qwen2.5-1.5b": ("qwen2", 1_543_714_304, 28, 64 * 256 * (1536 + (12 + 2 * 2) * 128) * 4),
          "llama-3.1-8b": ("llama", 8_030_261_248, 32, 64 * 256 * (4096 + (32 + 2 * 8) * 128) * 4)}


def dry_run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["distill", "--dry-run", "--recipe", "window", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_dry_run_plans_a_public_config_without_weights_and_writes_nothing(capsys, tmp_path, monkeypatch, name):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    family, params, layers, cache = PUBLIC[name]
    out = tmp_path / "run"
    code, text, err = dry_run(capsys, "--model", str(CONFIGS / name), "--out", str(out))
    assert code == 0, err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert f"({family}, {params / 1e9:.2f} B parameters)" in text         # 1.54 B, 8.03 B
    assert f"linearized    {layers}: 0-{layers - 1}" in text
    assert "budget" in text and "mean 128 per layer" in text                # DoF dims exist only at run time
    assert f"layerwise       {cache / 2 ** 20:.2f} MiB in memory" in text and "nothing on disk" in text
    for row in ("frozen weights", "Adam moments", "activations", "loss (logits)", "total"):
        assert row in text, row


def test_dry_run_json_shards_qwen_over_8_devices(capsys, monkeypatch):
    """At 8 devices FSDP2 holds an eighth of every weight (Qwen2.5-1.5B's dims all divide by 8: exactly 1/8 of its
    float32 weights) and gathers the root's (the tied embedding, the final norm) and two decoder layers' whole,
    student tensors included: counted here from the public config by hand. Each process runs its own blocks: its
    activations and loss are one process's."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    code, text, err = dry_run(capsys, "--model", str(CONFIGS / "qwen2.5-1.5b"), "--json")
    assert code == 0, err
    plan = json.loads(text)
    params = PUBLIC["qwen2.5-1.5b"][1]
    memory = plan["memory"]
    assert plan["parameters"] == params and memory["world_size"] == 8
    assert memory["weights"] == params * 4 // 8 and memory["whole_model"] == params * 4
    h, inter, vocab, kv = 1536, 8960, 151936, 2 * 128
    layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * inter + 2 * h    # q, k, v (biases), o, MLP, 2 norms
    root = vocab * h + h                                                        # tied embedding, final norm
    assert 28 * layer + root == params
    student_layer = plan["student_parameters"] // 28
    assert memory["gathered"] == 4 * (root + 2 * (layer + student_layer))
    assert plan["student_parameters"] * 4 / 8 <= memory["gradients"] < plan["student_parameters"] * 4 / 4
    one = make_plan(recipes.load("window", [], {"run.model": str(CONFIGS / "qwen2.5-1.5b")}), 1).memory
    assert (memory["activations"], memory["loss"], memory["recompute"]) == (one.activations, one.loss,
                                                                            one.recompute) != (0, 0, 0)
    assert one.weights == params * 4 and one.gathered == 0
    assert plan["tokens"]["end_to_end"] == 30 * 1 * 8 * 512                # steps x batch x processes x tokens


def test_dry_run_shows_given_dims_and_refuses_bad_input_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    qwen = str(CONFIGS / "qwen2.5-1.5b")
    code, text, _ = dry_run(capsys, "--model", qwen, "--set", "student.dims='fix:96'", "--set", "end_to_end.steps=0")
    assert code == 0 and "96 in every layer (fix:96)" in text
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    for argv, says in [(["--model", str(bert)], "supported"), (["--model", str(tmp_path / "none")], "does not exist"),
                       (["--model", qwen, "--world-size", "0"], "--world-size 0")]:
        code, _, err = dry_run(capsys, *argv)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("WORLD_SIZE", "two")
    code, _, err = dry_run(capsys, "--model", qwen)
    assert code == 2 and "WORLD_SIZE" in err
    code, _, err = (main(["distill", "--json"]), *capsys.readouterr())
    assert code == 2 and "--dry-run" in err


def test_model_config_finds_and_refuses_models_as_load_model_does(tmp_path):
    """`hf.model_config` (the plan's) and `hf.load_model` (a run's) resolve a model the same way: the same one-line
    refusals, word for word."""
    bert, empty, text = tmp_path / "bert", tmp_path / "empty", tmp_path / "model.txt"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    empty.mkdir()
    text.write_text("not a model")
    for spec, says in [(bert, "does not support"), (empty, "has no config.json"), (text, "is not a .gguf file"),
                       (tmp_path / "none", "does not exist")]:
        with pytest.raises(UserError) as planned:
            hf.model_config(str(spec))
        with pytest.raises(UserError) as loaded:
            hf.load_model(str(spec))
        assert str(planned.value) == str(loaded.value) and says in str(planned.value)
    assert hf.model_config(str(CONFIGS / "llama-3.1-8b")).num_hidden_layers == 32


def test_linear_layers_are_the_candidates_less_the_softmax_layers_kept():
    """`distill.choose.linear_layers`, the one rule of a run and of its plan: Gemma 2 keeps its own sliding-window layers
    (0 and 2) exact by default; the softmax layers chosen come off the rest, the plan's the last of them."""
    gemma = families.tiny("gemma2")
    keep_one = recipes.load("window", ["student.keep_softmax=1"])
    assert linear_layers(keep_one, gemma, []) == [1, 3]                   # the candidates
    assert linear_layers(keep_one, gemma, [1]) == [3]                      # a run's choice
    assert linear_layers(keep_one, gemma) == [1]                           # the plan's
    everything = recipes.load("window", ["student.local_layers='linearize'", "student.keep_softmax=2"])
    assert linear_layers(everything, gemma) == [0, 1]
    with pytest.raises(UserError, match="student.keep_softmax = 2 leaves no layer to linearize"):
        linear_layers(recipes.load("window", ["student.keep_softmax=2"]), gemma)
    share = recipes.load("window", ["student.keep_softmax=0.4"])          # of the 2 global layers: 1 (0.8, rounded)
    assert linear_layers(share, gemma) == [1] and linear_layers(share, families.tiny("llama")) == [0, 1]   # 1 of 3
    assert linear_layers(recipes.load("window", ["student.keep_softmax=0.9"]), gemma) == [1]      # all but one
    bounded = recipes.load("window", ["student.keep_softmax=0.4", "student.select=16"])   # kept layers bounded:
    assert linear_layers(bounded, gemma) == [] and linear_layers(bounded, families.tiny("llama")) == [0, 1]  # all
    assert linear_layers(recipes.load("window", ["student.keep_softmax=2", "student.select=16"]), gemma) == []


def test_the_default_recipe_plans_a_model_with_its_own_sliding_window_layers():
    """Issue 68: long-context kept 12 layers and refused a model with fewer global ones (Gemma 3 270M: 3 of 18). On
    such a model its share keeps every global layer, bounded after the prompt, and linearizes nothing (measured: a
    linear global layer lost RULER's needle); the plan has no DoF sample, no choice, nothing to train, and says why.
    A count keeps that many and linearizes the rest, as before."""
    for family in ("gemma3_text", "gemma2"):
        model = families.tiny(family)
        plan = make_plan(recipes.load("long-context"), 1, config=model.config, device="cpu", timed=False)
        assert plan.layers.local == [0, 2] and plan.layers.linear == [] and plan.layers.keep_softmax == 2
        assert plan.student_parameters == 0 and plan.tokens.dof_sample == plan.tokens.softmax_choice == 0
        assert plan.tokens.layerwise_teacher == plan.tokens.end_to_end == 0 and plan.tokens.eval > 0
        assert any("nothing is linearized" in note and "student.keep_softmax=1" in note for note in plan.notes)
        assert "linearized    0: none" in plan.table() and "nothing is linearized" in plan.table()
        one = make_plan(recipes.load("long-context", ["student.keep_softmax=1"]), 1, config=model.config,
                        device="cpu", timed=False)
        assert one.layers.linear == [1] and one.layers.keep_softmax == 1 and one.student_parameters > 0


def test_a_share_of_the_layers_kept_rounds_and_leaves_one_to_linearize():
    from dofattn.distill.choose import kept_count

    assert kept_count(0.4, 30) == 12 and kept_count(0.4, 3) == 1 and kept_count(0.4, 13) == 5   # SmolLM2, Gemma 3, 2
    assert kept_count(0.01, 30) == 1 and kept_count(0.99, 30) == 29 and kept_count(0.5, 1) == 0
    assert kept_count(12, 30) == 12 and kept_count(0, 30) == 0
    assert kept_count(0.4, 3, every=True) == 3 and kept_count(1, 3, every=True) == 1     # a share: all; a count: it
    assert kept_count(0, 3, every=True) == 0


def measure(model, recipe, ids) -> dict:
    """One end-to-end step of `model` (a student) on `ids` as `end_to_end.train` takes it, measured with
    `LiveBytes`: what the body leaves alive (`body`), the most alive over the loss and its backward pass (`forward
    and backward`, gradients made on the way included) and over the whole step with Adam's (`peak`)."""
    e2e = recipe.end_to_end
    for name, p in model.named_parameters():
        p.requires_grad_(is_student_tensor(name))
    for linear in (m for m in model.modules() if type(m).__name__ == "LinearAttention"):
        linear.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    existing = [*model.parameters(), *model.buffers(), ids]
    checkpointed = layers_checkpointed if e2e.activation_checkpointing else lambda model: contextlib.nullcontext()
    body = LiveBytes(existing)
    with checkpointed(model), body:
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
    kept = body.now
    del hidden
    optimizer = torch.optim.Adam(trained, lr=1e-3)
    step = LiveBytes(existing)
    with checkpointed(model), step:
        loss(model, ids, e2e.kd_weight, e2e.loss_chunk).backward()
        forward_backward = step.peak
        optimizer.step()
    return {"body": kept, "forward and backward": forward_backward, "peak": step.peak, "after": step.now,
            "gradients": sum(p.grad.nbytes for p in trained),
            "adam": sum(t.nbytes for state in optimizer.state.values() for t in state.values())}


# case -> (family, the recipe keys beside the common ones). Llama keeps its last layer softmax (SDPA); once more with
# checkpointed layers and the logits in chunks, once in bfloat16 with LoRA on every projection. Gemma 2 and 3 keep
# their own sliding-window layers exact (eager with soft-capped logits; SDPA with a mask), Gemma 3 norms q and k;
# GPT-2 fuses q, k and v and writes its GELU out in PyTorch ops.
CASES = {"llama": ("llama", ["student.keep_softmax=1"]),
         "llama-checkpointed": ("llama", ["student.keep_softmax=1", "end_to_end.activation_checkpointing=true",
                                          "end_to_end.loss_chunk=32"]),
         "llama-lora-bfloat16": ("llama", ["student.keep_softmax=1", "student.lora_rank=4",
                                           "student.lora_targets='all'", "run.dtype='bfloat16'"]),
         "gemma2": ("gemma2", []),
         "gemma3_text": ("gemma3_text", []),
         "gpt2": ("gpt2", [])}


@pytest.mark.parametrize("case", sorted(CASES))
def test_memory_plan_matches_one_measured_end_to_end_step(case):
    """The plan of a small student (a tiny model, its linearized layers with PRF features beside a window and a
    sink, 2 blocks of 128 tokens, the KL term on, logits unchunked but in one case) against one real end-to-end
    step of it on the CPU, built as a run builds it (`Recipe.student_spec`): loss, backward pass, Adam's step.

    - Weights, student tensors, gradients and Adam's state: counted exactly, so equal.
    - The body's activations (what it leaves alive, checkpointed or not): the plan measures them on fake tensors,
      here they are real; the same kernels, so within 1%.
    - The loss and its backward pass: their peak lies between the plan's activations + max(loss, layers'
      backward) and that with every gradient made (the plan counts the gradients apart), within 1%.
    - The whole step's peak against the plan's total less the weights and student tensors (there before): within
      3%. The plan counts Adam's moments alive throughout, as from the second step on.
    """
    family, sets = CASES[case]
    model = tiny_model("llama") if family == "llama" else families.tiny(family)
    B, T = 2, 128
    recipe = recipes.load("window", [f"end_to_end.batch_size={B}", f"end_to_end.seq_len={T}", "student.window=4",
                                      "student.sink=1", "student.dims='fix:8'", "end_to_end.loss_chunk=0", *sets])
    model = model.to(getattr(torch, recipe.run.dtype))
    plan = make_plan(recipe, 1, config=model.config)
    memory = plan.memory
    count = model.config.num_hidden_layers
    assert plan.layers.linear == ([0, 1] if family == "llama" else [1, 3] if family.startswith("gemma") else
                                  [0, 1, 2, 3])
    build(model, recipe.student_spec([8] * count, plan.layers.linear))
    base = [p for n, p in model.named_parameters() if not is_student_tensor(n)]
    tensors = [t for n, t in model.state_dict().items() if is_student_tensor(n)]
    assert memory.weights == sum(p.nbytes for p in base)
    assert memory.student == sum(t.nbytes for t in tensors)
    assert plan.student_parameters == sum(p.numel() for n, p in model.named_parameters() if is_student_tensor(n))

    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    measured = measure(model, recipe, ids)
    print(f"{case}: plan {memory}, measured {measured}")
    assert memory.gradients == measured["gradients"] and memory.adam == measured["adam"]
    assert measured["after"] == memory.gradients + memory.adam                # all else freed after the step
    assert abs(memory.activations / measured["body"] - 1) < 0.01, (memory.activations, measured["body"])
    body_and_loss = memory.activations + max(memory.loss, memory.recompute)
    assert 0.99 * body_and_loss <= measured["forward and backward"] <= 1.01 * (body_and_loss + memory.gradients)
    planned = memory.total - memory.weights - memory.student                 # what the step itself adds
    assert abs(planned / measured["peak"] - 1) < 0.03, (planned, measured["peak"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_step_counts_its_flops_as_torchs_flop_counter_does(case):
    """`memory.Flops`, counted in the step whose memory the plan takes (one fake step, not two), gives
    FlopCounterMode's total exactly: the same registry over the same operators, checkpoint replays included."""
    from dofattn.distill.costs import meta_model
    from dofattn.distill.plan import measure_step

    family, sets = CASES[case]
    config = (tiny_model("llama") if family == "llama" else families.tiny(family)).config
    recipe = recipes.load("window", ["end_to_end.batch_size=2", "end_to_end.seq_len=128", "student.window=4",
                                      "student.sink=1", "student.dims='fix:8'", *sets])
    linear = make_plan(recipe, 1, config=config).layers.linear

    def step(reference: bool):
        student = meta_model(config, getattr(torch, recipe.run.dtype))
        with torch.device("meta"):
            build(student, recipe.student_spec([8] * config.num_hidden_layers, linear))
        return measure_step(recipe, student, reference_flops=reference)

    ours, reference = step(False), step(True)
    assert ours.flops == reference.flops > 0, (ours.flops, reference.flops)


def test_the_layerwise_stream_holds_what_is_planned(tokenizer):
    """The plan's layerwise bytes against the tensors `TeacherStream` holds for the same blocks and tokens."""
    model = tiny_model("llama")
    recipe = recipes.load("window", ["layerwise.blocks=3", "layerwise.seq_len=16"])
    plan = make_plan(recipe, 1, config=model.config)
    blocks = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    stream = TeacherStream(model, blocks, batch_size=2, progress=False)
    held = [stream.hidden.nbytes + q.untyped_storage().nbytes() for _, (q, k, v) in stream.walk([0, 2])]
    assert held == [plan.layerwise] * 2 and plan.layerwise > 0


def test_the_peak_at_a_real_vocabulary_is_the_one_planned():
    """Where the logits dominate, as at a real vocabulary (SmolLM2-135M's 49 152 tokens; 2 layers 128 wide, with a
    64-token window and a sink; 2 blocks of 128 tokens, logits in chunks of 64, the KL term on), the step's
    peak is the plan's within 3%, once with checkpointed layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=512)
    for sets in ([], ["end_to_end.activation_checkpointing=true"]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        recipe = recipes.load("window", ["student.dims='fix:32'", "end_to_end.batch_size=2",
                                          "end_to_end.seq_len=128", "end_to_end.loss_chunk=64", *sets])
        memory = make_plan(recipe, 1, config=config).memory
        build(model, recipe.student_spec([32] * 2, [0, 1]))
        ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
        measured = measure(model, recipe, ids)
        planned = memory.total - memory.weights - memory.student
        print(f"{sets}: plan {planned}, measured {measured['peak']}")
        assert memory.loss > memory.activations                              # the logits dominate
        assert abs(planned / measured["peak"] - 1) < 0.03, (planned, measured["peak"])


def test_dry_run_checks_the_data_and_the_tokenizer_as_the_run_would(capsys, tmp_path, model_dirs):
    """A missing or empty data file, a misspelt built-in source, a model folder whose weights have no tokenizer:
    each a one-line error from --dry-run, before any weight is read."""
    import shutil

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bare = tmp_path / "bare"
    shutil.copytree(model_dirs["llama"], bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    for argv, says in [(["--data", str(tmp_path / "nothere.txt")], "is neither 'wiki-sample'"),
                       (["--data", "wiki-sampel"], "is neither 'wiki-sample'"),
                       (["--data", str(empty)], "is empty"),
                       (["--model", str(bare)], "has no tokenizer")]:
        code, _, err = dry_run(capsys, *argv)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
