"""Evaluation metrics: perplexity by hand, KL and agreement of identical models, per-layer errors, the eval verb."""

import json
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from dofattn import evaluate
from dofattn.cli import main
from dofattn.errors import UserError
from dofattn.evaluate import compare, perplexity, teacher_mode
from dofattn.jobs.eval import layer_errors
from dofattn.spec import Attention
from dofattn.model.student import linearize
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


@pytest.mark.parametrize("chunk", [2048, 6], ids=["one chunk", "chunks of 6"])
def test_by_position_buckets_match_the_per_prediction_numbers(chunk, monkeypatch):
    """Also scored in chunks of predictions (a long block's logits never exist at once, whatever the vocabulary:
    no logits tensor above `SCORE_VALUES`): the same numbers."""
    vocab = tiny_model("llama").config.vocab_size
    monkeypatch.setattr(evaluate, "SCORE_VALUES", chunk * vocab)
    made, head = [], evaluate.head
    monkeypatch.setattr(evaluate, "head", lambda model, hidden: made.append(hidden.shape[:2].numel()) or
                        head(model, hidden))
    student, ids = tiny_model("llama"), blocks(n=3, length=21)
    linearize(student, [8, 8, 8], LINEAR, layers=[1])
    teacher = tiny_model("llama")
    result = compare(student, ids, teacher=teacher, batch_size=2, progress=False)
    assert max(made) <= chunk and (chunk > 40 or len(made) > 4)
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


def test_chunked_log_probs_are_the_models_own_with_soft_capping(family):
    """The body once, the LM head (and Gemma's final soft-capping) in chunks: the model's own log-probabilities."""
    from transformers import Gemma2Config

    from dofattn.evaluate import _chunk_targets, _log_probs

    models = [tiny_model(family)]
    if family == "llama":
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(Gemma2Config(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, final_logit_softcapping=0.5)).eval())
    ids = blocks(n=2, length=13)
    for model in models:
        with torch.no_grad():
            want = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
            got = list(_log_probs(model, ids, chunk=5))
        assert [p.shape[0] for p in got] == [10, 10, 4] and [t.numel() for t in _chunk_targets(ids, 300, 5)] == [10, 10, 4]
        torch.testing.assert_close(torch.cat([p.reshape(2, -1, 300) for p in got], 1), want, rtol=1e-5, atol=1e-5)


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


def saved_linear_student(base, folder):
    """(the model, its folder): the tiny model in `base` with every layer linear (`LINEAR`, dims 4, 6, 8), saved as
    a student in `folder`."""
    from dofattn.model.hf import load_model
    from dofattn.spec import StudentSpec
    from dofattn.model.student import fingerprint, save_student

    model, _ = load_model(str(base))
    linearize(model, [4, 6, 8], LINEAR)
    spec = StudentSpec(base_model=str(base), dims=[4, 6, 8], layers=[0, 1, 2], base=fingerprint(model),
                       attention=LINEAR)
    return model, save_student(model, folder, spec)


def test_eval_verb_on_a_student(capsys, tmp_path, model_dirs, text_file):
    _, folder = saved_linear_student(model_dirs["llama"], tmp_path / "run")
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
    code = main(["eval", "--model", str(folder), "--data", str(text_file), "--seq-len", "300", "--out", str(out)])
    assert code == 2 and "--seq-len 300 is past the model's context of 256 tokens" in capsys.readouterr().err


def test_eval_scores_a_short_plain_file_whole(capsys, tmp_path, model_dirs, tokenizer):
    """A .txt file given with --data is scored whole: all its tokens, in blocks of at most --seq-len (one block
    when it is shorter), every token predicted but each block's first; the perplexity is the hand-computed one."""
    from dofattn.jobs.eval import EvalConfig, run

    model, folder = saved_linear_student(model_dirs["llama"], tmp_path / "run")
    notes = tmp_path / "notes.txt"
    notes.write_text("The quick brown fox jumps over the lazy dog. Linear attention keeps a state. " * 2)
    ids = tokenizer(notes.read_text(), add_special_tokens=False)["input_ids"]
    n = len(ids)
    assert 16 < n < 512 and n % 16 > 1
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", str(folder), "--data", str(notes), "--num-blocks", "auto", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["tokens"] == n - 1
    result = run(EvalConfig(model=str(folder), data=str(notes), seq_len=16, layer_blocks=5, out=None))
    blocks = [ids[i:i + 16] for i in range(0, n, 16)]                   # the last one shorter
    assert result["tokens"] == n - len(blocks) and sum(result["by_position"]["tokens"]) == result["tokens"]
    nll = []
    with torch.no_grad():
        for block in blocks:
            log_p = torch.log_softmax(model(input_ids=torch.tensor([block])).logits[0, :-1].double(), -1)
            nll += [-log_p[t, block[t + 1]].item() for t in range(len(block) - 1)]
    assert math.isclose(result["ppl"], math.exp(sum(nll) / len(nll)), rel_tol=1e-5)
    assert all(e is not None for e in result["output_error"])          # layer errors on blocks of both lengths


