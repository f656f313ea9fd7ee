"""The long-context recall tasks: prompts built to spec, and scoring that a copying model passes and a model that
cannot see the fact fails (at chance, about 0)."""

import contextlib
import json
import math
from types import SimpleNamespace

import pytest
import torch

from dofattn.cli import main
from dofattn.distill.choose import copy_mass, copy_probe, copy_scores
from dofattn.errors import UserError
from dofattn.recall import (MULTIKEY_KEYS, TASKS, RecallTasks, accuracy, evaluate_recall, make_prompts,
                            read_answer)
from dofattn.spec import Attention
from tests.conftest import TEXT, tiny_model


class Copier(torch.nn.Module):
    """An induction head on token ids: at each position it predicts the token that followed the longest earlier
    match of the text just before (at least `least` tokens), among the last `window` tokens if given; with no
    match, a random token. It copies whatever it can see, and nothing else."""

    def __init__(self, vocab: int, window: int | None = None, least: int = 4):
        super().__init__()
        self.vocab, self.window, self.least = vocab, window, least
        self.weight = torch.nn.Parameter(torch.zeros(1))      # a device to read
        self.random = torch.Generator().manual_seed(0)

    def guess(self, ids: list[int], t: int) -> int:
        best, best_len = None, self.least - 1
        first = 0 if self.window is None else max(0, t - self.window + 1)
        for s in range(max(first, 1) - 1, t):
            n = 0
            while n <= s and s - n >= first and ids[s - n] == ids[t - n]:
                n += 1
            if n >= best_len:                                 # the latest of the longest
                best, best_len = s, n
        if best is None:
            return int(torch.randint(self.vocab, (1,), generator=self.random))
        return ids[best + 1]

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        ids = input_ids[0].tolist()
        positions = range(len(ids) - logits_to_keep, len(ids))
        logits = torch.zeros(1, len(positions), self.vocab)
        for i, t in enumerate(positions):
            logits[0, i, self.guess(ids, t)] = 10.0
        return SimpleNamespace(logits=logits)


def documents():
    return [TEXT] * 4


@pytest.fixture(scope="module")
def tasks(tokenizer):
    return RecallTasks(tokenizer, documents(), seed=0)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [500, 601, 900])
def test_prompts_have_their_length_and_hold_the_fact(tasks, tokenizer, task, length):
    for depth in (0.0, 0.3, 1.0):
        prompt = tasks.prompt(task, length, depth, 0)
        assert len(prompt.ids) + len(prompt.answer) == length
        value = tokenizer.decode(prompt.answer).strip()
        assert value.isdigit() and len(value) == (5 if task == "passkey" else 6)
        assert value in tokenizer.decode(prompt.ids[prompt.needle_at:prompt.needle_at + 60])
        assert value not in tokenizer.decode(prompt.ids[:prompt.needle_at])
        assert prompt == tasks.prompt(task, length, depth, 0)                     # deterministic
    values = {tokenizer.decode(tasks.prompt(task, length, 0.5, s).answer) for s in range(6)}
    assert len(values) == 6                                                       # each sample its own fact


@pytest.mark.parametrize("task", TASKS)
def test_depth_moves_the_fact_from_the_start_to_the_question(tasks, task):
    distances = [tasks.prompt(task, 900, d / 4, 0).distance for d in range(5)]
    assert distances == sorted(distances, reverse=True) and len(set(distances)) == 5
    assert distances[0] > 650 and distances[-1] < distances[0] / 3


def test_multikey_asks_one_of_four_different_keys(tasks, tokenizer):
    prompt = tasks.prompt("multikey", 900, 0.5, 3)
    text = tokenizer.decode(prompt.ids)
    assert text.count("The special magic number for") == MULTIKEY_KEYS + 1                 # the needles, the question
    numbers = [line.split(" is: ")[1][:6] for line in text.split("The special magic number for")[1:-1]]
    keys = [line.split(" is: ")[0].strip() for line in text.split("The special magic number for")[1:-1]]
    assert len(set(keys)) == MULTIKEY_KEYS and len(set(numbers)) == MULTIKEY_KEYS
    asked = text.rsplit("The special magic number for ", 1)[1].split(" is:")[0]
    assert numbers[keys.index(asked)] == tokenizer.decode(prompt.answer).strip()


