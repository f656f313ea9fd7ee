"""Text sources and packing into fixed-length token blocks.

    blocks = token_blocks("wiki-sample", tokenizer, seq_len=256, num_blocks=16, split="train")  # [16, 256]

Sources (`--data`):
- `wiki-sample` (default): the Wikipedia pages shipped in the gensim wheel. Wikitext markup is stripped with
  mwparserfromhell, redirects, non-article namespaces and empty pages are dropped; the cleaned articles are
  cached as JSON lines.
- a local `.txt` file (one document), `.jsonl` file (one document per line, field `text`), `.parquet` file
  (column `text`), or a folder of such files (one source, files in name order).
- `hf:NAME[:CONFIG[:SPLIT]]`: a Hugging Face dataset through `datasets` (needs a network); column `text`.
- several of these joined by `+` (`wiki-sample+teacher.jsonl`): their documents pooled, each split within its own
  source, so the pool's validation split is the union of the sources' validation splits.

Splits: documents are assigned to `validation` by a hash of their title (or of their position in the source),
about one in ten, so the split is deterministic and does not move when documents are added. A source with a
single document is split by characters instead: its last tenth (from a line break) is the validation text.
`split="all"` takes everything. For `hf:` sources, SPLIT names the dataset split used whole; without it,
`train` and `validation` map to the dataset's splits of those names.

Reading: a document is read when it is tokenized, and only as many as the blocks need. An `hf:` dataset stays in
its memory-mapped Arrow files and a .parquet file's column `text` in Arrow memory: one pass over the column finds
the non-empty texts without making a Python string of each. A .jsonl file is read once to check every line and note
where each text starts. `.txt` files and the built-in sample are read whole. With `share=(rank, size)`, every process of
a torchrun group tokenizes a share of the documents and the processes gather the tokens, so all end with the blocks
one process makes alone.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import math
import random
import re
import xml.etree.ElementTree as ET
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from dofattn.assets import GENSIM, cache_dir, wheel_member
from dofattn.errors import UserError
from dofattn.io import atomic_path

WIKI_SAMPLE = "wiki-sample"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
SPLITS = ("train", "validation", "all")
VALIDATION_EVERY = 10  # about one document in VALIDATION_EVERY goes to validation
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")

if TYPE_CHECKING:
    import pyarrow as pa

PASS_ROWS = 4096  # rows of an Arrow column looked at together when finding its non-empty texts
FIRST_ROUND = 8  # documents per process in the first round of a tokenization shared by the processes
Document = tuple[str, str]  # (key, text): the key decides the split


def _is_validation(key: str) -> bool:
    return hashlib.sha1(key.encode()).digest()[0] % VALIDATION_EVERY == 0


# --- Wikipedia --------------------------------------------------------------------------------------------------

_REDIRECT = re.compile(r"^\s*#redirect", re.IGNORECASE)
_LINK_NAMESPACES = ("file:", "image:", "category:", "media:")
_BLANK_LINES = re.compile(r"\n{3,}")


def clean_wikitext(wikitext: str) -> str:
    """Plain prose from wikitext: templates, tables, references, files, categories and markup removed."""
    import mwparserfromhell

    code = mwparserfromhell.parse(wikitext)
    for node in code.filter_wikilinks(recursive=False):
        if str(node.title).strip().lower().startswith(_LINK_NAMESPACES):
            code.remove(node)
    for tag in code.filter_tags(recursive=False):
        if str(tag.tag).lower() in ("ref", "table", "gallery", "math", "references", "timeline"):
            code.remove(tag)
    text = code.strip_code(normalize=True, collapse=True, keep_template_params=False)
    lines = []
    for line in text.splitlines():
        line = line.strip()
        # strip_code leaves heading text and list lines; drop orphaned table/markup debris
        if line.startswith(("{|", "|", "!", "{{", "}}")):
            continue
        lines.append(line)
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def parse_wiki_dump(stream) -> Iterator[Document]:
    """(title, clean text) for each main-namespace article in a MediaWiki XML export; redirects are skipped."""
    title = namespace = None
    redirect = False
    for _, elem in ET.iterparse(stream, events=("end",)):
        tag = elem.tag.rsplit("}", 1)[-1]
        if tag == "title":
            title = elem.text or ""
        elif tag == "ns":
            namespace = (elem.text or "").strip()
        elif tag == "redirect":
            redirect = True
        elif tag == "text":
            wikitext = elem.text or ""
            if namespace == "0" and not redirect and not _REDIRECT.match(wikitext):
                text = clean_wikitext(wikitext)
                if text:
                    yield title, text
        elif tag == "page":
            title = namespace = None
            redirect = False
            elem.clear()


def wiki_sample() -> list[Document]:
    """The built-in Wikipedia sample, cleaned once and cached."""
    cached = cache_dir() / "data" / "wiki-sample.jsonl"
    if not cached.is_file():
        dump = wheel_member(GENSIM, WIKI_MEMBER)
        with bz2.open(dump, "rb") as stream:
            docs = list(tqdm(parse_wiki_dump(stream), desc="cleaning wiki-sample (once)", unit="article"))
        cached.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cached) as tmp, open(tmp, "w") as f:
            for title, text in docs:
                f.write(json.dumps({"title": title, "text": text}) + "\n")
    with open(cached) as f:
        return [(row["title"], row["text"]) for row in map(json.loads, f)]


# --- lazy documents ----------------------------------------------------------------------------------------------

class Texts(Sequence[str]):
    """Documents read one at a time: document i is `read(rows[i])`, read when it is asked for."""

    def __init__(self, read: Callable[[int], str], rows: np.ndarray):
        self.read, self.rows = read, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> str:
        return self.read(int(self.rows[i]))

    def __iter__(self) -> Iterator[str]:
        return (self.read(int(row)) for row in self.rows)

    def select(self, keep: np.ndarray) -> Texts:
        """The documents where the boolean array `keep` is true, in order."""
        return Texts(self.read, self.rows[keep])


class Pool(Sequence[str]):
    """Several sequences of documents as one, in order."""

    def __init__(self, parts: list[Sequence[str]]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> str:
        part = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[part][i - int(self.starts[part])]

    def __iter__(self) -> Iterator[str]:
        return (text for part in self.parts for text in part)


def _strings(piece: pa.Array) -> pa.Array | None:
    """`piece` as an Arrow string array, or None where its values are not strings."""
    import pyarrow as pa

    if pa.types.is_dictionary(piece.type):
        piece = piece.dictionary_decode()
    if str(piece.type) == "string_view":
        piece = piece.cast(pa.large_string())
    return piece if pa.types.is_string(piece.type) or pa.types.is_large_string(piece.type) else None


def _arrow_texts(column: pa.ChunkedArray) -> tuple[Texts, np.ndarray]:
    """The strings of an Arrow column that are not empty or whitespace, read from the column (memory-mapped or in
    memory) one at a time, and each one's position among the column's strings. The pass that finds them goes
    PASS_ROWS rows at a time in Arrow and makes no Python string: Arrow's whitespace is `str.strip`'s (a test
    checks every code point)."""
    import pyarrow.compute as pc

    rows, positions, seen, strings = [], [], 0, 0
    for chunk in column.chunks:
        for start in range(0, len(chunk), PASS_ROWS):
            piece = _strings(chunk.slice(start, PASS_ROWS))
            if piece is not None:
                valid = piece.is_valid().to_numpy(zero_copy_only=False)
                full = pc.fill_null(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(piece)), 0), False)
                keep = np.flatnonzero(full.to_numpy(zero_copy_only=False))
                rows.append(keep + seen + start)
                positions.append(np.cumsum(valid)[keep] - 1 + strings)
                strings += int(valid.sum())
        seen += len(chunk)
    rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    positions = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    return Texts(lambda row: column[row].as_py(), rows), positions


# --- local files and Hugging Face datasets -----------------------------------------------------------------------

def _jsonl_texts(path: Path) -> tuple[Texts, np.ndarray]:
    """A pass over a JSON-lines file that checks every line and keeps the byte offset of each non-empty text; the
    texts are read back by offset."""
    offsets, positions, position, offset = [], [], 0, 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{path}:{n} is not UTF-8 ({err.reason}); save the file as UTF-8") from None
            if not line.strip():
                continue
            text = _jsonl_text(line, path, n)
            if text.strip():
                offsets.append(start)
                positions.append(position)
            position += 1

    def read(start: int) -> str:
        with open(path, "rb") as f:
            f.seek(start)
            return json.loads(f.readline().decode("utf-8"))["text"]

    return Texts(read, np.array(offsets, dtype=np.int64)), np.array(positions, dtype=np.int64)


def _jsonl_text(line: str, path: Path, n: int) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{n} is not valid JSON ({err.msg}); each line must be an object "
                        f"with a \"text\" field") from None
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise UserError(f"{path}:{n} has no string field \"text\"; each line must be an object "
                        f"with a \"text\" field")
    return row["text"]


def _file_texts(path: Path) -> tuple[Texts, np.ndarray]:
    """The non-empty documents of one file, read lazily, and each one's position among the file's documents (its
    split key is `NAME:POSITION`). A .txt file is one document; a .parquet file's column `text` is read into Arrow
    memory (no other column, no Python strings)."""
    if path.suffix == ".txt":
        def read(_: int) -> str:
            return path.read_text(encoding="utf-8")
        try:
            text = read(0)
        except UnicodeDecodeError as err:
            raise UserError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at {err.start}); a .txt "
                            f"file is read as UTF-8: save it so, or give a .jsonl or .parquet file") from None
        if "\0" in text:
            raise UserError(f"{path} holds NUL bytes: a binary file, not text")
        rows = np.arange(1 if text.strip() else 0)
        return Texts(read, rows), rows
    if path.suffix == ".jsonl":
        return _jsonl_texts(path)
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except pyarrow.ArrowInvalid as err:
            raise UserError(f"{path} is not a Parquet file ({str(err).split('.')[0]}); give a .parquet file "
                            f"with a \"text\" column, or a .txt or .jsonl file") from None
        if "text" not in names:
            raise UserError(f"{path} has no column \"text\" (columns: {', '.join(names)})")
        return _arrow_texts(pq.read_table(path, columns=["text"]).column("text"))
    raise UserError(f"{path} is not a .txt, .jsonl or .parquet file")


def _local_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise UserError(f"folder {path} holds no .txt, .jsonl or .parquet files")
    return files


def _local_texts(path: Path, split: str) -> Sequence[str]:
    """The documents of a local file or folder in `split`, read lazily (see `split_documents`)."""
    files = [(f, *_file_texts(f)) for f in _local_files(path)]
    if split == "all":
        return Pool([texts for _, texts, _ in files])
    if sum(len(texts) for _, texts, _ in files) == 1:
        return split_documents([("", next(text for _, texts, _ in files for text in texts))], split)
    want_validation = split == "validation"
    return Pool([texts.select(np.array([_is_validation(f"{f.name}:{i}") == want_validation for i in positions],
                                       dtype=bool))
                 for f, texts, positions in files])


def _hf_texts(spec: str, split: str) -> Texts:
    """The non-empty texts of a Hugging Face dataset's split, read one at a time from its memory-mapped Arrow
    table."""
    check_source(spec)
    name, config, hf_split = (spec[len("hf:"):].split(":") + [None, None])[:3]
    if hf_split is None:
        hf_split = "train" if split == "all" else split
    try:
        import datasets
    except ImportError:
        raise UserError("hf: datasets need the `datasets` package: pip install -e '.[hf]' in the dofattn "
                        "checkout") from None
    try:
        ds = datasets.load_dataset(name, config or None, split=hf_split)
    except Exception as err:  # network, unknown name, unknown split: all surface as one line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"cannot load dataset {spec!r} split {hf_split!r}: {first}") from None
    if "text" not in ds.column_names:
        raise UserError(f"dataset {spec!r} has no column \"text\" (columns: {', '.join(ds.column_names)})")
    return _arrow_texts(ds.data.column("text"))[0]


# --- splits and packing -------------------------------------------------------------------------------------------

def check_split(split: str, what: str = "split") -> None:
    """A one-line UserError unless `split` is one of SPLITS (`what`: how the message names it, e.g. "--split")."""
    if split not in SPLITS:
        raise UserError(f"unknown {what} {split!r}; use one of {', '.join(SPLITS)}")


def split_documents(docs: list[Document], split: str) -> list[str]:
    """The texts of `docs` that belong to `split` (see the module docstring)."""
    check_split(split)
    if split == "all":
        return [text for _, text in docs]
    if len(docs) == 1:
        text = docs[0][1]
        cut = text.rfind("\n", 0, len(text) * (VALIDATION_EVERY - 1) // VALIDATION_EVERY)
        cut = cut if cut > 0 else len(text) * (VALIDATION_EVERY - 1) // VALIDATION_EVERY
        return [text[:cut]] if split == "train" else [text[cut:]]
    want_validation = split == "validation"
    return [text for key, text in docs if _is_validation(key) == want_validation]


def sources(spec: str) -> list[str]:
    """The sources pooled in `spec`: its `+`-joined parts, unless `spec` names an existing file or folder whole."""
    if "+" not in spec or Path(spec).expanduser().exists():
        return [spec]
    parts = spec.split("+")
    if not all(parts):
        raise UserError(f"data {spec!r} has an empty part; join sources with single '+' signs, e.g. "
                        f"{WIKI_SAMPLE}+more.jsonl")
    return parts


def check_source(spec: str) -> None:
    """Fail early, before any model is loaded, on a data spec that cannot work."""
    parts = sources(spec)
    if len(parts) > 1:
        for part in parts:
            check_source(part)
        return
    if spec == WIKI_SAMPLE:
        return
    if spec.startswith("hf:"):
        parts = spec[len("hf:"):].split(":")
        if not parts[0] or len(parts) > 3:
            raise UserError(f"bad dataset spec {spec!r}; use hf:NAME[:CONFIG[:SPLIT]]")
        check_hf_reachable(spec, parts[0])
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"data {spec!r} is neither {WIKI_SAMPLE!r}, an existing file or folder, nor hf:NAME")
    if path.is_file() and path.suffix not in TEXT_SUFFIXES:
        raise UserError(f"data file {spec} is not a .txt, .jsonl or .parquet file")
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(f"data file {spec} is empty: give a file with text in it")


def hf_cached(name: str) -> bool:
    """Whether the Hugging Face dataset `name` has been fetched before (the hub's cache, or `datasets`' own)."""
    import os

    from huggingface_hub import constants

    hub = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}"
    own = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
    return hub.is_dir() or (own.is_dir() and any(own.glob(name.replace("/", "___") + "*")))


def check_hf_reachable(spec: str, name: str) -> None:
    """A one-line error for a hub dataset that is neither a local folder, nor cached, nor reachable (offline,
    `datasets` would fail only when the run reads its text, after the model loads)."""
    from dofattn.model.hf import _hub_reachable

    if not Path(name).expanduser().exists() and not hf_cached(name) and not _hub_reachable():
        raise UserError(f"--data {spec}: dataset {name} is not in the Hugging Face cache and the hub cannot be "
                        f"reached; run once with a network, or give a local .txt, .jsonl or .parquet file")


def texts(spec: str, split: str = "train") -> Sequence[str]:
    """The documents of data source `spec` (see the module docstring) in `split`, in source order, as a sequence
    that reads each document when it is asked for (the built-in sample is in memory)."""
    check_split(split)
    parts = sources(spec)
    if len(parts) > 1:
        check_source(spec)
        return Pool([texts(part, split) for part in parts])
    if spec == WIKI_SAMPLE:
        return split_documents(wiki_sample(), split)
    if spec.startswith("hf:"):
        return _hf_texts(spec, split)
    check_source(spec)
    return _local_texts(Path(spec).expanduser(), split)


def load_texts(spec: str, split: str = "train") -> list[str]:
    """The documents of data source `spec` in `split`, in source order, all in memory."""
    return list(texts(spec, split))


LEAD_PROBE = "a"      # the text `leading_tokens` tokenizes with and without the tokenizer's own special tokens


def leading_tokens(tokenizer) -> list[int]:
    """The special tokens `tokenizer` puts before a text of its own accord (Gemma's and Llama 3's BOS; none for
    SmolLM2's or GPT-2's): every block and prompt dofattn makes starts with them, as the model was trained to read.
    Gemma 3 270M without its BOS first: validation perplexity 66.8 instead of 25.2 (docs/log, 2026-12-04)."""
    marked = tokenizer(LEAD_PROBE)["input_ids"]
    plain = tokenizer(LEAD_PROBE, add_special_tokens=False)["input_ids"]
    for start in range(len(marked) - len(plain) + 1):
        if marked[start:start + len(plain)] == plain:
            return list(marked[:start])
    return []


def text_length(seq_len: int, lead: list[int]) -> int:
    """The text tokens of a block of `seq_len` led by `lead` (`leading_tokens`); at least one, else a UserError."""
    if seq_len - len(lead) < 1:
        raise UserError(f"--seq-len {seq_len} leaves no room for text after the tokenizer's {len(lead)} leading "
                        f"token(s); use --seq-len of at least {len(lead) + 2}")
    return seq_len - len(lead)


def led(blocks: torch.Tensor, lead: list[int]) -> torch.Tensor:
    """Blocks of text [N, t] with `lead` before each: [N, len(lead) + t] (the blocks themselves when it is empty)."""
    import torch

    if not lead:
        return blocks
    return torch.cat([torch.tensor(lead, dtype=blocks.dtype).expand(len(blocks), -1), blocks], 1)


def _encode(text: str, tokenizer, into: array) -> None:
    """The token ids of `text`, then EOS where the tokenizer has one, appended to `into`."""
    into.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        into.append(tokenizer.eos_token_id)


def _tokens_alone(docs: Sequence[str], order: array, tokenizer, want: int | None) -> array:
    """The token ids of `docs` in `order` (each followed by EOS), up to the document that brings them to `want`
    tokens (None: all)."""
    ids = array("q")
    for i in order:
        _encode(docs[i], tokenizer, ids)
        if want is not None and len(ids) >= want:
            break
    return ids


def _tokens_by_rank(docs: Sequence[str], order: array, tokenizer, want: int | None, rank: int, size: int) -> array:
    """`_tokens_alone`'s result on every process of the group, each process tokenizing a share: the documents go
    in rounds, document j of a round to process j mod size, and the processes gather each round's tokens. A round
    is sized to the tokens still wanted at the mean document length so far, at most twice the documents before it,
    so that at most one round's surplus is tokenized beyond what one process would."""
    import torch.distributed as dist

    ids, start, count = array("q"), 0, size * FIRST_ROUND
    while start < len(order) and (want is None or len(ids) < want):
        batch = order[start:start + count]
        mine, ends = array("q"), []
        for i in batch[rank::size]:
            _encode(docs[i], tokenizer, mine)
            ends.append(len(mine))
        shares: list = [None] * size
        dist.all_gather_object(shares, (ends, mine))
        for j in range(len(batch)):
            share_ends, share = shares[j % size]
            k = j // size
            ids.extend(share[share_ends[k - 1] if k else 0:share_ends[k]])
            if want is not None and len(ids) >= want:
                break
        start += len(batch)
        if want is not None and len(ids) < want:
            docs_wanted = math.ceil((want - len(ids)) * start / max(len(ids), 1))
            count = size * max(1, min(math.ceil(docs_wanted / size), math.ceil(2 * start / size)))
    return ids


