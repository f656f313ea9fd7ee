"""Per layer, the layerwise loss against the feature count, read from distill runs with uniform dims, and what it
says about an allocation of features.

    python experiments/feature_curves.py runs/lw-fix16 runs/lw-fix32 runs/wl-sink4-fix-s0 runs/lw-fix128 \
        --compare runs/wl-sink4-s0 runs/wl-sink4-linear-dof-s0 --out curves.json --plot curves.png

Each curve run is a finished `dofattn distill` folder (or its kept log.json) whose dims are one count M for every
layer (`--dims fix:M`); all of them must train the same layerwise student otherwise (seed, data, window, sink,
feature map, loss, steps), so that each layer's loss on its fixed batch (`log.json` layers[i].fixed_batch_loss)
is measured on the same rows at every M. Between measured counts the loss is interpolated linearly in log2 M, and
held flat beyond the smallest and largest.

It prints, per layer, the loss at every M, and then:
- for each `--compare` run (same student, other dims: dof, linear-dof, ...): the sum over layers of its measured
  losses beside the sum the curves predict for its dims, so one sees whether the curves account for it;
- the allocation with the same total that the curves say is best: from the smallest M in every layer, features go
  `--step` at a time to the layer whose interpolated loss falls most (greedy on the curves), and the predicted sum
  it reaches. `--dims-out` writes it as a dof.json that `dofattn distill --dims` takes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SAME = ("model", "data", "seed", "window", "sink", "feature", "loss", "steps", "batch_size", "seq_len",
        "train_blocks", "lr", "lr_weights", "progressive", "per_head", "keep_softmax", "decay")


def read_log(path: Path) -> dict:
    file = path if path.is_file() else path / "log.json"
    if not file.is_file():
        raise SystemExit(f"{path} has no log.json: give finished `dofattn distill` folders or their log.json files")
    log = json.loads(file.read_text())
    if "args" not in log or "layers" not in log or "dims" not in log:
        raise SystemExit(f"{file} is not a `dofattn distill` log.json")
    return log


def layer_losses(log: dict) -> list[float]:
    return [log["layers"][str(i)]["fixed_batch_loss"] for i in range(len(log["dims"]))]


def check_same(logs: list[dict], names: list[str]) -> None:
    first = logs[0]["args"]
    for log, name in zip(logs[1:], names[1:]):
        differ = [k for k in SAME if log["args"].get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"{name} trains another layerwise student than {names[0]} (differs in "
                             f"{', '.join(differ)}): compare runs that differ only in their dims")


def interpolate(counts: list[int], losses: list[float], m: float) -> float:
    """The loss at m features, linear in log2 M between measured counts, flat beyond them."""
    if m <= counts[0]:
        return losses[0]
    if m >= counts[-1]:
        return losses[-1]
    for (m0, l0), (m1, l1) in zip(zip(counts, losses), zip(counts[1:], losses[1:])):
        if m0 <= m <= m1:
            t = (math.log2(m) - math.log2(m0)) / (math.log2(m1) - math.log2(m0))
            return l0 + t * (l1 - l0)
    raise AssertionError("unreachable")


def greedy(curves: list[tuple[list[int], list[float]]], total: int, step: int) -> list[int]:
    """Dims summing to `total`, from each layer's smallest measured count, `step` features at a time to the layer
    whose interpolated loss falls most (a remainder smaller than `step` goes the same way)."""
    dims = [c[0] for c, _ in curves]
    left = total - sum(dims)
    if left < 0:
        raise SystemExit(f"a total of {total} features is below the smallest measured count in every layer "
                         f"({sum(dims)})")
    while left > 0:
        size = min(step, left)
        gains = [interpolate(c, l, d) - interpolate(c, l, d + size) for (c, l), d in zip(curves, dims)]
        best = max(range(len(dims)), key=lambda i: (gains[i], -i))
        dims[best] += size
        left -= size
    return dims


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="runs with one feature count for every layer (fix:M)")
    parser.add_argument("--compare", nargs="*", type=Path, default=[], help="runs of the same student, other dims")
    parser.add_argument("--step", type=int, default=4, help="features per step of the greedy allocation")
    parser.add_argument("--out", type=Path, help="also write everything as JSON")
    parser.add_argument("--plot", type=Path, help="draw each layer's loss against M into this image (.png/.pdf/.svg)")
    parser.add_argument("--dims-out", type=Path, help="write the greedy allocation as a dof.json for --dims")
    args = parser.parse_args(argv)
    if args.step < 1:
        raise SystemExit(f"--step must be >= 1, got {args.step}")
    if args.plot is not None and args.plot.suffix not in (".png", ".pdf", ".svg"):
        raise SystemExit(f"--plot takes a .png, .pdf or .svg name, got {args.plot}")

    logs = [read_log(p) for p in args.runs]
    counts = []
    for log, path in zip(logs, args.runs):
        if len(set(log["dims"])) != 1:
            raise SystemExit(f"{path} has dims that differ between layers: curve runs need --dims fix:M")
        counts.append(log["dims"][0])
    if len(set(counts)) != len(counts) or len(counts) < 2:
        raise SystemExit(f"give at least two curve runs with different feature counts, got {counts}")
    compare = [read_log(p) for p in args.compare]
    check_same(logs + compare, [str(p) for p in args.runs + args.compare])

    order = sorted(range(len(counts)), key=lambda i: counts[i])
    counts = [counts[i] for i in order]
    per_run = [layer_losses(logs[i]) for i in order]                       # [runs][layers]
    layers = len(per_run[0])
    curves = [(counts, [run[layer] for run in per_run]) for layer in range(layers)]

    print("layer  " + " ".join(f"{'M=' + str(m):>8}" for m in counts))
    for layer, (_, losses) in enumerate(curves):
        print(f"{layer:5d}  " + " ".join(f"{x:8.4f}" for x in losses))
    print("sum    " + " ".join(f"{sum(run):8.4f}" for run in per_run))

    result = {"counts": counts, "losses": [losses for _, losses in curves], "curve_runs": [str(p) for p in args.runs],
              "compare": []}
    print("\nrun: measured sum of layer losses, predicted by the curves for its dims")
    for log, path in zip(compare, args.compare):
        measured = sum(layer_losses(log))
        predicted = sum(interpolate(c, l, d) for (c, l), d in zip(curves, log["dims"]))
        print(f"  {path}: {measured:.4f} measured, {predicted:.4f} predicted (dims {min(log['dims'])}-"
              f"{max(log['dims'])}, total {sum(log['dims'])})")
        result["compare"].append({"run": str(path), "dims": log["dims"], "measured": measured,
                                  "predicted": predicted})

    totals = sorted({sum(log["dims"]) for log in compare} | {layers * m for m in counts})
    result["greedy"] = []
    for total in totals:                    # inside the measured range only: the curves are flat outside it
        if not layers * counts[0] < total < layers * counts[-1]:
            continue
        dims = greedy(curves, total, args.step)
        predicted = sum(interpolate(c, l, d) for (c, l), d in zip(curves, dims))
        uniform = sum(interpolate(c, l, total / layers) for c, l in curves)
        print(f"greedy at total {total}: predicted {predicted:.4f} (uniform {uniform:.4f}); dims {dims}")
        result["greedy"].append({"total": total, "dims": dims, "predicted": predicted, "uniform": uniform})

    if args.dims_out is not None:           # at the first compared run's total, else the largest
        if not result["greedy"]:
            raise SystemExit("no total inside the measured range to allocate: add curve runs or --compare runs")
        total = sum(compare[0]["dims"]) if compare else result["greedy"][-1]["total"]
        pick = next((g for g in result["greedy"] if g["total"] == total), None)
        if pick is None:
            raise SystemExit(f"{args.compare[0]}'s total of {total} features lies outside the measured range "
                             f"({layers * counts[0]}-{layers * counts[-1]})")
        from dofattn.dof import DofResult, LayerDof

        # not a DoF estimate: the layers' dof fields are 0 and only the dims are meant
        dof = DofResult(model=logs[0]["args"]["model"], lam=0.0, budget=round(total / layers),
                        layers=[LayerDof(i, 0.0, [], d, []) for i, d in enumerate(pick["dims"])])
        args.dims_out.write_text(dof.to_json())
        print(f"wrote {args.dims_out} (the greedy allocation at total {total})")

    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        cmap = plt.get_cmap("viridis")
        for layer, (c, losses) in enumerate(curves):
            ax.plot(c, losses, marker="o", ms=3, color=cmap(layer / max(layers - 1, 1)), lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("features per head (M)")
        ax.set_ylabel("layerwise loss on the fixed batch")
        sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, layers - 1))
        fig.colorbar(sm, ax=ax, label="layer")
        ax.set_title("Each layer's layerwise loss against its feature count")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