QUESTIONS = [("The sky on a clear day is", [" blue", " green", " loud"]),
             ("Two plus two equals", [" four", " seven", " purple"]),
             ("Water freezes into", [" ice", " fire", " music"]),
             ("A cat is an", [" animal", " equation", " country"])]


def local_task(folder, answers=(0, 0, 0, 0)):
    """A four-question multiple-choice task in lm-eval's YAML + jsonl format, with these answers."""
    rows = [{"question": q, "choices": c, "answer": a} for (q, c), a in zip(QUESTIONS, answers)]
    (folder / "mini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "mini.yaml").write_text(
        "task: dofattn_mini_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mini.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    return folder


def loud_model(family: str):
    """A tiny model whose attention weights are scaled up, so that its attention (and linearizing it) moves its
    predictions: at their initial size the residual stream alone decides them."""
    model = tiny_model(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
                p.mul_(8)
    return model


@torch.no_grad()
def choice_scores(model, tokenizer, question: str, choices: list[str]) -> list[float]:
    """The summed log-probability of each choice after the question, as lm-eval reads a multiple-choice request:
    the continuation is the target delimiter " " and the choice, its tokens those of question + continuation after
    the question's own."""
    scores = []
    for choice in choices:
        context, whole = tokenizer.encode(question), tokenizer.encode(question + " " + choice)
        log_p = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].double(), -1)
        scores.append(sum(log_p[t - 1, whole[t]].item() for t in range(len(context), len(whole))))
    return scores


def test_lm_eval_bridge_on_a_local_task(tmp_path, tokenizer, monkeypatch):
    """The accuracy lm-eval reports for the in-memory student is the one its own log-likelihoods give: each
    question's answer is the student's most likely choice but for the last, so 3/4, where its teacher's choices
    give another accuracy."""
    from huggingface_hub import constants

    from dofattn.errors import UserError
    from dofattn.evaluate import lm_eval_tasks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = loud_model("llama")
    linearize(model, [8, 8, 8], LINEAR)
    picks = [max(range(3), key=choice_scores(model, tokenizer, q, c).__getitem__) for q, c in QUESTIONS]
    with teacher_mode(model):
        teacher_picks = [max(range(3), key=choice_scores(model, tokenizer, q, c).__getitem__) for q, c in QUESTIONS]
    answers = picks[:3] + [(picks[3] + 1) % 3]
    assert sum(t == a for t, a in zip(teacher_picks, answers)) != 3      # the teacher's accuracy is not 3/4
    folder = local_task(tmp_path, answers)
    result = lm_eval_tasks(model, tokenizer, ["dofattn_mini_mc"], include_path=str(folder))
    assert set(result) == {"dofattn_mini_mc"} and result["dofattn_mini_mc"]["acc"] == 0.75
    import pytest

    with pytest.raises(UserError, match="piqa need their datasets from the Hugging Face hub"):
        lm_eval_tasks(model, tokenizer, ["piqa"], include_path=str(folder))
    with pytest.raises(UserError, match="unknown lm-eval task"):
        lm_eval_tasks(model, tokenizer, ["no_such_task"], include_path=str(folder))


def test_eval_extend_to_reads_both_models_with_yarn(tmp_path, model_dirs):
    """--extend-to scales the student's and the teacher's RoPE (the teacher here the student's own base model), is
    recorded in the result, and is refused below one token before any model loads."""
    from dofattn.jobs.eval import EvalConfig, check, run

    _, folder = saved_linear_student(model_dirs["llama"], tmp_path / "run")
    notes = tmp_path / "notes.txt"
    notes.write_text("The quick brown fox jumps over the lazy dog. Linear attention keeps a state. " * 8)
    plain = run(EvalConfig(model=str(folder), data=str(notes), seq_len=64, layer_blocks=0, out=None))
    wide = run(EvalConfig(model=str(folder), data=str(notes), seq_len=64, layer_blocks=0, out=None, extend_to=2048))
    assert wide["extend_to"] == 2048 and "extend_to" not in plain
    assert wide["ppl"] != plain["ppl"] and wide["teacher_ppl"] != plain["teacher_ppl"]
    with pytest.raises(UserError, match="--extend-to 0"):
        check(EvalConfig(model=str(folder), extend_to=0))


