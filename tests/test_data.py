"""Wikitext cleaning, dump parsing, splits, local sources and packing into token blocks; documents read lazily
give the blocks of the eager reader they replaced, and processes that share the tokenizing give one process's
blocks."""

import io
import json
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from dofattn.data import (FIRST_ROUND, LEAD_PROBE, check_source, clean_wikitext, leading_tokens, load_texts,
                          parse_wiki_dump, split_documents, token_blocks)
from dofattn.errors import UserError
from tests.conftest import TEXT, tiny_bos_tokenizer

WIKITEXT = """{{Infobox person | name = Ada | birth_date = 1815}}
'''Ada Lovelace''' was an [[England|English]] [[mathematician]].<ref>{{cite book|title=Ada}}</ref>
[[File:Ada.jpg|thumb|A portrait of Ada]]

== Work ==
She wrote the first ''published'' algorithm.<!-- a comment -->
{| class="wikitable"
|-
! Year !! Event
|-
| 1843 || Notes
|}
* A list item with a [http://example.org link text].
[[Category:Mathematicians]]
"""


def test_clean_wikitext_strips_markup():
    text = clean_wikitext(WIKITEXT)
    assert "Ada Lovelace was an English mathematician." in text
    assert "She wrote the first published algorithm." in text
    assert "A list item with a link text." in text
    for debris in ("{{", "}}", "[[", "]]", "'''", "<ref", "cite book", "Infobox", "thumb", "Category",
                   "wikitable", "1843", "comment", "==", "http"):
        assert debris not in text, debris


def dump(*pages: str) -> io.BytesIO:
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">' + "".join(pages) + "</mediawiki>")
    return io.BytesIO(xml.encode())


def page(title: str, text: str, ns: int = 0, redirect: bool = False) -> str:
    red = f'<redirect title="{title} target" />' if redirect else ""
    return (f"<page><title>{title}</title><ns>{ns}</ns><id>1</id>{red}<revision><text xml:space=\"preserve\">"
            f"{text}</text></revision></page>")


def test_parse_wiki_dump_drops_redirects_other_namespaces_and_empty_pages():
    docs = list(parse_wiki_dump(dump(
        page("Ada", "'''Ada''' was a [[mathematician]]."),
        page("Lovelace", "#REDIRECT [[Ada]]"),
        page("Countess", "#redirect [[Ada]]", redirect=True),
        page("Talk:Ada", "Discussion about Ada.", ns=1),
        page("Stub", "{{stub}}"),
        page("Babbage", "Charles '''Babbage''' built engines."),
    )))
    assert docs == [("Ada", "Ada was a mathematician."), ("Babbage", "Charles Babbage built engines.")]


def test_splits_are_deterministic_disjoint_and_complete():
    docs = [(f"title {i}", f"text {i}") for i in range(200)]
    train, val = split_documents(docs, "train"), split_documents(docs, "validation")
    assert set(train).isdisjoint(val) and len(train) + len(val) == 200
    assert 5 <= len(val) <= 40
    assert split_documents(list(reversed(docs)), "validation") == list(reversed(val))  # by key, not by order
    assert split_documents(docs, "all") == [t for _, t in docs]


def test_single_document_is_split_by_characters():
    text = "\n".join(f"line {i}" for i in range(100))
    train, val = split_documents([("a", text)], "train")[0], split_documents([("a", text)], "validation")[0]
    assert train + val == text and 0.05 < len(val) / len(text) < 0.15


