"""Evaluation metrics: perplexity by hand, KL and agreement of identical models, per-layer errors, the eval verb."""

import json
import math

import torch

from dofattn.cli import main
from dofattn.evaluate import compare, layer_errors, perplexity, teacher_mode
from dofattn.spec import Attention
from dofattn.student import linearize
from tests.conftest import tiny_model

LINEAR = Attention(window=0, sink=0)        # pure linear attention


def blocks(n=3, length=17, seed=0):
    return torch.randint(3, 300, (n, length), generator=torch.Generator().manual_seed(seed))


def test_perplexity_matches_hand_computation():
    model, ids = tiny_model("gpt2"), blocks()
    with torch.no_grad():
        logits = model(ids).logits
    nll = [-torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]].item() for b in range(3) for t in range(16)]
    expected = math.exp(sum(nll) / len(nll))
    assert math.isclose(perplexity(model, ids, batch_size=2, progress=False), expected, rel_tol=1e-6)
    result = compare(model, ids, progress=False)
    assert math.isclose(result["ppl"], expected, rel_tol=1e-6) and result["tokens"] == 48


def test_by_position_buckets_match_the_per_prediction_numbers():
    student, ids = tiny_model("llama"), blocks(n=3, length=21)
    linearize(student, [8, 8, 8], LINEAR, layers=[1])
    teacher = tiny_model("llama")
    result = compare(student, ids, teacher=teacher, batch_size=2, progress=False)
    with torch.no_grad():
        log_s = torch.log_softmax(student(ids).logits[:, :-1].double(), -1)
        log_t = torch.log_softmax(teacher(ids).logits[:, :-1].double(), -1)
    target = ids[:, 1:, None]
    nll_s, nll_t = -log_s.gather(2, target)[..., 0], -log_t.gather(2, target)[..., 0]   # [3, 20]
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    rows = result["by_position"]
    # predictions see 1..20 tokens: buckets 1, 2-3, 4-7, 8-15, 16-20
    assert rows["context_from"] == [1, 2, 4, 8, 16] and rows["context_to"] == [1, 3, 7, 15, 20]
    assert rows["tokens"] == [3, 6, 12, 24, 15] and sum(rows["tokens"]) == result["tokens"]
    for i, (a, b) in enumerate(zip(rows["context_from"], rows["context_to"])):
        part = slice(a - 1, b)
        assert math.isclose(rows["ppl"][i], nll_s[:, part].mean().exp().item(), rel_tol=1e-5)
        assert math.isclose(rows["teacher_ppl"][i], nll_t[:, part].mean().exp().item(), rel_tol=1e-5)
        assert math.isclose(rows["ratio"][i], rows["ppl"][i] / rows["teacher_ppl"][i], rel_tol=1e-9)
        assert math.isclose(rows["kl"][i], kl[:, part].mean().item(), rel_tol=1e-4, abs_tol=1e-6)
    weights = torch.tensor(rows["tokens"], dtype=torch.float64)
    pooled = (weights * torch.tensor(rows["kl"], dtype=torch.float64)).sum() / weights.sum()
    assert math.isclose(pooled.item(), result["kl"], rel_tol=1e-5)


def test_identical_models_have_zero_kl_and_full_agreement():
    model, ids = tiny_model("llama"), blocks()
    result = compare(model, ids, teacher=tiny_model("llama"), progress=False)
    assert result["kl"] == 0.0 and result["top1_agreement"] == 1.0 and result["ppl"] == result["teacher_ppl"]


def test_student_vs_its_base_model():
    model, ids = tiny_model("gpt_neox"), blocks()
    with torch.no_grad():
        stock = perplexity(model, ids, progress=False)
    linearize(model, [8, 8, 8], LINEAR, layers=[0, 2])
    result = compare(model, ids, progress=False)
    assert math.isclose(result["teacher_ppl"], stock, rel_tol=1e-6)
    assert result["kl"] > 0 and result["ppl"] != stock
    with teacher_mode(model):
        assert math.isclose(perplexity(model, ids, progress=False), stock, rel_tol=1e-6)
    errors = layer_errors(model, ids, progress=False)
    assert errors["output_error"][1] is None and errors["kernel_error"][1] is None
    assert all(0 < errors[k][i] < math.inf for k in ("output_error", "kernel_error") for i in (0, 2))


