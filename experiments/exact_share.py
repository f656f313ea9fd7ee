"""Quality and cost against the share of key/value heads kept exact inside linear layers (issue 67's curve).

    python3 experiments/exact_share.py runs/exact --shares 0 0.02 0.05 0.1 0.2 0.4 --by copy --stages distill eval8k
    python3 experiments/exact_share.py runs/exact --gather docs/results/exact-share.json

Each (share, measure) is the default recipe (`long-context`) with no whole layer kept (`student.keep_softmax = 0`)
and `student.exact_heads = SHARE` (chosen by the copy probe; BY = mass ran before that choice left the package, its
rows stay in docs/results/exact-share.json), trained into OUT/share-SHARE-BY (share 0:
no exact head and no bound, `student.select = 0`). The stages, each skipped where its file exists:
    distill   dofattn distill (the run's log.json: validation perplexity over the teacher's on 8 blocks of 512)
    eval8k    dofattn eval on 4 validation blocks of 8 K, by position (eval-8k.json: the 4-8 K bucket)
    niah      RULER niah_single_1 at 4 K and 8 K, 25 prompts each (niah.json); the teacher (the same base model for
              every share) answers once: its scores are kept in OUT/teacher-niah.json and reused (--teacher-answers)
    read32k   benchmarks/bounded_memory.py at 32 K: the state after the prompt, the read's time and peak (read-32k.json)
`--stand-in` builds each run untrained instead (no layerwise stage, one end-to-end step: OUT/share-SHARE-BY-standin)
for the stages that depend on the architecture alone: the state after the prompt and the 32 K read's time and peak
are the same for a trained student of that share, as its feature counts, exact heads and bounds are; its choice of
heads is the copy probe's, as in training. Its quality means nothing and is not gathered; a trained run's own read
(if any) is kept beside it as read-32k-trained.
`--gather FILE` writes one JSON row per trained run folder under OUT (one with its log.json), with whatever its
stages wrote (FILE's earlier rows stay where no folder under OUT has their share and measure, so a point measured on
another machine is not lost; a point trained again replaces its row), and beside it FILE's table (.md: one row per
run, the figures of the curve) and figure (.png: validation and the 4-8 K bucket over the teacher's, and RULER where
measured, against the exact share).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


STAND_IN = ["layerwise.steps=0", "end_to_end.steps=1", "eval.blocks=1"]   # untrained: the architecture alone


def teacher_file(run: Path) -> Path:
    """The teacher's RULER scores, beside the runs (the same base model for every share)."""
    return run.parent / "teacher-niah.json"


def folder(out: Path, share: float, by: str, stand_in: bool = False) -> Path:
    return out / f"share-{share:g}-{by}{'-standin' if stand_in else ''}"


def stages(run: Path, share: float, by: str, stand_in: bool = False) -> dict[str, tuple[Path, list[str]]]:
    """stage -> (the file it writes, its command)."""
    dofattn = [sys.executable, "-m", "dofattn"]
    sets = (["student.keep_softmax=0", f"student.exact_heads={share}"] if share
            else ["student.keep_softmax=0", "student.select=0"]) + (STAND_IN if stand_in else [])
    reuse = ["--teacher-answers", str(teacher_file(run))] if teacher_file(run).is_file() else []
    distill = [*dofattn, "distill", "--out", str(run), *[a for s in sets for a in ("--set", s)]]
    return {
        "distill": (run / "log.json", distill),
        "eval8k": (run / "eval-8k.json", [*dofattn, "eval", "--model", str(run), "--seq-len", "8192", "--num-blocks",
                                          "4", "--batch-size", "1", "--layer-blocks", "0", "--out",
                                          str(run / "eval-8k.json")]),
        "niah": (run / "niah.json", [*dofattn, "eval", "--model", str(run), "--num-blocks", "0", "--tasks",
                                     "niah_single_1", "--task-lengths", "4096,8192", "--prompts", "25", "--out",
                                     str(run / "niah.json"), *reuse]),
        "read32k": (run / "read-32k.json", [sys.executable, str(ROOT / "benchmarks" / "bounded_memory.py"), str(run),
                                            "--lengths", "32768", "--models", "student", "--out",
                                            str(run / "read-32k.json")]),
    }


