"""A markdown table of finished `dofattn distill` runs, read from their log.json files.

    python benchmarks/runs_table.py runs/distill runs/window64 runs/keep3-dof --out docs/results/fidelity.json

One row per run folder: what differs from its recipe's defaults (read from run.json), validation perplexity after
layerwise training and at the end (and the ratio to the teacher's), KL(teacher ‖ student) per token, top-1
agreement, the softmax layers kept, and the run's own stage timings. The JSON collects the same rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHOWN = ("recipe", "dims", "feature", "loss", "window", "keep_softmax", "keep_by", "progressive", "per_head", "lora_rank",
         "steps", "then_direct_steps")


def describe(folder: Path) -> dict:
    from dofattn.cli import DistillArgs
    from dofattn.distill import LATER_OPTIONS, resolve_recipe

    args = json.loads((folder / "run.json").read_text())
    log = json.loads((folder / "log.json").read_text())
    defaults = DistillArgs(recipe=args.get("recipe", LATER_OPTIONS["recipe"]))  # that recipe's defaults
    resolve_recipe(defaults)
    changed = {k: args[k] for k in SHOWN if k in args and args[k] != getattr(defaults, k)}
    ev = log["evaluation"]
    return {"run": folder.name, "changed": changed, "dims": [min(log["dims"]), max(log["dims"])],
            "softmax_layers": log.get("softmax_layers", []), "teacher_ppl": ev["teacher_ppl"],
            "layerwise_ppl": ev.get("layerwise_student_ppl"), "ppl": ev["student_ppl"],
            "vs_teacher": ev["student_ppl"] / ev["teacher_ppl"], "kl": ev.get("kl"),
            "top1_agreement": ev.get("top1_agreement"),
            "seconds": log["seconds"], "curve": log.get("direct", {}).get("curve", [])}


def markdown(rows: list[dict]) -> str:
    lines = ["| run | differs from its recipe's defaults | ppl after layerwise | final ppl (× teacher) | KL | agreement | "
             "softmax layers |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        changed = ", ".join(f"{k}={v}" for k, v in r["changed"].items()) or "(its recipe's defaults)"
        layerwise = f"{r['layerwise_ppl']:.1f}" if r["layerwise_ppl"] else "–"
        kl = "–" if r["kl"] is None else f"{r['kl']:.3f}"
        agreement = "–" if r["top1_agreement"] is None else f"{r['top1_agreement']:.3f}"
        lines.append(f"| {r['run']} | {changed} | {layerwise} | {r['ppl']:.1f} ({r['vs_teacher']:.2f}×) | {kl} | "
                     f"{agreement} | {r['softmax_layers'] or '–'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="finished run folders")
    parser.add_argument("--out", help="also write the rows as JSON")
    args = parser.parse_args()
    rows = [describe(Path(f)) for f in args.runs]
    print(f"teacher ppl {rows[0]['teacher_ppl']:.2f}\n{markdown(rows)}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
