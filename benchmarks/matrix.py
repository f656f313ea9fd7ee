"""The paper's experiment matrix on one model: feature allocation/map × training loss, at one total budget.

    python benchmarks/matrix.py --scale small --out docs/results/matrix-small.json     # 2-core CPU
    python benchmarks/matrix.py --scale full --out docs/results/matrix-full.json       # meant for a GPU
    python benchmarks/matrix.py --scale toy --model DIR --data FILE --out m.json      # seconds, for tests

Rows: performer (untrained, fixed dims), dijiang, fix (learned PRF, head-size dims everywhere), dof (learned PRF,
DoF dims), dof+clip. Columns: l2 and softmax (layerwise, no direct phase) and direct (end to end only). Each cell
is one `dofattn distill` run in its own folder under `--runs`, then evaluated against the teacher on the
validation split by the run itself: perplexity, KL(teacher ‖ student), top-1 agreement, wall time. Cells that make
no sense are skipped and say why (l2 needs kernel-estimating features; performer trains nothing). Runs resume.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

ROWS = {  # name -> (feature, dims)
    "performer": ("performer", "fix"),
    "dijiang": ("dijiang", "fix"),
    "fix": ("prf", "fix"),
    "dof": ("prf", "dof"),
    "dof+clip": ("prf", "clip"),
}
LOSSES = ("l2", "softmax", "direct")
SCALES = {  # distill arguments per scale
    "toy": dict(steps=10, batch_size=2, seq_len=32, train_blocks=8, direct_batch_size=2, eval_blocks=2,
                eval_seq_len=32),
    "small": dict(steps=100, batch_size=4, seq_len=256, train_blocks=64, direct_batch_size=2, eval_blocks=8,
                  eval_seq_len=512),
    "full": dict(steps=1500, batch_size=8, seq_len=1024, train_blocks=2048, direct_batch_size=8, eval_blocks=64,
                 eval_seq_len=1024),
}
DIRECT_STEPS = {"toy": 5, "small": 30, "full": 2000}


def skip_reason(row: str, loss: str) -> str | None:
    feature, _ = ROWS[row]
    if row == "performer" and loss != "softmax":
        return "performer trains nothing: one untrained cell (under softmax)"
    if loss == "l2" and feature not in ("prf", "performer"):
        return "l2 compares kernel values: needs PRF features"
    return None


def run_cell(base_args, row: str, loss: str, runs: Path, device: str) -> dict:
    from dofattn.distill import run

    feature, dims = ROWS[row]
    folder = runs / f"{row.replace('+', '-')}-{loss}"
    steps = 0 if row == "performer" else base_args.steps
    args = replace(base_args, feature=feature, dims=dims, loss="softmax" if row == "performer" else loss,
                   steps=max(steps, 1), out=str(folder), device=device)
    if row == "performer":  # no parameters: layerwise and direct steps are no-ops
        args = replace(args, then_direct_steps=0)
    elif loss == "direct":
        args = replace(args, steps=DIRECT_STEPS[base_args.scale_name])
    else:
        args = replace(args, then_direct_steps=0)
    log = run(args)  # a finished cell's folder just returns its log
    ev = log["evaluation"]
    return {"row": row, "loss": loss, "ppl": ev["student_ppl"], "teacher_ppl": ev["teacher_ppl"], "kl": ev["kl"],
            "top1_agreement": ev["top1_agreement"], "tokens": ev["tokens"], "dims": log["dims"],
            "distill_seconds": round(sum(log["seconds"].values()), 1)}


def markdown(cells: list[dict], teacher_ppl: float) -> str:
    lines = [f"| student | {' | '.join(LOSSES)} |", "|---|" + "---:|" * len(LOSSES)]
    for row in ROWS:
        entries = []
        for loss in LOSSES:
            cell = next((c for c in cells if c["row"] == row and c["loss"] == loss), None)
            if cell is None or "skipped" in cell:
                entries.append("–")
            else:
                entries.append(f"{cell['ppl']:.1f} ({cell['ppl'] / teacher_ppl:.2f}×), KL {cell['kl']:.3f}, "
                               f"agr {cell['top1_agreement']:.3f}, {cell['distill_seconds']:.0f} s")
        lines.append(f"| {row} | {' | '.join(entries)} |")
    return "\n".join(lines)


def figures(args, cells: list[dict], teacher_ppl: float, runs: Path) -> dict:
    """The DoF allocation, per-layer errors of the l2-trained students, and perplexity bars; returns the errors."""
    from dofattn.data import token_blocks
    from dofattn.dof import DofResult
    from dofattn.evaluate import layer_errors
    from dofattn.plots import plot_dof, plot_layer_error_comparison, plot_ppl_bars
    from dofattn.student import load_student

    prefix = args.figures
    dof_json = runs / "dof-softmax" / "dof.json"
    if dof_json.is_file():
        plot_dof(DofResult.from_json(dof_json.read_text()), f"{prefix}-dof.png")
    errors = {}
    for row in ("fix", "dof", "dof+clip"):
        folder = runs / f"{row.replace('+', '-')}-l2"
        if not (folder / "log.json").is_file():
            continue
        student, tokenizer, _ = load_student(folder, device=args.device)
        blocks = token_blocks(args.data, tokenizer, SCALES[args.scale]["eval_seq_len"], 2, split="validation")
        errors[row] = layer_errors(student, blocks)
    if errors:
        plot_layer_error_comparison(errors, f"{prefix}-layer-errors.png",
                                    title="l2-trained students on 2 validation blocks (teacher q/k/v)")
    entries = [(f"{c['row']} / {c['loss']}", c["ppl"]) for c in cells if "skipped" not in c]
    plot_ppl_bars(entries, teacher_ppl, f"{prefix}-ppl.png", title=f"{args.model}, {args.scale} matrix")
    return errors


def main() -> None:
    from dofattn.cli import DistillArgs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="small")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-sample")
    parser.add_argument("--runs", default="runs/matrix", help="folder for the cells' run folders")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="matrix.json")
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    parser.add_argument("--figures", help="also write figures PREFIX-dof.png, PREFIX-layer-errors.png (l2 students "
                                          "of fix, dof and dof+clip) and PREFIX-ppl.png")
    args = parser.parse_args()

    base = DistillArgs(model=args.model, data=args.data, recipe="paper", **SCALES[args.scale])  # the paper's grid
    base.scale_name = args.scale  # read by run_cell; not a DistillArgs field, so not part of run.json
    runs = Path(args.runs) / args.scale
    cells = []
    for row in ROWS:
        for loss in LOSSES:
            reason = skip_reason(row, loss)
            if reason:
                cells.append({"row": row, "loss": loss, "skipped": reason})
                continue
            print(f"== {row} / {loss}", flush=True)
            cells.append(run_cell(base, row, loss, runs, args.device))
    measured = [c for c in cells if "skipped" not in c]
    teacher_ppl = measured[0]["teacher_ppl"]
    result = {"scale": args.scale, "model": args.model, "data": args.data, "teacher_ppl": teacher_ppl,
              "distill_args": {k: v for k, v in vars(base).items() if k != "scale_name"}, "cells": cells}
    if args.figures:
        result["layer_errors"] = figures(args, cells, teacher_ppl, runs)
    Path(args.out).write_text(json.dumps(result, indent=2))
    table = markdown(cells, teacher_ppl)
    print(f"\nteacher ppl {teacher_ppl:.2f}\n{table}\nwrote {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
