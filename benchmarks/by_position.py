"""Where in the context students fall behind their teacher: the `by_position` buckets of several evaluations, as one
table and one figure.

    python benchmarks/by_position.py runs/default eval-linear.json --labels "window 64 + sink 4" "pure linear" \
        --out docs/results/by-position.json --plot docs/results/by-position.png

Each input is a `dofattn eval --out` JSON, a finished run folder or its log.json (its final evaluation). Per input
and bucket of context length (predictions that see 1, 2-3, 4-7, ... tokens): the student's perplexity over the
teacher's and the KL to the teacher.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> dict:
    """The `by_position` buckets (and the whole-text numbers) of an eval JSON, a run folder or a run's log.json."""
    if path.is_dir():
        path = path / "log.json"
    data = json.loads(path.read_text())
    ev = data.get("evaluation", data)
    if "by_position" not in ev:
        raise SystemExit(f"{path} has no by_position numbers; evaluate it again with this version of dofattn eval")
    ratio = ev.get("student_vs_teacher") or ev["ppl"] / ev["teacher_ppl"]
    return {"by_position": ev["by_position"], "ratio": ratio, "kl": ev["kl"], "tokens": ev["tokens"],
            "seq_len": ev.get("seq_len")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="eval JSONs, run folders or their log.json")
    parser.add_argument("--labels", nargs="+", help="one per input (default: the paths)")
    parser.add_argument("--out", type=Path, help="where to write the collected JSON")
    parser.add_argument("--plot", type=Path, help="a figure of ratio and KL by context length")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args(argv)
    labels = args.labels or [str(p) for p in args.inputs]
    if len(labels) != len(args.inputs):
        raise SystemExit(f"{len(args.inputs)} inputs but {len(labels)} labels; give one label per input")
    runs = {label: load(path) for label, path in zip(labels, args.inputs)}

    from dofattn.evaluate import format_positions

    for label, run in runs.items():
        print(f"\n{label}: {run['ratio']:.3f}x the teacher, KL {run['kl']:.3f} ({run['tokens']} tokens in blocks "
              f"of {run['seq_len']})" + format_positions(run["by_position"]))
    if args.out:
        args.out.write_text(json.dumps({label: {"input": str(path), **run} for (label, run), path
                                        in zip(runs.items(), args.inputs)}, indent=2))
        print(f"wrote {args.out}")
    if args.plot:
        from dofattn.plots import plot_by_position

        plot_by_position({label: run["by_position"] for label, run in runs.items()}, args.plot,
                         title=args.title)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
