"""What the linear part adds to a window student: the same student with its linear part switched off.

    python experiments/window_ablation.py runs/window64 --out docs/results/window-ablation.json

For each run folder of a window student (`dofattn distill --window W`), on the validation blocks its distill run
evaluated on: perplexity, KL(teacher ‖ student) and top-1 agreement of
    student       the hybrid as trained: exact softmax over the last W tokens + the linear part beyond
    window only   the same weights with the linear part's gain at zero (log_gain = −10⁴): sliding-window
                  softmax attention over W tokens, nothing beyond
If the window alone came close to the student, the linear part would not be earning its state.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ablate(folder: Path) -> dict:
    from dofattn.data import token_blocks
    from dofattn.evaluate import compare
    from dofattn.model.student import load_student

    from dofattn.distill.run_folder import RECIPE_FILE, RunFolder

    if (folder / RECIPE_FILE).is_file():
        recipe = RunFolder(folder).recipe
        data, seq_len, count = recipe.run.eval_data or recipe.run.data, recipe.eval.seq_len, recipe.eval.blocks
    else:                                             # a run of the old flags
        args = json.loads((folder / "run.json").read_text())
        data, seq_len, count = args.get("eval_data") or args["data"], args["eval_seq_len"], args["eval_blocks"]
    model, tokenizer, config = load_student(folder)
    if not config.attention.window:
        raise SystemExit(f"{folder} is not a window student (student.window = 0)")
    blocks = token_blocks(data, tokenizer, seq_len, count, split="validation", seed=0)
    student = compare(model, blocks, progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "log_gain"):
                module.log_gain.fill_(-1e4)
    alone = compare(model, blocks, progress=False)
    return {"run": str(folder), "window": config.attention.window, "teacher_ppl": student["teacher_ppl"],
            "student": student, "window_only": alone}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [ablate(folder) for folder in args.runs]
    print("| run | W | student ppl (× teacher) | window only ppl (× teacher) | KL student / window only |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        t, s, w = row["teacher_ppl"], row["student"], row["window_only"]
        print(f"| {row['run']} | {row['window']} | {s['ppl']:.2f} ({s['ppl'] / t:.2f}×) | {w['ppl']:.2f} "
              f"({w['ppl'] / t:.2f}×) | {s['kl']:.3f} / {w['kl']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "command": " ".join(sys.argv)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