def token_blocks(spec: str, tokenizer, seq_len: int, num_blocks: int | None = None, split: str = "train",
                 seed: int = 0, share: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Documents of `spec` shuffled with `seed`, tokenized, joined by EOS and cut into blocks [N, seq_len], each
    block led by the tokenizer's `leading_tokens` (its BOS, where it puts one first) and seq_len minus those of text.

    Only as much text as `num_blocks` needs is read and tokenized; `num_blocks=None` takes every full block. With
    `share` (this process's rank and the group's size, `distill.world.world()`) of a group of several, every
    process of the torchrun group calls this together: each tokenizes only its share of the documents, and all get
    the blocks one process makes alone.
    """
    import torch

    if seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, got {seq_len}")
    if num_blocks is not None and num_blocks < 1:
        raise UserError(f"the number of blocks must be at least 1, got {num_blocks}")
    lead = leading_tokens(tokenizer)
    text_len = text_length(seq_len, lead)
    docs = texts(spec, split)
    order = array("q", range(len(docs)))
    random.Random(seed).shuffle(order)      # the order a shuffled list of the documents would have
    want = None if num_blocks is None else num_blocks * text_len
    ids = (_tokens_by_rank(docs, order, tokenizer, want, *share) if share[1] > 1
           else _tokens_alone(docs, order, tokenizer, want))
    have = len(ids) // text_len
    if have == 0 or (num_blocks is not None and have < num_blocks):
        asked = f"{num_blocks} blocks of {seq_len} tokens" if num_blocks else f"one block of {seq_len} tokens"
        raise UserError(f"{spec} ({split} split) has {len(ids)} tokens = {have} blocks of {seq_len}, but "
                        f"{asked} were asked for; use fewer or shorter blocks, or more text")
    n = have if num_blocks is None else num_blocks
    return led(torch.frombuffer(ids, dtype=torch.long, count=n * text_len).clone().view(n, text_len), lead)
