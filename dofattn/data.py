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
"""

from __future__ import annotations

import bz2
import hashlib
import json
import random
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dofattn.assets import GENSIM, cache_dir, wheel_member
from dofattn.errors import UserError
from dofattn.io import atomic_path

WIKI_SAMPLE = "wiki-sample"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
SPLITS = ("train", "validation", "all")
VALIDATION_EVERY = 10  # about one document in VALIDATION_EVERY goes to validation
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")

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


# --- local files and Hugging Face datasets -----------------------------------------------------------------------

def _file_documents(path: Path) -> list[str]:
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8", errors="replace")]
    if path.suffix == ".jsonl":
        texts = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{path}:{n} is not valid JSON ({err.msg}); each line must be an object "
                                    f"with a \"text\" field") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise UserError(f"{path}:{n} has no string field \"text\"; each line must be an object "
                                    f"with a \"text\" field")
                texts.append(row["text"])
        return texts
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise UserError(f"{path} has no column \"text\" (columns: {', '.join(table.column_names)})")
        return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
    raise UserError(f"{path} is not a .txt, .jsonl or .parquet file")


def local_documents(path: Path) -> list[Document]:
    """Documents of a local file or folder, keyed by file name and position."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise UserError(f"folder {path} holds no .txt, .jsonl or .parquet files")
    else:
        files = [path]
    return [(f"{f.name}:{i}", text) for f in files for i, text in enumerate(_file_documents(f)) if text.strip()]


def _hf_texts(spec: str, split: str) -> list[str]:
    check_source(spec)
    name, config, hf_split = (spec[len("hf:"):].split(":") + [None, None])[:3]
    if hf_split is None:
        hf_split = "train" if split == "all" else split
    try:
        import datasets
    except ImportError:
        raise UserError("hf: datasets need the `datasets` package; pip install 'dofattn[hf]'") from None
    try:
        ds = datasets.load_dataset(name, config or None, split=hf_split)
    except Exception as err:  # network, unknown name, unknown split: all surface as one line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"cannot load dataset {spec!r} split {hf_split!r}: {first}") from None
    if "text" not in ds.column_names:
        raise UserError(f"dataset {spec!r} has no column \"text\" (columns: {', '.join(ds.column_names)})")
    return [t for t in ds["text"] if isinstance(t, str) and t.strip()]


# --- splits and packing -------------------------------------------------------------------------------------------

def split_documents(docs: list[Document], split: str) -> list[str]:
    """The texts of `docs` that belong to `split` (see the module docstring)."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
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
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"data {spec!r} is neither {WIKI_SAMPLE!r}, an existing file or folder, nor hf:NAME")
    if path.is_file() and path.suffix not in TEXT_SUFFIXES:
        raise UserError(f"data file {spec} is not a .txt, .jsonl or .parquet file")


def load_texts(spec: str, split: str = "train") -> list[str]:
    """The documents of data source `spec` (see the module docstring) in `split`, in source order."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    parts = sources(spec)
    if len(parts) > 1:
        check_source(spec)
        return [text for part in parts for text in load_texts(part, split)]
    if spec == WIKI_SAMPLE:
        return split_documents(wiki_sample(), split)
    if spec.startswith("hf:"):
        return _hf_texts(spec, split)
    check_source(spec)
    return split_documents(local_documents(Path(spec).expanduser()), split)


def _token_stream(texts: Iterable[str], tokenizer, eos_id: int | None) -> Iterator[list[int]]:
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        yield ids + ([eos_id] if eos_id is not None else [])


def token_blocks(spec: str, tokenizer, seq_len: int, num_blocks: int | None = None, split: str = "train",
                 seed: int = 0) -> torch.Tensor:
    """Documents of `spec` shuffled with `seed`, tokenized, joined by EOS and cut into blocks [N, seq_len].

    Only as much text as `num_blocks` needs is tokenized; `num_blocks=None` takes every full block.
    """
    if seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, got {seq_len}")
    if num_blocks is not None and num_blocks < 1:
        raise UserError(f"the number of blocks must be at least 1, got {num_blocks}")
    texts = load_texts(spec, split)
    random.Random(seed).shuffle(texts)
    want = None if num_blocks is None else num_blocks * seq_len
    ids: list[int] = []
    for doc in _token_stream(texts, tokenizer, tokenizer.eos_token_id):
        ids.extend(doc)
        if want is not None and len(ids) >= want:
            break
    have = len(ids) // seq_len
    if have == 0 or (num_blocks is not None and have < num_blocks):
        asked = f"{num_blocks} blocks of {seq_len} tokens" if num_blocks else f"one block of {seq_len} tokens"
        raise UserError(f"{spec} ({split} split) has {len(ids)} tokens = {have} blocks of {seq_len}, but "
                        f"{asked} were asked for; use fewer or shorter blocks, or more text")
    n = have if num_blocks is None else num_blocks
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
