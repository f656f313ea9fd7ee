"""Is every packaged recipe's student unchanged by a change of the code? Train each one shrunk, then compare.

    python3 scripts/same_student.py train OUT [RECIPE ...]   # every packaged recipe, or those named
    python3 scripts/same_student.py compare OLD NEW          # every saved tensor, bit for bit

Run `train` once on the commit before a change (a `git worktree`, with PYTHONPATH on its tree) and once after it;
`compare` exits 1 on the first recipe whose saved tensors or spec differ. The shrunk run keeps each recipe's
student (features, window, sink, decay, kept layers, LoRA) and cuts its lengths and steps, so that all recipes
train in a few minutes of a 2-core CPU. `--full` trains the recipe as packaged (the full job: minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SHRINK = ["student.dims=fix:16", "layerwise.steps=4", "layerwise.blocks=4", "layerwise.seq_len=128",
          "end_to_end.steps=3", "end_to_end.seq_len=128", "end_to_end.blocks=4", "end_to_end.cooldown_steps=0",
          "end_to_end.eval_every=0", "eval.blocks=1", "eval.seq_len=128"]


def recipes() -> list[str]:
    folder = Path(__file__).resolve().parent.parent / "dofattn" / "recipes"
    return sorted(p.stem for p in folder.glob("*.toml"))


def train(out: Path, names: list[str], full: bool) -> None:
    for name in names or recipes():
        sets = [] if full else [a for s in SHRINK for a in ("--set", s)]
        cmd = [sys.executable, "-m", "dofattn", "distill", "--recipe", name, "--out", str(out / name), *sets]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "TQDM_DISABLE": "1"})


def compare(old: Path, new: Path) -> int:
    from safetensors.torch import load_file
    import torch

    bad = 0
    for run in sorted(p for p in old.iterdir() if p.is_dir()):
        other = new / run.name
        a, b = load_file(str(run / "features.safetensors")), load_file(str(other / "features.safetensors"))
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        ppl = [json.loads((r / "log.json").read_text())["evaluation"]["student_ppl"] for r in (run, other)]
        print(f"{run.name:14s} {len(a):4d} tensors {'identical' if same else 'DIFFER'}  ppl {ppl[0]!r} {ppl[1]!r}")
        if not same:
            bad += 1
            for k in sorted(a.keys() ^ b.keys()):
                print(f"    only in {'old' if k in a else 'new'}: {k}")
            for k in sorted(a.keys() & b.keys()):
                if not torch.equal(a[k], b[k]):
                    print(f"    differs: {k}")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "train":
        rest = [a for a in sys.argv[3:] if a != "--full"]
        train(Path(sys.argv[2]), rest, "--full" in sys.argv)
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
