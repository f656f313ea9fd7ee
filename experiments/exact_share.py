"""Quality and cost against the share of key/value heads kept exact inside linear layers (issue 67's curve).

    python3 experiments/exact_share.py runs/exact --shares 0 0.02 0.05 0.1 0.2 0.4 --by copy --stages distill eval8k
    python3 experiments/exact_share.py runs/exact --shares 0.1 --by copy mass --stages distill eval8k   # copy vs mass
    python3 experiments/exact_share.py runs/exact --gather docs/results/exact-share.json

Each (share, measure) is the default recipe (`long-context`) with no whole layer kept (`student.keep_softmax = 0`)
and `student.exact_heads = SHARE` chosen by `student.exact_heads_by = BY`, trained into OUT/share-SHARE-BY (share 0:
no exact head and no bound, `student.select = 0`). The stages, each skipped where its file exists:
    distill   dofattn distill (the run's log.json: validation perplexity over the teacher's on 8 blocks of 512)
    eval8k    dofattn eval on 4 validation blocks of 8 K, by position (eval-8k.json: the 4-8 K bucket)
    niah      RULER niah_single_1 at 4 K and 8 K, 25 prompts each (niah.json)
    read32k   benchmarks/bounded_memory.py at 32 K: the state after the prompt, the read's time and peak (read-32k.json)
`--gather` writes one JSON row per run folder found under OUT, with whatever its stages wrote.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def folder(out: Path, share: float, by: str) -> Path:
    return out / f"share-{share:g}-{by}"


def stages(run: Path, share: float, by: str) -> dict[str, tuple[Path, list[str]]]:
    """stage -> (the file it writes, its command)."""
    dofattn = [sys.executable, "-m", "dofattn"]
    sets = (["student.keep_softmax=0", f"student.exact_heads={share}", f"student.exact_heads_by={by}"] if share
            else ["student.keep_softmax=0", "student.select=0"])
    distill = [*dofattn, "distill", "--out", str(run), *[a for s in sets for a in ("--set", s)]]
    return {
        "distill": (run / "log.json", distill),
        "eval8k": (run / "eval-8k.json", [*dofattn, "eval", "--model", str(run), "--seq-len", "8192", "--num-blocks",
                                          "4", "--batch-size", "1", "--layer-blocks", "0", "--out",
                                          str(run / "eval-8k.json")]),
        "niah": (run / "niah.json", [*dofattn, "eval", "--model", str(run), "--num-blocks", "0", "--tasks",
                                     "niah_single_1", "--task-lengths", "4096,8192", "--prompts", "25", "--out",
                                     str(run / "niah.json")]),
        "read32k": (run / "read-32k.json", [sys.executable, str(ROOT / "benchmarks" / "bounded_memory.py"), str(run),
                                            "--lengths", "32768", "--models", "student", "--out",
                                            str(run / "read-32k.json")]),
    }


def gather(out: Path) -> list[dict]:
    rows = []
    for run in sorted(p for p in out.glob("share-*") if p.is_dir()):
        _, share, by = run.name.split("-", 2)
        row = {"run": str(run), "share": float(share), "by": by}
        for name in ("log.json", "eval-8k.json", "niah.json", "read-32k.json"):
            if (run / name).is_file():
                row[name.removesuffix(".json")] = json.loads((run / name).read_text())
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1])
    parser.add_argument("--by", nargs="+", default=["copy"], choices=["copy", "mass"])
    parser.add_argument("--stages", nargs="+", default=["distill", "eval8k"],
                        choices=["distill", "eval8k", "niah", "read32k"])
    parser.add_argument("--gather", type=Path, help="write the rows found under OUT to this JSON and stop")
    args = parser.parse_args()
    if args.gather:
        args.gather.write_text(json.dumps(gather(args.out), indent=1))
        return
    for share in args.shares:
        for by in (args.by if share else ["copy"]):
            run = folder(args.out, share, by)
            for name, (done, command) in stages(run, share, by).items():
                if name in args.stages and not done.is_file():
                    print(" ".join(command), flush=True)
                    subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