def test_synthetic_long_context_tasks_run_offline_at_each_length(tokenizer, monkeypatch):
    """RULER's tasks (lm-eval builds their prompts): no hub needed, one lm-eval call per length, each told the
    length and a tokenizer it can load, `limit` prompts each; scores keyed by length."""
    import lm_eval

    from dofattn.model import hf
    from dofattn.evaluate import format_tasks, lm_eval_tasks

    monkeypatch.setattr(hf, "_hub_reachable", lambda *a: pytest.fail("a synthetic task needs no hub"))
    calls = []

    def fake(model, tasks, task_manager, limit, **kwargs):
        meta = task_manager.metadata
        from transformers import AutoTokenizer

        assert AutoTokenizer.from_pretrained(meta["tokenizer"]).vocab == tokenizer.vocab
        calls.append((tasks, meta["max_seq_lengths"], limit))
        length = meta["max_seq_lengths"][0]
        return {"results": {"niah_single_1": {f"{length},none": 1.0 if length == 4096 else 0.5}}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", fake)
    model = tiny_model("llama")
    heard = []
    result = lm_eval_tasks(model, tokenizer, ["niah_single_1"], limit=5, lengths=[4096, 8192],
                           scored=lambda length, now: heard.append((length, now, len(calls))))
    assert calls == [(["niah_single_1"], [4096], 5), (["niah_single_1"], [8192], 5)]
    assert heard == [(4096, {"niah_single_1": 1.0}, 1), (8192, {"niah_single_1": 0.5}, 2)]   # each as it ends
    assert result == {"niah_single_1": {"4096": 1.0, "8192": 0.5}}
    table = format_tasks(result, {"niah_single_1": {"4096": 1.0, "8192": 1.0}})
    assert "niah_single_1        8192    0.5000    1.0000" in table


def test_teacher_task_scores_are_reused_only_for_the_same_setup(tmp_path, model_dirs, monkeypatch):
    """--teacher-answers with --tasks: the teacher's scores come from the earlier eval JSON (lm-eval runs the
    student alone), only where that JSON scored the same teacher, prompts and dtype at every task and length
    asked; anything else is refused before a model answers."""
    from dofattn import evaluate
    from dofattn.jobs.eval import EvalConfig, run

    _, folder = saved_linear_student(model_dirs["llama"], tmp_path / "run")
    calls = []

    def fake(model, tokenizer, tasks, include_path, limit, batch_size, lengths, **kwargs):
        calls.append(limit)
        return {task: {str(n): 1.0 if len(calls) % 2 == 0 else 0.5 for n in lengths} for task in tasks}

    monkeypatch.setattr(evaluate, "lm_eval_tasks", fake)
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    asked = dict(model=str(folder), num_blocks=0, tasks=["niah_single_1"], task_lengths=[128, 256], prompts=2)
    earlier = run(EvalConfig(**asked, out=str(first)))
    assert calls == [2, 2] and earlier["teacher_tasks"] == {"niah_single_1": {"128": 1.0, "256": 1.0}}
    assert earlier["task_setup"]["prompts"] == 2 and earlier["task_setup"]["dtype"] == "float32"
    calls.clear()
    reused = run(EvalConfig(**{**asked, "task_lengths": [256]}, out=str(again), teacher_answers=str(first)))
    assert calls == [2]                                           # the student alone
    assert reused["tasks"] == {"niah_single_1": {"256": 0.5}}
    assert reused["teacher_tasks"] == {"niah_single_1": {"256": 1.0}} and reused["teacher_answers"] == str(first)
    calls.clear()
    for changed, message in [({"prompts": 3}, "scored another setup (prompts 2 there, 3 here)"),
                             ({"task_lengths": [200]}, "no teacher score for niah_single_1 at 200"),
                             ({"tasks": ["niah_single_2"]}, "no teacher score for niah_single_2")]:
        with pytest.raises(UserError, match=re.escape(message)):
            run(EvalConfig(**{**asked, **changed}, out=None, teacher_answers=str(first)))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"teacher_tasks": earlier["teacher_tasks"]}))    # without its setup
    with pytest.raises(UserError, match="not an eval JSON with the teacher's task scores and their setup"):
        run(EvalConfig(**asked, out=None, teacher_answers=str(plain)))
    assert calls == [] and not again.with_name("eval.json").exists()


@pytest.mark.slow
def test_niah_single_1_on_the_teacher_at_512_tokens():
    """lm-eval's own prompts and scoring, offline, on the built-in teacher: it finds the needle at 512 tokens."""
    from dofattn.evaluate import lm_eval_tasks
    from dofattn.model.hf import load_model

    model, tokenizer = load_model("smollm2-135m")
    assert lm_eval_tasks(model, tokenizer, ["niah_single_1"], limit=2, batch_size=1, lengths=[512]) == {
        "niah_single_1": {"512": 1.0}}


def test_what_other_libraries_print_is_kept_off_the_terminal_unless_verbose(capfd):
    """`quiet_output`: Python's prints and a subprocess's stderr (lm-eval's `git describe` outside a repository)
    go to a file; -v lets them through; on a failure the file's last lines are printed with it."""
    import subprocess
    import sys

    from dofattn.evaluate import quiet_output

    chatter = [sys.executable, "-c", "import sys; print('fatal: not a git repository', file=sys.stderr)"]
    with quiet_output():
        print("[nltk_data] Error loading punkt_tab")
        subprocess.run(chatter)
    print("ours")
    out, err = capfd.readouterr()
    assert out == "ours\n" and err == ""
    with quiet_output(verbose=True):
        subprocess.run(chatter)
    assert "fatal: not a git repository" in capfd.readouterr().err
    with pytest.raises(RuntimeError), quiet_output():
        print("the cause")
        raise RuntimeError("lm-eval failed")
    assert "the cause" in capfd.readouterr().err