def test_local_sources(tmp_path):
    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    pq.write_table(pa.table({"text": ["row one", "row two"], "id": [1, 2]}), tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("x,y")
    assert load_texts(str(tmp_path), "all") == ["plain text file", "first", "second", "row one", "row two"]
    assert load_texts(str(tmp_path / "b.jsonl"), "all") == ["first", "second"]


@pytest.mark.parametrize("content,message", [("not json\n", "not valid JSON"), ('{"body": "x"}\n', 'field "text"')])
def test_bad_jsonl(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_texts(str(path), "all")


def test_bad_sources(tmp_path):
    with pytest.raises(UserError, match="neither"):
        check_source(str(tmp_path / "missing.txt"))
    (tmp_path / "table.csv").write_text("a,b")
    with pytest.raises(UserError, match="not a .txt"):
        check_source(str(tmp_path / "table.csv"))
    with pytest.raises(UserError, match="hf:NAME"):
        check_source("hf:")
    with pytest.raises(UserError, match="unknown split"):
        load_texts("wiki-sample", "test")


def test_token_blocks_pack_documents_with_eos(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"The quick brown fox {i}."}) + "\n" for i in range(40)))
    blocks = token_blocks(str(path), tokenizer, seq_len=16, num_blocks=3, split="all", seed=1)
    assert blocks.shape == (3, 16) and blocks.dtype == torch.long
    assert (blocks == tokenizer.eos_token_id).sum() >= 3
    again = token_blocks(str(path), tokenizer, seq_len=16, num_blocks=3, split="all", seed=1)
    assert torch.equal(blocks, again)
    everything = token_blocks(str(path), tokenizer, seq_len=16, split="all")
    assert everything.shape[0] > 3


def test_blocks_start_with_the_bos_a_tokenizer_puts_first(tokenizer, tmp_path):
    """A tokenizer that leads every text with its BOS (Gemma's) gets blocks led by it and its text after, the same
    stream as a tokenizer without one; `dofattn eval`'s blocks of a plain file and the recall prompts too."""
    from dofattn.jobs.eval import text_blocks
    from dofattn.recall import RecallTasks

    bos = tiny_bos_tokenizer()
    assert leading_tokens(tokenizer) == [] and leading_tokens(bos) == [bos.bos_token_id]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"The quick brown fox {i}."}) + "\n" for i in range(40)))
    plain = token_blocks(str(path), tokenizer, seq_len=16, num_blocks=3, split="all", seed=1)
    led = token_blocks(str(path), bos, seq_len=17, num_blocks=3, split="all", seed=1)
    assert led.shape == (3, 17) and (led[:, 0] == bos.bos_token_id).all()
    assert torch.equal(led[:, 1:], plain) and (plain != bos.bos_token_id).all()
    text = tmp_path / "notes.txt"
    text.write_text(TEXT)
    parts, unled = text_blocks(str(text), bos, 33), text_blocks(str(text), tokenizer, 32)
    assert all((p[:, 0] == bos.bos_token_id).all() for p in parts)
    assert torch.equal(torch.cat([p[:, 1:].flatten() for p in parts]), torch.cat([p.flatten() for p in unled]))
    prompt = RecallTasks(bos, [TEXT] * 4).prompt("multikey", 500, 0.5, 0)
    plain_prompt = RecallTasks(tokenizer, [TEXT] * 4).prompt("multikey", 500, 0.5, 0)
    assert prompt.ids[0] == bos.bos_token_id and len(prompt.ids) + len(prompt.answer) == 500
    assert prompt.ids[prompt.needle_at:prompt.needle_at + 5] == plain_prompt.ids[plain_prompt.needle_at:][:5]


