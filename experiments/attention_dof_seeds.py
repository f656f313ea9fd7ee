"""How much the DoF of the attention matrices moves with the text sample: pairwise, over the per-layer estimates of
several runs (each run's attention_dof.json, measured on other training blocks with its --seed).

    python experiments/attention_dof_seeds.py docs/results/attention-dof-s{0,1,2}.json \
        --out docs/results/attention-dof-seeds.json

For each pair: the Pearson correlation of the layer DoF, and of the dims they allocate at a mean of --budget
features per layer (`dofattn.dof.allocate`, as `--dims attn-dof` does), with the mean and largest absolute
difference of those dims; and each run's --keep top layers. The same comparison for the kernel's DoF is
`experiments/dof_sensitivity.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.dof_sensitivity import compare  # noqa: E402
from experiments.layer_sensitivity import top  # noqa: E402

def main() -> int:
    from dofattn.dof import allocate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="attention_dof.json files of runs with other seeds")
    parser.add_argument("--budget", type=int, default=64, help="mean features per layer for the dims")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if len(args.runs) < 2:
        parser.error("give at least two attention_dof.json files")
    dofs = {str(p): json.loads(p.read_text())["layers"] for p in args.runs}
    dims = {name: allocate(d, args.budget * len(d)) for name, d in dofs.items()}
    pairs = []
    for a, b in itertools.combinations(dofs, 2):
        same = compare(dims[a], dims[b])                  # dims as dof_sensitivity.py compares the kernel's
        pairs.append({"runs": [a, b], "dof_pearson": compare(dofs[a], dofs[b])["pearson"],
                      "dims_pearson": same["pearson"], "dims_mean_abs_diff": same["mean_abs_diff"],
                      "dims_max_abs_diff": same["max_abs_diff"]})
        print(f"{a} vs {b}: DoF r = {pairs[-1]['dof_pearson']}, dims r = {same['pearson']}, "
              f"|Δ dim| mean {same['mean_abs_diff']}, max {same['max_abs_diff']}")
    tops = {name: top(d, args.keep) for name, d in dofs.items()}
    for name, layers in tops.items():
        print(f"{name}: dims {min(dims[name])}-{max(dims[name])}, top {args.keep} layers {layers}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(["experiments/attention_dof_seeds.py", *sys.argv[1:]]),
                                        "budget": args.budget, "pairs": pairs, "dims": dims, "top": tops}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
