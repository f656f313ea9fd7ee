"""The paper's experiment matrix on one model: feature allocation/map × training loss, at one total budget.

    python experiments/matrix.py --scale small --out docs/results/matrix-small.json     # 2-core CPU
    python experiments/matrix.py --scale full --out docs/results/matrix-full.json       # meant for a GPU
    python experiments/matrix.py --scale toy --model DIR --data FILE --out m.json      # seconds, for tests

Rows: performer (untrained, fixed dims), dijiang, fix (learned PRF, head-size dims everywhere), dof (learned PRF,
DoF dims), dof+clip. Columns: l2 and softmax (layerwise.loss, no end-to-end phase) and direct (end to end only:
layerwise.steps = 0). Each cell is one run of the paper recipe (`dofattn.recipe.load("paper", sets=...)`) in its
own folder under `--runs`, then evaluated against the teacher on the validation split by the run itself:
perplexity, KL(teacher ‖ student), top-1 agreement, wall time. Cells that make no sense are skipped and say why
(l2 needs kernel-estimating features; performer trains nothing). Runs resume.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROWS = {  # name -> (feature, dims)
    "performer": ("performer", "fix"),
    "dijiang": ("dijiang", "fix"),
    "fix": ("prf", "fix"),
    "dof": ("prf", "dof"),
    "dof+clip": ("prf", "clip"),
}
LOSSES = ("l2", "softmax", "direct")    # the columns: layerwise.loss l2 or softmax; direct: end to end only


def scale_sets(layerwise_steps: int, batch_size: int, seq_len: int, blocks: int, end_to_end_batch_size: int,
               eval_blocks: int, eval_seq_len: int) -> list[str]:
    """The paper recipe's keys a scale sets; the end-to-end phase trains on blocks of the layerwise length."""
    return [f"layerwise.steps={layerwise_steps}", f"layerwise.batch_size={batch_size}", f"layerwise.seq_len={seq_len}",
            f"layerwise.blocks={blocks}", f"end_to_end.batch_size={end_to_end_batch_size}",
            f"end_to_end.seq_len={seq_len}", f"eval.blocks={eval_blocks}", f"eval.seq_len={eval_seq_len}"]


SCALES = {
    "toy": scale_sets(10, 2, 32, 8, 2, 2, 32),
    "small": scale_sets(100, 4, 256, 64, 2, 8, 512),
    "full": scale_sets(1500, 8, 1024, 2048, 8, 64, 1024),
}
EVAL_SEQ_LEN = {"toy": 32, "small": 512, "full": 1024}
DIRECT_STEPS = {"toy": 5, "small": 30, "full": 2000}    # end-to-end steps of a direct cell


def skip_reason(row: str, loss: str) -> str | None:
    feature, _ = ROWS[row]
    if row == "performer" and loss != "softmax":
        return "performer trains nothing: one untrained cell (under softmax)"
    if loss == "l2" and feature not in ("prf", "performer"):
        return "l2 compares kernel values: needs PRF features"
    return None


def cell_sets(row: str, loss: str, scale: str) -> list[str]:
    """What one cell sets of the paper recipe beside its scale's keys."""
    feature, dims = ROWS[row]
    sets = [f"student.feature={feature}", f"student.dims={dims}"]
    if row == "performer":  # no parameters: one layerwise step, a no-op (a recipe must train something)
        return sets + ["layerwise.loss=softmax", "layerwise.steps=1", "end_to_end.steps=0"]
    if loss == "direct":
        return sets + ["layerwise.steps=0", f"end_to_end.steps={DIRECT_STEPS[scale]}"]
    return sets + [f"layerwise.loss={loss}", "end_to_end.steps=0"]


def cell_recipe(scale: str, row: str, loss: str, model: str, data: str):
    """The paper recipe at `scale` for one cell."""
    from dofattn import recipe as recipes

    return recipes.load("paper", sets=SCALES[scale] + cell_sets(row, loss, scale),
                        overrides={"run.model": model, "run.data": data})