def test_teacher_mode_keeps_a_kv_cache(family):
    """In `teacher_mode` a cached call is the base model's: the cache holds keys and values, not a linear slot."""
    from transformers import DynamicCache

    model, ids = tiny_model(family), blocks(1, 20)
    with torch.no_grad():
        stock = model(input_ids=ids, use_cache=True)
        linearize(model, [8, 8, 8], LINEAR, layers=[0, 2])
        with teacher_mode(model):
            cached = model(input_ids=ids[:, :12], use_cache=True)
            more = model(input_ids=ids[:, 12:], past_key_values=cached.past_key_values, use_cache=True)
    assert isinstance(cached.past_key_values, DynamicCache)
    assert cached.past_key_values.get_seq_length() == 20
    torch.testing.assert_close(more.logits, stock.logits[:, 12:], rtol=1e-4, atol=1e-4)


def test_eval_verb_on_a_student(capsys, tmp_path, model_dirs, text_file):
    from dofattn.hf import load_model
    from dofattn.spec import StudentSpec
    from dofattn.student import fingerprint, save_student

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [4, 6, 8], LINEAR)
    folder = save_student(model, tmp_path / "run", StudentSpec(base_model=str(model_dirs["llama"]), dims=[4, 6, 8], layers=[0, 1, 2], base=fingerprint(model), attention=Attention(feature="prf", window=0, sink=0)))
    out, png, positions = tmp_path / "eval.json", tmp_path / "eval.png", tmp_path / "positions.svg"
    code = main(["eval", "--model", str(folder), "--data", str(text_file), "--seq-len", "32", "--num-blocks", "3",
                 "--out", str(out), "--plot", str(png), "--plot-positions", str(positions)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "16-31" in printed.out and positions.read_text().startswith("<?xml")
    result = json.loads(out.read_text())
    assert result["by_position"]["context_to"] == [1, 3, 7, 15, 31]
    assert result["split"] == "all"  # a plain file is evaluated whole
    assert {"ppl", "teacher_ppl", "kl", "top1_agreement", "output_error", "kernel_error"} <= set(result)
    assert len(result["output_error"]) == 3 and png.stat().st_size > 1000
    code = main(["eval", "--model", str(folder), "--data", str(tmp_path / "missing.txt"), "--out", str(out)])
    assert code == 2
    code = main(["eval", "--model", str(folder), "--data", str(text_file), "--out", str(out), "--plot-positions",
                 str(tmp_path / "positions.txt")])
    assert code == 2 and "--plot-positions" in capsys.readouterr().err
    code = main(["eval", "--model", str(folder), "--data", f"{text_file}+{text_file}", "--seq-len", "32",
                 "--num-blocks", "3", "--layer-blocks", "0", "--out", str(out)])
    assert code == 0 and json.loads(out.read_text())["split"] == "all"   # files pooled are still evaluated whole


def local_task(folder):
    """A four-question multiple-choice task in lm-eval's YAML + jsonl format."""
    rows = [{"question": "The sky on a clear day is", "choices": [" blue", " green", " loud"], "answer": 0},
            {"question": "Two plus two equals", "choices": [" four", " seven", " purple"], "answer": 0},
            {"question": "Water freezes into", "choices": [" ice", " fire", " music"], "answer": 0},
            {"question": "A cat is an", "choices": [" animal", " equation", " country"], "answer": 0}]
    (folder / "mini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "mini.yaml").write_text(
        "task: dofattn_mini_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mini.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    return folder


def test_lm_eval_bridge_on_a_local_task(tmp_path, tokenizer, monkeypatch):
    from huggingface_hub import constants

    from dofattn.errors import UserError
    from dofattn.evaluate import lm_eval_tasks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = tiny_model("llama")
    linearize(model, [8, 8, 8], LINEAR)
    folder = local_task(tmp_path)
    result = lm_eval_tasks(model, tokenizer, ["dofattn_mini_mc"], include_path=str(folder))
    assert set(result) == {"dofattn_mini_mc"} and 0.0 <= result["dofattn_mini_mc"]["acc"] <= 1.0
    import pytest

    with pytest.raises(UserError, match="piqa need their datasets from the Hugging Face hub"):
        lm_eval_tasks(model, tokenizer, ["piqa"], include_path=str(folder))
    with pytest.raises(UserError, match="unknown lm-eval task"):
        lm_eval_tasks(model, tokenizer, ["no_such_task"], include_path=str(folder))