def gather(out: Path) -> list[dict]:
    rows = []
    for run in sorted(p for p in out.glob("share-*") if (p / "log.json").is_file() and not p.name.endswith("-standin")):
        _, share, by = run.name.split("-", 2)
        row = {"run": str(run), "share": float(share), "by": by}
        for name in ("log.json", "eval-8k.json", "niah.json", "read-32k.json"):
            if (run / name).is_file():
                row[name.removesuffix(".json")] = json.loads((run / name).read_text())
        rows.append(row)
    return rows


def stand_ins(out: Path) -> dict[tuple[float, str], dict]:
    """(share, by) -> the read-32k.json of its untrained stand-in under OUT."""
    found = {}
    for run in sorted(out.glob("share-*-standin")):
        _, share, by = run.name.removesuffix("-standin").split("-", 2)
        if (run / "read-32k.json").is_file():
            found[float(share), by] = {**json.loads((run / "read-32k.json").read_text()), "stand_in": str(run)}
    return found


def summary(row: dict) -> dict:
    """The curve's figures of one gathered row (None where its stage has not run)."""
    log, e8, niah, read = (row.get(k) for k in ("log", "eval-8k", "niah", "read-32k"))
    out = {"share": row["share"], "by": row["by"], "valid": None, "bucket_4_8k": None, "worst_bucket": None,
           "niah_4k": None, "niah_8k": None, "state_mib": None, "read_32k_s": None, "read_32k_peak_mib": None}
    if log and log.get("evaluation", {}).get("student_vs_teacher"):
        out["valid"] = log["evaluation"]["student_vs_teacher"]
    if e8:
        ratios = e8["by_position"]["ratio"]
        out["bucket_4_8k"], out["worst_bucket"] = ratios[-1], max(ratios)
    if niah:
        acc = niah["tasks"]["niah_single_1"]
        out["niah_4k"], out["niah_8k"] = acc.get("4096"), acc.get("8192")
    if read:
        r = read["rows"][0]
        out["state_mib"], out["read_32k_s"], out["read_32k_peak_mib"] = (r["cache_after_prompt_mib"], r["prefill_s"],
                                                                         r["prefill_peak_mib"])
    return out


