"""What a plan measured, kept: a second `distill --dry-run` of the same recipe on the same model shape reads it.

    step = kept("step", {"recipe": recipe, "config": config}, lambda: measure(...))   # computed once, then read

A plan counts bytes and FLOPs on fake tensors (tens of seconds) and times this machine (seconds more); the answers
depend only on what they were asked (the recipe, the model's config, the shapes), on dofattn's own code and on the
torch and transformers that ran them (`code_version`), and, for timings, on the machine (`machine`). Each answer is
kept in `cache_dir()/plans/KIND-HASH.json` under the hash of all of that, so a change of code, library, recipe,
model or machine is a new key and is measured again. `DOFATTN_PLAN_CACHE=off` turns keeping off; set to a folder,
it keeps there instead (the tests keep in a folder of their session's); `distill --dry-run --recalibrate` times the
machine again. Values are JSON: numbers, lists and dicts.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

_CODE: str | None = None


def enabled() -> bool:
    """Whether answers are kept and read (`DOFATTN_PLAN_CACHE`: off, 0 or no turns it off)."""
    return os.environ.get("DOFATTN_PLAN_CACHE", "on").strip().lower() not in ("off", "0", "no", "false")


def folder(kind: str = "plans") -> Path:
    """Where answers of `kind` are kept: `cache_dir()/KIND`, or KIND in the folder `DOFATTN_PLAN_CACHE` names."""
    value = os.environ.get("DOFATTN_PLAN_CACHE", "on").strip()
    if value.lower() not in ("on", "1", "yes", "true", ""):
        return Path(value).expanduser() / kind
    from dofattn.assets import cache_dir

    return cache_dir() / kind


def code_version() -> str:
    """A hash of dofattn's own source files and the torch and transformers versions: what computed an answer."""
    global _CODE
    if _CODE is None:
        import torch
        import transformers

        digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
        root = Path(__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        _CODE = digest.hexdigest()[:16]
    return _CODE


def machine(device: str) -> dict:
    """What a timing depends on beyond the code: the device, the CPU's model and its cores (the GPU's name on CUDA)."""
    import platform

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    found = {"device": str(device), "cpu": cpu, "cores": len(os.sched_getaffinity(0))
             if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    if str(device).startswith("cuda"):
        import torch

        found["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return found


def _path(kind: str, key) -> Path:
    text = json.dumps({"kind": kind, "code": code_version(), "key": key}, sort_keys=True, default=_plain)
    return folder() / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def _plain(obj):
    """JSON for what a key holds: dataclasses as dicts, a transformers config as its dict, dtypes by name."""
    import dataclasses

    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)


def kept_with_date(kind: str, key, compute: Callable[[], object], keep: bool = True,
                   fresh: bool = False) -> tuple[object, str | None]:
    """(the answer to `key`, the date it was kept, or None when computed now). `compute()` runs when nothing is kept
    (or `fresh`); its answer is kept if `keep` (a timing made with other work on the cores is not)."""
    if not enabled():
        return compute(), None
    path = _path(kind, key)
    if not fresh and path.is_file():
        try:
            stored = json.loads(path.read_text())
            return stored["value"], stored["date"]
        except (OSError, ValueError, KeyError):
            pass                                        # damaged: measured again, and written over
    value = compute()
    if keep:
        from dofattn.io import write_json

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, {"kind": kind, "date": datetime.date.today().isoformat(), "value": value})
        except OSError:
            pass                                        # a cache that cannot be written is only slower
    return value, None


def kept(kind: str, key, compute: Callable[[], object], keep: bool = True, fresh: bool = False):
    """The answer to `key`: kept from an earlier plan, or `compute()`d now and kept (`kept_with_date`)."""
    return kept_with_date(kind, key, compute, keep, fresh)[0]