def test_a_copier_scores_one_and_a_model_that_cannot_see_the_fact_scores_chance(tasks, tokenizer):
    window = 40
    models = {"student": lambda: contextlib.nullcontext(Copier(len(tokenizer), window=window)),
              "teacher": lambda: contextlib.nullcontext(Copier(len(tokenizer)))}
    result = evaluate_recall(models, tasks, make_prompts(tasks, list(TASKS), [600, 900], 5, samples=2),
                             progress=False)
    for task in TASKS:
        assert accuracy(result, "teacher", task) == 1.0
    far = [r for r in result["records"] if r["distance"] > window]
    assert len(far) >= 30 and not any(r["student"]["correct"] for r in far)
    assert all(r["student"]["log_p"] < r["teacher"]["log_p"] for r in far)
    assert {c["length"] for c in result["cells"]} == {600, 900} and len(result["cells"]) == 2 * 2 * 5
    assert all(c["teacher"] == 1.0 and c["prompts"] == 2 for c in result["cells"])


def test_read_answer_uses_the_answers_own_positions(tasks, tokenizer):
    prompt = tasks.prompt("passkey", 400, 0.5, 0)
    guess, log_p, memory = read_answer(Copier(len(tokenizer)), prompt)
    assert memory == 0                                                       # no cache: it is not an HF model
    each = -math.log1p((len(tokenizer) - 1) * math.exp(-10.0))           # logit 10 on the copied token, 0 elsewhere
    assert guess == prompt.answer and math.isclose(log_p, len(prompt.answer) * each, rel_tol=1e-3)