def table(rows: list[dict]) -> str:
    def f(x, fmt, unit=""):
        return "–" if x is None else format(x, fmt) + unit

    lines = ["| exact share (kv heads) | by | validation × teacher | 4–8 K × teacher | worst bucket | RULER 4 K | "
             "RULER 8 K | state after the prompt | 32 K read | its peak |", "|" + "---|" * 2 + "---:|" * 8]
    for r in sorted(map(summary, rows), key=lambda r: (r["share"], r["by"])):
        lines.append(f"| {r['share']:.0%} ({round(r['share'] * 90)}) | {r['by'] if r['share'] else '–'} | "
                     f"{f(r['valid'], '.3f')} | {f(r['bucket_4_8k'], '.2f')} | {f(r['worst_bucket'], '.2f')} | "
                     f"{f(r['niah_4k'], '.0%')} | {f(r['niah_8k'], '.0%')} | {f(r['state_mib'], '.1f', ' MiB')} | "
                     f"{f(r['read_32k_s'], '.0f', ' s')} | {f(r['read_32k_peak_mib'], '.0f', ' MiB')} |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(map(summary, rows), key=lambda r: r["share"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for by, marker in (("copy", "o"), ("mass", "s")):
        mine = [r for r in points if r["by"] == by or r["share"] == 0]
        for key, color, label in (("valid", "tab:blue", "validation (512)"), ("bucket_4_8k", "tab:red", "4–8 K")):
            xy = [(100 * r["share"], r[key]) for r in mine if r[key] is not None]
            if len(xy) > 1 or any(r["by"] == by and r["share"] for r in mine if r[key] is not None):
                left.plot(*zip(*xy), marker=marker, color=color, label=f"{label}, {by}")
        for key, color in (("niah_4k", "tab:green"), ("niah_8k", "tab:purple")):
            xy = [(100 * r["share"], r[key]) for r in mine if r[key] is not None]
            if xy:
                right.plot(*zip(*xy), marker=marker, color=color, label=f"{key[5:]}, {by}")
    left.axhline(1.05, color="gray", ls="--", lw=1)
    left.axhline(1.15, color="gray", ls=":", lw=1)
    left.set(xlabel="key/value heads exact (%)", ylabel="perplexity × teacher", title="quality against exact share")
    whole = ROOT / "docs" / "results" / "ruler-niah-4k-8k.json"          # long-context: its 36 heads in 12 layers
    if whole.is_file():
        acc = json.loads(whole.read_text())["tasks"]["niah_single_1"]
        for length, color in (("4096", "tab:green"), ("8192", "tab:purple")):
            right.plot([40], [acc[length]], marker="*", ms=12, ls="", color=color,
                       label=f"{int(length) // 1024}k, long-context (whole layers)")
    right.axhline(24 / 25, color="gray", ls="--", lw=1)                  # issue 67's target: 24 of 25 prompts
    right.set(xlabel="key/value heads exact (%)", ylabel="RULER niah_single_1", ylim=(0, 1.05), title="recall",
              xlim=left.get_xlim())
    for ax in (left, right):
        if ax.lines:
            ax.legend(fontsize=8)
    if not right.lines:
        right.text(0.5, 0.5, "not measured yet (--stages niah)", ha="center", va="center", transform=right.transAxes)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1])
    parser.add_argument("--by", nargs="+", default=["copy"], choices=["copy"])
    parser.add_argument("--stages", nargs="+", default=["distill", "eval8k"],
                        choices=["distill", "eval8k", "niah", "read32k"])
    parser.add_argument("--stand-in", action="store_true", help="untrained students, for the architecture's stages")
    parser.add_argument("--gather", type=Path, help="write the rows found under OUT to this JSON and stop")
    args = parser.parse_args()
    if args.stand_in and set(args.stages) - {"distill", "read32k"}:
        parser.error("--stand-in trains nothing: only its architecture's stages (distill, read32k) mean anything")
    if args.gather:
        rows = gather(args.out)
        found = {(r["share"], r["by"]) for r in rows}      # a point trained again here replaces its earlier row
        if args.gather.is_file():
            rows += [r for r in json.loads(args.gather.read_text()) if (r["share"], r["by"]) not in found]
        for (share, by), read in stand_ins(args.out).items():      # the architecture's figures where none measured
            for row in rows:
                if row["share"] == share and row["by"] == by and row.get("read-32k", {}).get("stand_in") != read["stand_in"]:
                    if "read-32k" in row and "stand_in" not in row["read-32k"]:
                        row["read-32k-trained"] = row["read-32k"]       # kept: the state should be the same
                    row["read-32k"] = read
        args.gather.write_text(json.dumps(rows, indent=1))
        args.gather.with_suffix(".md").write_text(table(rows))
        figure(rows, args.gather.with_suffix(".png"))
        return
    path = os.environ.get("PYTHONPATH")      # benchmarks/ scripts import dofattn from this tree, installed or not
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    for share in args.shares:
        for by in (args.by if share else ["copy"]):
            run = folder(args.out, share, by, args.stand_in)
            for name, (done, command) in stages(run, share, by, args.stand_in).items():
                if name in args.stages and not done.is_file():
                    print(" ".join(command), flush=True)
                    subprocess.run(command, check=True, env=env)
                    if name == "niah" and not teacher_file(run).is_file():
                        teacher_file(run).write_text(done.read_text())


if __name__ == "__main__":
    main()
