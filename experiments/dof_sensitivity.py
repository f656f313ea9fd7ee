"""How the DoF allocation on one model moves with λ, with J (points per head) and with the text sample.

    python experiments/dof_sensitivity.py --out docs/results/dof_sensitivity.json --plot docs/dof-sensitivity.png

One capture of 4096 points per head and seed serves every J: the first J of a uniformly drawn sample are a uniform
sample. Seed 1 (other text blocks, other points) gives the sample-to-sample variation at the reference setting, and
both seeds are also pooled over R=4 disjoint sets of 1024 points (`dofattn dof --repeats 4`). For each setting:
layer DoF (max over heads), dims at the head-size budget, and how the dims compare with the reference (seed 0,
J=1024, λ=2⁻⁸ relative to the trace): Pearson correlation, mean and largest absolute difference.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

LAMS = [2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -10, 2.0 ** -12]
JS = [256, 512, 1024, 2048]
REFERENCE = (1024, 2.0 ** -8)


def subsample(sample, J: int):
    from dofattn.dof import PointSample

    return PointSample([p[:, :J] for p in sample.points], sample.scaling, J, sample.head_dim)


def compare(dims: list[int], ref: list[int]) -> dict:
    a, b = torch.tensor(dims, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")
    diff = (a - b).abs()
    return {"pearson": round(corr, 3), "mean_abs_diff": round(float(diff.mean()), 1), "max_abs_diff": int(diff.max())}


def setting(sample, J: int, lam: float, budget: int, seed: int, repeats: int = 1) -> dict:
    from dofattn.dof import allocate_dims

    start = time.perf_counter()
    result = allocate_dims(subsample(sample, J * repeats), lam, budget, repeats=repeats)
    dofs = [layer.dof for layer in result.layers]
    return {"J": J, "lam": lam, "seed": seed, "repeats": repeats, "layer_dof": [round(d, 2) for d in dofs],
            "layer_dof_std": [round(layer.dof_std, 2) for layer in result.layers], "dims": result.dims,
            "dof_spread": round(max(dofs) / min(dofs), 2), "dims_range": [min(result.dims), max(result.dims)],
            "seconds": round(time.perf_counter() - start, 1)}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, key, label in ((axes[0], "lam", "λ (trace-relative), J = 1024"), (axes[1], "J", "J, λ = 2⁻⁸")):
        for row in rows:
            if row["seed"] != 0 or row["repeats"] > 1 or (key == "lam" and row["J"] != REFERENCE[0]) or (
                    key == "J" and row["lam"] != REFERENCE[1]):
                continue
            name = f"λ = 2^{round(torch.log2(torch.tensor(row['lam'])).item())}" if key == "lam" else f"J = {row['J']}"
            ax.plot(row["dims"], marker=".", label=name)
        ax.set_title(label)
        ax.set_xlabel("layer")
        ax.legend(fontsize=8)
    seed1 = next(r for r in rows if r["seed"] == 1 and r["repeats"] == 1)
    axes[0].plot(seed1["dims"], "k--", lw=1, label="seed 1 (J = 1024, λ = 2⁻⁸)")
    axes[0].legend(fontsize=8)
    axes[0].set_ylabel("feature dim (budget 64 per layer)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from dofattn.data import token_blocks
    from dofattn.dof import sample_points
    from dofattn.model.hf import load_model
    from dofattn.model.student import head_layout

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-sample")
    parser.add_argument("--out", default="dof_sensitivity.json")
    parser.add_argument("--plot", help="figure of dims per layer across λ and J (.png)")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    budget = head_layout(model)[2]
    rows = []
    samples = {}
    for seed in (0, 1):
        blocks = token_blocks(args.data, tokenizer, 256, 32, split="train", seed=seed)
        samples[seed] = sample_points(model, blocks, samples=4 * REFERENCE[0], seed=seed)
    for lam in LAMS:
        rows.append(setting(samples[0], REFERENCE[0], lam, budget, 0))
        print(f"J={REFERENCE[0]} lam={lam:g}: dims {rows[-1]['dims_range']}", flush=True)
    for J in JS:
        if J != REFERENCE[0]:
            rows.append(setting(samples[0], J, REFERENCE[1], budget, 0))
            print(f"J={J} lam={REFERENCE[1]:g}: dims {rows[-1]['dims_range']}", flush=True)
    rows.append(setting(samples[1], REFERENCE[0], REFERENCE[1], budget, 1))
    for seed in (0, 1):
        rows.append(setting(samples[seed], REFERENCE[0], REFERENCE[1], budget, seed, repeats=4))
        print(f"seed {seed} pooled over 4: dims {rows[-1]['dims_range']}", flush=True)
    ref = next(r for r in rows if (r["J"], r["lam"], r["seed"], r["repeats"]) == (*REFERENCE, 0, 1))
    for row in rows:
        row["vs_reference"] = compare(row["dims"], ref["dims"])
    pooled = [r for r in rows if r["repeats"] == 4]
    seeds_single = compare(ref["dims"], next(r for r in rows if r["seed"] == 1 and r["repeats"] == 1)["dims"])
    seeds_pooled = compare(pooled[0]["dims"], pooled[1]["dims"])
    print(f"seed 0 vs seed 1 dims: one set of 1024 points {seeds_single}; pooled over 4 sets {seeds_pooled}")
    Path(args.out).write_text(json.dumps({"model": args.model, "data": args.data, "budget": budget,
                                          "reference": {"J": REFERENCE[0], "lam": REFERENCE[1]},
                                          "seed0_vs_seed1": {"single": seeds_single, "pooled4": seeds_pooled},
                                          "rows": rows}, indent=2))
    print("| J | λ | seed | sets | DoF max/min | dims | corr. with reference | mean / max |Δ dim| |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        c = r["vs_reference"]
        print(f"| {r['J']} | 2^{round(torch.log2(torch.tensor(r['lam'])).item())} | {r['seed']} | {r['repeats']} | "
              f"{r['dof_spread']} | {r['dims_range'][0]}–{r['dims_range'][1]} | {c['pearson']} | "
              f"{c['mean_abs_diff']} / {c['max_abs_diff']} |")
    if args.plot:
        plot(rows, args.plot)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
