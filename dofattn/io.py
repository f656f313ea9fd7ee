"""Files written whole or not at all (under a name of this process's own beside the target, then moved into place),
and safetensors files read whole or refused in one line.

    write_atomic(path, text_or_bytes)
    write_json(path, obj, indent=2)
    save_tensors(tensors, path, metadata)        # a safetensors file
    with atomic_path(path) as tmp:          # for other writers that take a path (a stream)
        ...
    tensors, metadata = read_safetensors(path)   # a UserError naming the file if it is missing or damaged
    check_safetensors(path)                      # the same check, reading only the header (a large file)

A reader never sees a half-written file, and two processes writing the same file at once each write a whole copy,
the one moved last staying. Every file gets the mode the user's umask gives a new file (the safetensors writer's
own is 0600).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open

from dofattn.errors import UserError


def staging(path: str | Path) -> Path:
    """This process's own name beside `path`, to write it under before moving it into place."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}.partial")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield the staging name of `path`; when the block ends without an error, move what was written there onto
    `path`, else remove it."""
    tmp = staging(path)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.chmod(tmp, 0o666 & ~umask())
    os.replace(tmp, path)


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """`tensors` as a safetensors file at `path`, whole or not at all; returns the path."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8, or bytes) to `path` whole; returns the path."""
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return Path(path)


def write_json(path: str | Path, obj, indent: int | None = None) -> Path:
    """`obj` as JSON (`json.dumps(obj, indent=indent)`) to `path` whole; returns the path."""
    return write_atomic(path, json.dumps(obj, indent=indent))


@contextmanager
def _safetensors(path: str | Path, device: str = "cpu"):
    """A safetensors file opened for reading; a one-line UserError naming the file if it is missing, truncated or not
    a safetensors file at all (instead of the reader's own traceback). The reader checks on opening that the header's
    tensors cover the file exactly."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is missing; copy it again, or rerun what wrote it")
    try:
        with safe_open(str(path), "pt", device=device) as f:
            yield f
    except SafetensorError as err:
        raise UserError(f"{path} is damaged ({err}): a truncated or partial copy? Copy it again, or rerun what wrote "
                        f"it") from None


def read_safetensors(path: str | Path, device: str = "cpu") -> tuple[dict, dict]:
    """(tensors, metadata) of a safetensors file, or the one-line UserError of `_safetensors`."""
    with _safetensors(path, device) as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}


def check_safetensors(path: str | Path) -> None:
    """The same one-line UserError as `read_safetensors` for a missing, truncated or foreign file, from its header
    alone; no tensor is read."""
    with _safetensors(path) as f:
        f.keys()


def check_output(path: str, what: str, suffixes: tuple[str, ...]) -> Path:
    """`path` as a file that can be written, with one of `suffixes` (its folder made if missing, as `export` makes
    its --out); a UserError naming option `what` if not."""
    out = Path(path)
    if out.suffix.lower() not in suffixes:
        raise UserError(f"{what} {path} should end in {' or '.join(suffixes)}")
    if out.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file name")
    check_parent(out, what)             # a missing folder is made when the file is written (`atomic_path`)
    return out


def new_name(path: str | Path, beside: tuple[str, ...] = ()) -> Path:
    """`path`, or where it is taken the first free `STEM-2.SUFFIX`, `STEM-3.SUFFIX`, ... (free with each of the
    `beside` suffixes too: a figure written next to it): where a command names its result itself, so that an
    earlier one is never replaced without being asked (an explicit --out is)."""
    path = Path(path)
    for n in itertools.count(1):
        name = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
        if not any(p.exists() for p in (name, *(name.with_suffix(s) for s in beside))):
            return name


def check_parent(path: Path, what: str) -> None:
    """A UserError naming option `what` unless `path`'s folder exists or can be made: its nearest existing
    ancestor is a folder one can write in."""
    at = Path(path).absolute().parent
    while not at.exists():
        at = at.parent
    if not at.is_dir():
        raise UserError(f"{what} {path}: {at} is a file, not a folder")
    check_writable(at, what)


def check_writable(folder: Path, what: str) -> None:
    """A UserError naming option `what` unless a file can be made in `folder` (tried with a temporary file, gone at
    once), so that a long computation is not lost at its end."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UserError(f"{what}: cannot write in {folder} ({err.strerror or err}); give a folder you can "
                        f"write") from None