def run_cell(scale: str, row: str, loss: str, model: str, data: str, runs: Path, device: str) -> dict:
    from dofattn.distill.run import DistillConfig, run

    folder = runs / f"{row.replace('+', '-')}-{loss}"
    recipe = cell_recipe(scale, row, loss, model, data)
    log = run(DistillConfig(recipe, folder, device), progress=print)  # a finished cell: its log
    ev = log["evaluation"]
    return {"row": row, "loss": loss, "sets": cell_sets(row, loss, scale), "ppl": ev["student_ppl"],
            "teacher_ppl": ev["teacher_ppl"], "kl": ev["kl"], "top1_agreement": ev["top1_agreement"], "tokens": ev["tokens"], "dims": log["dims"],
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
    from dofattn.jobs.eval import layer_errors
    from dofattn.plots import plot_dof
    from dofattn.model.student import load_student

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
        blocks = token_blocks(args.data, tokenizer, EVAL_SEQ_LEN[args.scale], 2, split="validation")
        errors[row] = layer_errors(student, blocks)
    if errors:
        plot_layer_error_comparison(errors, f"{prefix}-layer-errors.png",
                                    title="l2-trained students on 2 validation blocks (teacher q/k/v)")
    entries = [(f"{c['row']} / {c['loss']}", c["ppl"]) for c in cells if "skipped" not in c]
    plot_ppl_bars(entries, teacher_ppl, f"{prefix}-ppl.png", title=f"{args.model}, {args.scale} matrix")
    return errors


def plot_layer_error_comparison(errors: dict[str, dict], path: str | Path, title: str = "") -> None:
    """Per-layer output and kernel error of several students side by side (name -> `layer_errors` result)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("output_error", "kernel_error")
            if any(v is not None for e in errors.values() for v in e.get(k, []))]
    labels = {"output_error": "attention output error (relative)", "kernel_error": "L2 kernel error (row-scaled)"}
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 3.2 * len(keys)), sharex=True, constrained_layout=True,
                             squeeze=False)
    width = 0.8 / len(errors)
    for ax, key in zip(axes[:, 0], keys):
        for j, (name, e) in enumerate(errors.items()):
            values = e.get(key, [])
            xs = [i + (j - (len(errors) - 1) / 2) * width for i, v in enumerate(values) if v is not None]
            ax.bar(xs, [v for v in values if v is not None], width=width, label=name)
        ax.set_ylabel(labels[key])
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("layer")
    axes[0, 0].set_title(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ppl_bars(entries: list[tuple[str, float]], teacher_ppl: float, path: str | Path, title: str = "") -> None:
    """Horizontal bars of validation perplexity (log scale) per student, with the teacher as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(entries) + 1.2), constrained_layout=True)
    names = [n for n, _ in entries]
    ax.barh(range(len(entries)), [p for _, p in entries], color="tab:blue")
    ax.axvline(teacher_ppl, color="black", ls="--", lw=1, label=f"teacher {teacher_ppl:.1f}")
    ax.set_yticks(range(len(entries)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("validation perplexity (log scale)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from dofattn.errors import UserError

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

    runs = Path(args.runs) / args.scale
    cells = []
    try:
        for row in ROWS:
            for loss in LOSSES:
                reason = skip_reason(row, loss)
                if reason:
                    cells.append({"row": row, "loss": loss, "skipped": reason})
                    continue
                print(f"== {row} / {loss}", flush=True)
                cells.append(run_cell(args.scale, row, loss, args.model, args.data, runs, args.device))
    except UserError as err:
        raise SystemExit(f"matrix.py: {err}") from None
    measured = [c for c in cells if "skipped" not in c]
    teacher_ppl = measured[0]["teacher_ppl"]
    result = {"scale": args.scale, "model": args.model, "data": args.data, "teacher_ppl": teacher_ppl,
              "recipe": "paper", "sets": SCALES[args.scale], "cells": cells}
    if args.figures:
        result["layer_errors"] = figures(args, cells, teacher_ppl, runs)
    Path(args.out).write_text(json.dumps(result, indent=2))
    table = markdown(cells, teacher_ppl)
    print(f"\nteacher ppl {teacher_ppl:.2f}\n{table}\nwrote {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
