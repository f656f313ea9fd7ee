"""LoRA adapters on the attention projections (and with --lora-targets all on the MLPs): placement per family,
teacher mode switches them off, merging, and a distilled LoRA student that saves, loads and generates."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dofattn.cli import main
from dofattn.errors import UserError
from dofattn.evaluate import teacher_mode
from dofattn.model.lora import add_lora, lora_layers, lora_parameters, merge_lora
from dofattn.model.student import linearize, load_student
from dofattn.spec import Attention
from tests.conftest import tiny_model

pytest.importorskip("peft")

# projections adapted per layer: llama q, k, v, o; gpt2 c_attn, c_proj; neox query_key_value, dense
PER_LAYER = {"llama": 4, "gpt2": 2, "gpt_neox": 2}
# and on the MLP: llama gate, up, down; gpt2 c_fc, c_proj; neox dense_h_to_4h, dense_4h_to_h
MLP_PER_LAYER = {"llama": 3, "gpt2": 2, "gpt_neox": 2}


def ids(batch=2, length=13, seed=0):
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def perturb(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.copy_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("targets", ["attention", "all"])
@pytest.mark.parametrize("family", sorted(PER_LAYER))
def test_adapters_sit_on_their_projections_and_teacher_mode_removes_them(family, targets):
    stock = tiny_model(family)
    model = tiny_model(family)
    linearize(model, [6, 6, 6], Attention(window=0, sink=0), seed=0)
    x = ids()
    mlp = 3 * MLP_PER_LAYER[family] if targets == "all" else 0
    with torch.no_grad():
        before = model(x, use_cache=False).logits
        add_lora(model, rank=2, targets=targets)
        assert len(lora_layers(model)) == 3 * PER_LAYER[family] + mlp
        assert len({n.split(".lora_")[0] for n, _ in lora_parameters(model) if ".mlp." in n}) == mlp
        torch.testing.assert_close(model(x, use_cache=False).logits, before)  # B = 0: nothing changes yet
        perturb(model)
        assert not torch.allclose(model(x, use_cache=False).logits, before, atol=1e-4)
        with teacher_mode(model):
            torch.testing.assert_close(model(x, use_cache=False).logits, stock(x, use_cache=False).logits)
        merged_ref = model(x, use_cache=False).logits
        assert merge_lora(model) == 3 * PER_LAYER[family] + mlp
        torch.testing.assert_close(model(x, use_cache=False).logits, merged_ref, rtol=1e-5, atol=1e-5)
        with pytest.raises(UserError, match="merged"), teacher_mode(model):
            pass


def test_adapters_on_a_bfloat16_model_are_float32_and_train():
    model = tiny_model("llama").to(torch.bfloat16)
    linearize(model, [6, 6, 6], Attention(window=0, sink=0), seed=0)
    add_lora(model, rank=2)
    assert {p.dtype for _, p in lora_parameters(model)} == {torch.float32}
    reference = tiny_model("llama")
    linearize(reference, [6, 6, 6], Attention(window=0, sink=0), seed=0)
    add_lora(reference, rank=2)
    perturb(model), perturb(reference)
    x = ids()
    logits = model(x, use_cache=False).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference(x, use_cache=False).logits, rtol=0.05, atol=0.05)
    logits.float().square().mean().backward()
    grads = [p.grad for n, p in lora_parameters(model) if "lora_A" in n]
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


def distill_lora(capsys, model_dirs, corpus, tmp_path, *extra: str):
    """A tiny Llama distilled with LoRA rank 2 and 4 end-to-end steps on `corpus`; its run folder and log."""
    out = tmp_path / "run"
    sets = ("layerwise.seq_len=32", "layerwise.blocks=8", "layerwise.batch_size=2", "end_to_end.batch_size=2",
            "end_to_end.seq_len=32", "eval.blocks=2", "eval.seq_len=32", "student.dims=fix:8", "layerwise.steps=3",
            "end_to_end.steps=4", "end_to_end.lr=0.01", "student.lora_rank=2", *extra)
    argv = ["distill", "--recipe", "window", "--model", str(model_dirs["llama"]), "--data", str(corpus), "--out",
            str(out), "--device", "cpu", *(x for key in sets for x in (("--set", key) if "=" in key else (key,)))]
    assert main(argv) == 0, capsys.readouterr().err
    log = json.loads((out / "log.json").read_text())
    assert log["end_to_end"]["steps"] == 4 and all(torch.isfinite(torch.tensor(log["end_to_end"]["losses"])))
    return out, log


def test_distilled_lora_student_round_trip(capsys, model_dirs, corpus, tmp_path):
    out, _ = distill_lora(capsys, model_dirs, corpus, tmp_path)
    student, _, config = load_student(out)
    assert config.lora_rank == 2
    names = [n for n, _ in lora_parameters(student)]
    assert len(names) == 2 * 3 * 4 and any(p.abs().sum() > 0 for n, p in lora_parameters(student) if "lora_B" in n)
    merged, _, _ = load_student(out, merge_lora=True)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(merged(x, use_cache=False).logits, student(x, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)
    assert main(["generate", "--model", str(out), "--max-new-tokens", "3", "--device", "cpu"]) == 0


def test_distilled_student_with_mlp_adapters_round_trip(capsys, model_dirs, corpus, tmp_path):
    out, _ = distill_lora(capsys, model_dirs, corpus, tmp_path, "student.lora_targets=all")
    student, _, config = load_student(out)
    assert config.lora_targets == "all"
    mlp = {n: p for n, p in lora_parameters(student) if ".mlp." in n}
    assert len(mlp) == 2 * 3 * 3 and any(p.abs().sum() > 0 for n, p in mlp.items() if "lora_B" in n)  # trained
    (tmp_path / "attention").mkdir()
    attention_only, _ = distill_lora(capsys, model_dirs, corpus, tmp_path / "attention")
    x = ids()
    with torch.no_grad():
        logits = student(x, use_cache=False).logits
        torch.testing.assert_close(load_student(out, merge_lora=True)[0](x, use_cache=False).logits, logits,
                                   rtol=1e-4, atol=1e-4)
        assert not torch.allclose(load_student(attention_only)[0](x, use_cache=False).logits, logits, atol=1e-4)
        with teacher_mode(student):                       # every adapter off, the MLP's too: the base model
            stock = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], attn_implementation="sdpa")
            torch.testing.assert_close(student(x, use_cache=False).logits, stock(x, use_cache=False).logits)


def test_bfloat16_distillation_trains_and_saves_float32_tensors(capsys, model_dirs, corpus, tmp_path):
    from safetensors.torch import load_file

    from dofattn.spec import WEIGHTS_FILE

    out, _ = distill_lora(capsys, model_dirs, corpus, tmp_path, "--dtype", "bfloat16")
    saved = load_file(str(out / WEIGHTS_FILE))
    lora = {n: t for n, t in saved.items() if ".lora_" in n}
    assert lora and all(t.dtype == torch.float32 for t in saved.values())
    assert any(t.abs().sum() > 0 for n, t in lora.items() if "lora_B" in n)     # the adapters moved
    x = ids()
    with torch.no_grad():
        full = load_student(out)[0](x, use_cache=False).logits
        half = load_student(out, dtype=torch.bfloat16)[0](x, use_cache=False).logits
    torch.testing.assert_close(half.float(), full, rtol=0.05, atol=0.05)
    assert main(["generate", "--model", str(out), "--max-new-tokens", "3", "--device", "cpu", "--dtype",
                 "bfloat16"]) == 0                                        # merges the float32 adapters into bf16


@pytest.mark.parametrize("extra,message", [
    (["student.lora_rank=-1"], "student.lora_rank = -1: give >= 0"),
    (["student.lora_rank=2", "end_to_end.steps=0"], "adapters train in the end-to-end phase"),
    (["student.lora_targets=all"], "student.lora_targets = 'all' needs adapters"),
    (["student.lora_rank=2", "student.lora_targets=mlp"], "student.lora_targets = 'mlp'; use one of attention, all"),
])
def test_bad_lora_input_is_one_line_error(capsys, model_dirs, tmp_path, extra, message):
    out = tmp_path / "run"
    code = main(["distill", "--recipe", "window", "--model", str(model_dirs["llama"]), "--out", str(out),
                 *(x for key in extra for x in ("--set", key))])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1 and not out.exists()


def test_unknown_lora_targets_are_refused():
    with pytest.raises(UserError, match="unknown LoRA targets 'mlp'"):
        add_lora(tiny_model("llama"), rank=2, targets="mlp")