@pytest.mark.parametrize("task,length,message", [
    ("passkey", 200, "leaves"), ("multikey", 300, "leaves"), ("nope", 200, "unknown recall task"),
])
def test_impossible_prompts_are_refused(tasks, task, length, message):
    with pytest.raises(UserError, match=message):
        tasks.prompt(task, length, 0.5, 0)
    with pytest.raises(UserError, match="more text"):
        RecallTasks(tasks.tokenizer, ["A short text."]).prompt("multikey", 900, 0.5, 0)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory, tokenizer):
    """The tiny llama with a context of 1024 tokens (the tiny tokenizer spends 4 tokens a word)."""
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    model.config.max_position_embeddings = 1024
    path = tmp_path_factory.mktemp("long-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_eval_verb_runs_the_recall_grid(capsys, tmp_path, long_llama, corpus):
    from dofattn.model.hf import load_model
    from dofattn.spec import StudentSpec
    from dofattn.model.student import fingerprint, linearize, save_student

    model, _ = load_model(str(long_llama))
    linearize(model, [4, 6, 8], Attention(feature="prf", window=0, sink=0))
    spec = StudentSpec(base_model=str(long_llama), dims=[4, 6, 8], layers=[0, 1, 2], base=fingerprint(model),
                       attention=Attention(feature="prf", window=0, sink=0))
    folder = save_student(model, tmp_path / "run", spec)
    out, png = tmp_path / "eval.json", tmp_path / "recall.png"
    code = main(["eval", "--model", str(folder), "--data", str(corpus), "--num-blocks", "0", "--recall",
                 "passkey,multikey", "--lengths", "600,1024", "--depths", "2", "--out", str(out), "--plot-recall",
                 str(png)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    result = json.loads(out.read_text())
    assert "ppl" not in result and result["recall"]["lengths"] == [600, 1024]
    assert len(result["recall"]["records"]) == 2 * 2 * 2 and png.stat().st_size > 1000
    assert "passkey student" in printed.out and "cache MiB" in printed.out
    records = result["recall"]["records"]
    student = {r["length"]: r["student"]["cache_bytes"] for r in records}
    teacher = {r["length"]: r["teacher"]["cache_bytes"] for r in records}
    assert student[600] == student[1024] > 0                     # a state: the same at any length
    assert teacher[1024] == 2 * 3 * 2 * 1024 * 16 * 4            # K and V: 3 layers, 2 kv heads, head size 16
    assert teacher[600] == 2 * 3 * 2 * 600 * 16 * 4
    for record in result["recall"]["records"]:                   # an untrained tiny model: chance
        assert not record["student"]["correct"] and not record["teacher"]["correct"]

    again = tmp_path / "again.json"                               # the teacher's answers reused, not rerun
    base = ["eval", "--model", str(folder), "--data", str(corpus), "--num-blocks", "0", "--recall",
            "passkey,multikey", "--lengths", "600,1024", "--out", str(again), "--teacher-answers", str(out)]
    assert main(base + ["--depths", "2"]) == 0, capsys.readouterr().err
    reused = json.loads(again.read_text())["recall"]
    assert [r["teacher"] for r in reused["records"]] == [r["teacher"] for r in result["recall"]["records"]]
    assert reused["teacher_answers"] == str(out)
    assert main(base + ["--depths", "3"]) == 2 and "has no teacher answer for passkey" in capsys.readouterr().err
    (tmp_path / "plain.json").write_text("{}")
    base[-1] = str(tmp_path / "plain.json")
    assert main(base + ["--depths", "2"]) == 2 and "not an eval JSON with recall" in capsys.readouterr().err


def test_lengths_auto_doubles_up_to_the_context():
    """--lengths auto: 1024, 2048, ... up to the model's context (the context alone when shorter than 1024);
    given lengths must fit it."""
    from dofattn.recall import resolve_lengths

    assert resolve_lengths(None, 1024) == [1024]
    assert resolve_lengths(None, 3000) == [1024, 2048]
    assert resolve_lengths(None, 8192) == [1024, 2048, 4096, 8192]
    assert resolve_lengths(None, 600) == [600]
    assert resolve_lengths([100, 700], 1024) == [100, 700] and resolve_lengths([5000], None) == [5000]
    with pytest.raises(UserError, match="names no context length"):
        resolve_lengths(None, None)
    with pytest.raises(UserError, match="beyond the model's context of 1024; add --beyond-context"):
        resolve_lengths([512, 2048], 1024)
    assert resolve_lengths([512, 2048], 1024, beyond=True) == [512, 2048]


def test_eval_recall_with_lengths_auto(capsys, tmp_path, model_dirs, corpus):
    """`dofattn eval --recall passkey` with --lengths auto (the default) on a model of a 256-token context: one
    length, the context itself, every prompt within it, answered by student and teacher."""
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", str(model_dirs["llama"]), "--data", str(corpus), "--num-blocks", "0",
                 "--recall", "passkey", "--depths", "2", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    recall = json.loads(out.read_text())["recall"]
    assert recall["lengths"] == [256] and len(recall["records"]) == 2
    assert all(r["length"] == 256 and "correct" in r["student"] and "correct" in r["teacher"]
               for r in recall["records"])
    assert f"{256:>8}" in printed.out


@pytest.mark.parametrize("args,message", [
    (["--recall", "passkey,needle"], "unknown task needle"),
    (["--recall", "passkey", "--lengths", "2048"], "beyond the model's context of 1024"),
    (["--recall", "passkey", "--lengths", "12x"], "takes comma-separated token counts"),
    (["--recall", "passkey", "--lengths", "0,512"], "takes positive token counts"),
    (["--recall", "passkey", "--lengths", "160"], "leaves"),
    (["--recall", "passkey", "--depths", "0"], "--depths and --prompts must be at least 1"),
    (["--recall", "passkey", "--prompts", "0"], "--prompts 0: give at least 1 prompt"),
    (["--recall", "passkey", "--plot-recall", "{tmp}/r.jpg"], "--plot-recall"),
    (["--recall", "passkey", "--samples", "2"], "eval --samples is now --prompts"),   # the old names
    (["--tasks", "niah_single_1", "--limit", "2"], "eval --limit is now --prompts"),
    (["--prompts", "2"], "give at least 1 prompt a cell of --recall or --tasks"),
    ([], "leaves nothing to evaluate"),
    (["--teacher-answers", "{tmp}/none.json"], "use it with --recall"),
    (["--recall", "passkey", "--teacher-answers", "{tmp}/none.json"], "does not exist"),
])
def test_recall_bad_input_is_one_line_error(capsys, tmp_path, long_llama, corpus, args, message):
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(long_llama), "--data", str(corpus), "--num-blocks", "0", "--out",
            str(out)] + [a.format(tmp=tmp_path) for a in args]
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not out.exists()


def test_copy_probe_repeats_a_passage_at_the_end():
    blocks = torch.arange(2 * 80).reshape(2, 80)
    probe, at = copy_probe(blocks, span=8)
    assert at == 10 and torch.equal(probe[:, -8:], blocks[:, 10:18]) and torch.equal(probe[:, :-8], blocks[:, :-8])
    with pytest.raises(UserError, match="at least 64 tokens"):
        copy_probe(blocks[:, :63], span=8)


def test_copy_mass_is_the_weight_on_the_first_copy():
    """A head whose repeat queries point at the first copy scores about 1; one with zero queries spreads its weight
    evenly over the keys it sees, which gives span/(t+1) for the query at t exactly."""
    g = torch.Generator().manual_seed(0)
    T, span, at = 64, 8, 8
    key = torch.randn(1, T, 2, 16, generator=g)
    key = key / key.norm(dim=-1, keepdim=True)
    query = torch.zeros(1, T, 2, 16)
    query[0, T - span:, 0] = 40 * key[0, at:at + span, 0]                  # head 0 copies; head 1 looks nowhere
    mass = copy_mass(query, key, 1.0, at, span)
    assert mass.shape == (1, 2) and mass[0, 0] > 0.99
    even = torch.tensor([span / (t + 1) for t in range(T - span, T)]).mean()
    torch.testing.assert_close(mass[0, 1], even)


def test_copy_scores_per_layer_and_head():
    """A GPT-2 with no position embeddings and one planted head (layer 1, head 2) whose queries and keys are the
    same projection of the token: on blocks of distinct tokens, its repeat queries find their token again in the
    first copy (and at their own position, each half of the weight), so it scores about 1/2; every other head
    spreads its weight, about span/T."""
    model = tiny_model("gpt2")
    layer, head, size = 1, 2, 16
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
        projection = torch.randn(64, size, generator=torch.Generator().manual_seed(1))
        attention = model.transformer.h[layer].attn
        for part in (0, 1):                                              # the query's and the key's columns
            columns = slice(part * 64 + head * size, part * 64 + (head + 1) * size)
            attention.c_attn.weight[:, columns] = 2 * projection
            attention.c_attn.bias[columns] = 0
    blocks = torch.stack([torch.randperm(297, generator=torch.Generator().manual_seed(i))[:64] + 3 for i in range(2)])
    scores = copy_scores(model, blocks, span=8, progress=False)
    heads = model.config.num_attention_heads
    assert len(scores) == model.config.num_hidden_layers and all(len(h) == heads for h in scores)
    assert 0.48 < scores[layer][head] < 0.52
    assert all(s < 0.2 for i, h in enumerate(scores) for j, s in enumerate(h) if (i, j) != (layer, head))
    assert scores == copy_scores(model, blocks, span=8, progress=False)
