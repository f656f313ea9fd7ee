"""Wikitext cleaning, dump parsing, splits, local sources and packing into token blocks."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dofattn.data import (check_source, clean_wikitext, load_texts, local_documents, parse_wiki_dump,
                          split_documents, token_blocks)
from dofattn.errors import UserError

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
    assert [t for _, t in local_documents(tmp_path)] == ["plain text file", "first", "second", "row one", "row two"]
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


def test_too_little_text_says_how_much_there_is(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("The quick brown fox.")
    with pytest.raises(UserError, match=r"has \d+ tokens = 0 blocks of 64.*10 blocks of 64 tokens"):
        token_blocks(str(path), tokenizer, seq_len=64, num_blocks=10, split="all")