def test_too_little_text_says_how_much_there_is(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("The quick brown fox.")
    with pytest.raises(UserError, match=r"has \d+ tokens = 0 blocks of 64.*10 blocks of 64 tokens"):
        token_blocks(str(path), tokenizer, seq_len=64, num_blocks=10, split="all")


# --- lazy documents against the eager reader they replaced ------------------------------------------------------

def eager_documents(path: Path) -> list[tuple[str, str]]:
    """The documents of a .jsonl or .parquet file as the eager reader read them: all texts in a list."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        texts = [row["text"] for row in rows]
    else:
        texts = [t for t in pq.read_table(path).column("text").to_pylist() if isinstance(t, str)]
    return [(f"{path.name}:{i}", text) for i, text in enumerate(texts) if text.strip()]


def eager_blocks(texts: list[str], tokenizer, seq_len: int, num_blocks: int | None, seed: int) -> torch.Tensor:
    """The eager packing: the list of texts shuffled, tokenized in order until it holds num_blocks blocks."""
    texts = list(texts)
    random.Random(seed).shuffle(texts)
    ids = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if num_blocks is not None and len(ids) >= num_blocks * seq_len:
            break
    n = num_blocks or len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


WORDS = TEXT.split()


def corpus_texts(count: int, seed: int = 0) -> list:
    """Texts of 3 to 60 words, with empty, whitespace-only and missing ones mixed in."""
    rng = random.Random(seed)
    odd = ["", "   ", "\n\t", "\u3000\x1c", None]
    return [odd[i % 5] if i % 7 == 3 else " ".join(rng.choices(WORDS, k=rng.randint(3, 60))) + f" {i}."
            for i in range(count)]


@pytest.fixture
def hf_dataset(tmp_path, monkeypatch):
    """A dataset saved to disk, which `datasets.load_dataset` gives back memory-mapped, for any name and split."""
    datasets = pytest.importorskip("datasets")

    def save(texts: list, name: str = "ds") -> str:
        datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))}).save_to_disk(tmp_path / name)
        return str(tmp_path / name)

    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None: datasets.load_from_disk(name))
    return save


def test_arrow_whitespace_is_pythons():
    """Empty documents are found in Arrow, without a Python string per document: it must strip what
    `str.strip` strips, for every code point."""
    chars = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF]
    arrow_empty = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(pa.array(chars))), 0).to_pylist()
    assert arrow_empty == [not c.strip() for c in chars]


@pytest.mark.parametrize("seq_len,num_blocks,seed", [(16, 5, 0), (32, 3, 7), (24, None, 1)])
def test_hf_blocks_equal_the_eager_readers(tokenizer, hf_dataset, seq_len, num_blocks, seed):
    texts = corpus_texts(120)
    spec = "hf:" + hf_dataset(texts)
    eager = [t for t in texts if isinstance(t, str) and t.strip()]    # the eager reader's list of the column
    assert len(eager) < len(texts)
    for split in ("train", "all"):
        blocks = token_blocks(spec, tokenizer, seq_len, num_blocks, split=split, seed=seed)
        assert torch.equal(blocks, eager_blocks(eager, tokenizer, seq_len, num_blocks, seed))
    assert load_texts(spec, "validation") == eager


@pytest.mark.parametrize("split", ["train", "validation", "all"])
def test_local_blocks_equal_the_eager_readers(tokenizer, tmp_path, monkeypatch, split):
    """A folder of a .jsonl and a .parquet file with empty and missing texts (its row groups of 16 rows looked at 5
    rows at a time), and a file of one document."""
    monkeypatch.setattr("dofattn.data.PASS_ROWS", 5)
    texts = corpus_texts(150, seed=1)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" + "\n" * (i % 11 == 0)
                                              for i, t in enumerate(texts[:80]) if t is not None))
    pq.write_table(pa.table({"text": texts[80:], "n": list(range(70))}), tmp_path / "b.parquet",
                   row_group_size=16)
    docs = eager_documents(tmp_path / "a.jsonl") + eager_documents(tmp_path / "b.parquet")
    want = split_documents(docs, split)
    assert load_texts(str(tmp_path), split) == want
    for num_blocks in (4, None):
        blocks = token_blocks(str(tmp_path), tokenizer, 16, num_blocks, split=split, seed=3)
        assert torch.equal(blocks, eager_blocks(want, tokenizer, 16, num_blocks, 3))
    one = tmp_path / "one.jsonl"              # a single document is split by characters
    one.write_text(json.dumps({"text": "\n".join(texts[:40:7])}) + "\n" + json.dumps({"text": " "}) + "\n")
    assert load_texts(str(one), split) == split_documents(eager_documents(one), split)


def test_files_that_are_not_text_are_refused_in_one_line(tmp_path):
    cases = {"latin1.txt": (b"caf\xe9 au lait", "latin1.txt is not UTF-8 text (byte 0xe9 at 3)"),
             "nul.txt": (b"text\0with a NUL", "nul.txt holds NUL bytes"),
             "random.parquet": (bytes(range(256)), "random.parquet is not a Parquet file")}
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError) as error:
            load_texts(str(tmp_path / name), "all")
        assert message in str(error.value) and "\n" not in str(error.value), error.value


def test_bad_utf8_in_jsonl_is_one_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"text": "ok"}).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin1.jsonl:2 is not UTF-8"):
        load_texts(str(path), "all")


@pytest.mark.parametrize("source", ["hf", "jsonl"])
def test_only_the_documents_tokenized_are_held_as_python_strings(tokenizer, hf_dataset, tmp_path, source):
    """2000 documents of 5000 characters (10 MB); a few blocks need a handful. The Python memory at its peak stays
    far below the text's size, where reading every text into a list exceeds it."""
    texts = [(" ".join(WORDS) * 9)[:4990] + f" {i:04d}" for i in range(2000)]
    if source == "hf":
        spec = "hf:" + hf_dataset(texts)
    else:
        spec = str(tmp_path / "big.jsonl")
        Path(spec).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    calls = []

    def counting(text, **kwargs):
        if text != LEAD_PROBE:                  # documents, not the look for a BOS (data.leading_tokens)
            calls.append(text)
        return tokenizer(text, **kwargs)
    counting.eos_token_id = tokenizer.eos_token_id

    size = sum(len(t) for t in texts)
    tracemalloc.start()
    try:
        blocks = token_blocks(spec, counting, 64, 4, split="all")
        lazy = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        eager = load_texts(spec, "all")
        whole = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert blocks.shape == (4, 64) and len(eager) == 2000
    assert len(calls) <= 2                      # a document holds more than 64 x 4 tokens
    assert whole > size and lazy < size / 10, (lazy, whole, size)


SCRIPT = """
import json, sys
import datasets
import torch
from dofattn.data import LEAD_PROBE, token_blocks
from dofattn.distill.world import join, world
from tests.conftest import tiny_tokenizer

datasets.load_dataset = lambda name, config=None, split=None: datasets.load_from_disk(name)
spec, out = sys.argv[1], sys.argv[2]
join("cpu")
rank = world()[0]
tokenizer = tiny_tokenizer()
calls = []

def counting(text, **kwargs):
    if text != LEAD_PROBE:
        calls.append(text)
    return tokenizer(text, **kwargs)
counting.eos_token_id = tokenizer.eos_token_id

result = {}
for name, seq_len, num_blocks in (("some", 32, 400), ("every", 24, None)):
    calls.clear()
    blocks = token_blocks(spec, counting, seq_len, num_blocks, split="train", seed=5, share=world())
    result[name] = {"blocks": blocks.tolist(), "calls": len(calls)}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
"""


def test_two_gloo_processes_tokenize_their_shares_into_one_processs_blocks(tokenizer, hf_dataset, tmp_path):
    """A pool of a Hugging Face dataset and a local file: 400 blocks (about 120 documents), and every block."""
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(90, 2)
                                                 if t is not None))
    spec = "hf:" + hf_dataset(corpus_texts(300)) + "+" + str(tmp_path / "more.jsonl")
    alone = {}
    for name, seq_len, num_blocks in (("some", 32, 400), ("every", 24, None)):
        calls = []

        def counting(text, **kwargs):
            if text != LEAD_PROBE:
                calls.append(text)
            return tokenizer(text, **kwargs)
        counting.eos_token_id = tokenizer.eos_token_id
        alone[name] = (token_blocks(spec, counting, seq_len, num_blocks, split="train", seed=5),
                       len(calls))
    script = tmp_path / "blocks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           spec, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name, (blocks, calls) in alone.items():
        for rank in ranks:
            assert torch.equal(torch.tensor(rank[name]["blocks"]), blocks), name
        shares = [rank[name]["calls"] for rank in ranks]
        # each about half of what one process tokenizes; at most one round's surplus beyond
        assert sum(shares) >= calls and max(shares) <= calls / 2 + FIRST_ROUND, (name, shares, calls)
    assert sum(rank["every"]["calls"] for rank in ranks) == alone["every"][1]     # every document once


def test_a_hub_dataset_offline_and_not_cached_is_refused_before_any_model(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from dofattn.model import hf

    monkeypatch.setattr(hf, "_hub_reachable", lambda *a: False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with pytest.raises(UserError, match="hf:someone/nothing: dataset someone/nothing is not in the Hugging Face"):
        check_source("hf:someone/nothing")
    (tmp_path / "hub" / "datasets--someone--nothing").mkdir(parents=True)
    check_source("hf:someone/nothing")                                     # fetched before: the run reads it
