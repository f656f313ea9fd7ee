"""`dofattn sample`: teacher text from train-split prompts, appended per batch, resumed to the same text; and the
pooled `--data A+B` source it feeds."""

import json

import pytest
import torch

from dofattn.cli import main
from dofattn.data import check_source, load_texts, token_blocks
from dofattn.errors import UserError
from dofattn.model.hf import load_model
from dofattn.jobs.sample import SampleSpec, prompts, sample_text

TRAIN_WORDS = "The quick brown fox jumps over the lazy dog. "
HELD_OUT_WORDS = "Softmax attention compares every query with every key. "


@pytest.fixture
def split_corpus(tmp_path):
    """One document: its first nine tenths (train) and last tenth (validation) share no sentence."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join([TRAIN_WORDS * 4] * 45 + [HELD_OUT_WORDS * 4] * 5))
    return path


def sample(capsys, model, data, out, *extra):
    code = main(["sample", "--model", str(model), "--data", str(data), "--out", str(out), "--device", "cpu",
                 "--prompt-tokens", "4", "--new-tokens", "6", "--batch-size", "2", *map(str, extra)])
    printed, err = capsys.readouterr()
    return code, printed, err


def rows(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_prompts_come_from_the_train_split_only(model_dirs, split_corpus):
    _, tokenizer = load_model(str(model_dirs["llama"]))
    spec = SampleSpec(model="m", data=str(split_corpus), prompt_tokens=4, new_tokens=6, temperature=1.0,
                      batch_size=2, seed=0)
    ids = prompts(spec, tokenizer, 8)
    train = token_blocks(str(split_corpus), tokenizer, 4, None, split="train", seed=0)
    assert ids.shape == train.shape and sorted(map(tuple, ids.tolist())) == sorted(map(tuple, train.tolist()))
    assert all("Softmax" not in tokenizer.decode(row) for row in ids)
    with pytest.raises(UserError, match="fewer than --samples"):
        prompts(spec, tokenizer, len(train) + 1)


def test_samples_have_full_length_and_an_interrupted_file_goes_on_to_the_same_text(capsys, model_dirs, split_corpus,
                                                                                   tmp_path):
    model = model_dirs["llama"]
    whole = tmp_path / "whole.jsonl"
    code, printed, err = sample(capsys, model, split_corpus, whole, "--samples", 5)
    assert code == 0 and "5 samples of 4+6 tokens (5 new" in printed, err
    texts = rows(whole)
    assert len(texts) == 5 and len(set(texts)) == 5

    parts = tmp_path / "parts.jsonl"
    assert sample(capsys, model, split_corpus, parts, "--samples", 3)[0] == 0
    with open(parts, "a") as f:                      # killed while writing the fourth line
        f.write('{"text": "torn')
    code, printed, err = sample(capsys, model, split_corpus, parts, "--samples", 5)
    assert code == 0 and "(2 new" in printed, err
    assert parts.read_text() == whole.read_text()    # not the torn line, and sample i does not depend on --samples
    code, printed, _ = sample(capsys, model, split_corpus, parts, "--samples", 4)
    assert code == 0 and "5 samples" in printed and parts.read_text() == whole.read_text()

    other = tmp_path / "other.jsonl"
    assert sample(capsys, model, split_corpus, other, "--samples", 5, "--seed", 1)[0] == 0
    assert rows(other) != texts


def test_special_tokens_are_never_sampled_even_where_the_model_prefers_them(model_dirs, split_corpus, tmp_path):
    model, tokenizer = load_model(str(model_dirs["llama"]))
    with torch.no_grad():                             # tied embeddings: EOS's logit is large, either sign
        model.get_input_embeddings().weight[tokenizer.eos_token_id] *= 100
    generated = []
    generate = model.generate
    model.generate = lambda **kw: generated.append(generate(**kw)) or generated[-1]
    spec = SampleSpec(model="m", data=str(split_corpus), prompt_tokens=4, new_tokens=6, temperature=1.0,
                      batch_size=2, seed=0)
    sample_text(model, tokenizer, spec, 3, tmp_path / "s.jsonl", progress=False)
    new = torch.cat(generated)[:, 4:]
    assert new.shape == (4, 6)
    assert not torch.isin(new, torch.tensor(tokenizer.all_special_ids)).any()
    torch.manual_seed(0)
    unsuppressed = generate(input_ids=torch.cat(generated)[:, :4], do_sample=True, top_k=0, max_new_tokens=6,
                            pad_token_id=tokenizer.pad_token_id)
    assert (unsuppressed[:, 4:] == tokenizer.eos_token_id).sum() >= 2   # the bias does what it should


@pytest.mark.parametrize("flags,message", [
    (("--new-tokens", 7), "holds samples made with other options (new_tokens)"),
    (("--temperature", 0), "--temperature must be > 0"),
    (("--samples", 0), "must be at least 1"),
    (("--out", "{tmp}/samples.txt"), "must end in .jsonl"),
    (("--out", "{tmp}/foreign.jsonl"), "was not written by `dofattn sample`"),
    (("--out", "{tmp}/foreign.jsonl/more/x.jsonl"), "foreign.jsonl is a file, not a folder"),
    (("--data", "{tmp}/missing.txt"), "is neither"),
])
def test_bad_input_is_one_line_and_changes_nothing(capsys, model_dirs, split_corpus, tmp_path, flags, message):
    out = tmp_path / "samples.jsonl"
    assert sample(capsys, model_dirs["gpt2"], split_corpus, out, "--samples", 2)[0] == 0
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"text": "mine"}\n')
    files = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    flags = [str(f).replace("{tmp}", str(tmp_path)) for f in flags]
    code, _, err = sample(capsys, model_dirs["gpt2"], split_corpus, out, "--samples", 2, *flags)
    assert code == 2 and message in err and err.startswith("dofattn: error:") and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == files


def test_pooled_sources_split_each_source_on_its_own(tmp_path, split_corpus):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(40)))
    pooled = f"{split_corpus}+{docs}"
    check_source(pooled)
    for split in ("train", "validation", "all"):
        assert load_texts(pooled, split) == load_texts(str(split_corpus), split) + load_texts(str(docs), split)
    assert any(HELD_OUT_WORDS in t for t in load_texts(pooled, "validation"))
    assert not any(HELD_OUT_WORDS in t for t in load_texts(pooled, "train"))
    with pytest.raises(UserError, match="neither"):
        check_source(f"{split_corpus}+{tmp_path}/missing.jsonl")
    with pytest.raises(UserError, match="empty part"):
        check_source(f"{split_corpus}++{docs}")
    plus = tmp_path / "a+b.txt"                      # an existing path with a plus sign is one source
    plus.write_text(TRAIN_WORDS)
    assert load_texts(str(plus), "all") == [TRAIN_WORDS]


def test_sample_help_teaches_the_pooled_use(capsys):
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    text = capsys.readouterr().out
    assert "--eval-data wiki-sample" in text and "train split" in text
