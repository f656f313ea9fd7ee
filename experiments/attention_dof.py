"""The DoF of the teacher's attention matrices per layer, against the measured cost of linearizing each layer.

    python experiments/attention_dof.py --gains docs/results/layer-sensitivity.json \
        --out docs/results/attention-dof.json --plot docs/results/attention-dof.png

`layer_sensitivity.py` measured, per layer of SmolLM2-135M, how much of a pure-linear student's KL to the teacher
comes back when that layer alone gets its exact attention back (the gain), and found the kernel's DoF does not
predict it. This script computes the other DoF, that of the causal softmax attention matrices
(`dofattn.dof.attention_dof`: the same ridge estimator on A Aᵀ, λ trace-relative), on the same training blocks
the gains were measured on (the sensitivity run's data, seed and block length) and on --blocks more, and gives
Spearman rank correlations of both DoFs with the gain and with the damage of the layer linearized alone. No
training: one teacher forward per block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.layer_sensitivity import spearman, top  # noqa: E402


def main() -> int:
    from dofattn.data import token_blocks
    from dofattn.dof import attention_dofs
    from dofattn.model.hf import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gains", type=Path, required=True, help="layer_sensitivity.py's JSON")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-sample")
    parser.add_argument("--seq-len", type=int, default=512, help="the sensitivity run's block length")
    parser.add_argument("--seed", type=int, default=0, help="the sensitivity run's seed (its training blocks)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks for the second estimate")
    parser.add_argument("--lam", type=float, default=2.0 ** -8)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    sensitivity = json.loads(args.gains.read_text())
    gain, kernel_dof = sensitivity["restore_gain"], sensitivity["dof"]
    alone = [row["kl"] for row in sensitivity["alone"]]
    model, tokenizer = load_model(args.model)[:2]
    model.eval()
    same = token_blocks(args.data, tokenizer, args.seq_len, sensitivity["sweep_blocks"], split="train", seed=args.seed)
    more = token_blocks(args.data, tokenizer, args.seq_len, args.blocks, split="train", seed=args.seed)
    estimates = {}
    for name, blocks in (("same_blocks", same), (f"{args.blocks}_blocks", more)):
        heads = attention_dofs(model, blocks, args.lam)
        estimates[name] = [sum(h) / len(h) for h in heads]
    attn = estimates["same_blocks"]
    result = {
        "command": " ".join(["experiments/attention_dof.py", *sys.argv[1:]]), "model": args.model, "lam": args.lam,
        "seq_len": args.seq_len, "attention_dof": estimates, "kernel_dof": kernel_dof, "restore_gain": gain,
        "alone_kl": alone,
        "spearman": {
            "attention dof vs restore gain": spearman(attn, gain),
            "attention dof vs alone damage": spearman(attn, alone),
            f"attention dof ({args.blocks} blocks) vs restore gain": spearman(estimates[f"{args.blocks}_blocks"], gain),
            "kernel dof vs restore gain": spearman(kernel_dof, gain),
            "kernel dof vs alone damage": spearman(kernel_dof, alone),
            "attention dof vs kernel dof": spearman(attn, kernel_dof),
        },
        "top": {"attention dof": top(attn, args.keep),
                f"attention dof ({args.blocks} blocks)": top(estimates[f"{args.blocks}_blocks"], args.keep),
                "kernel dof": top(kernel_dof, args.keep), "restore gain": top(gain, args.keep)},
    }
    print("| layer | kernel DoF | attention DoF | gain |\n|---:|---:|---:|---:|")
    for i in range(len(gain)):
        print(f"| {i} | {kernel_dof[i]:.1f} | {attn[i]:.1f} | {gain[i]:.3f} |")
    for name, value in result["spearman"].items():
        print(f"Spearman, {name}: {value:+.2f}")
    for name, layers in result["top"].items():
        print(f"top {args.keep} by {name}: {layers}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, values, label in ((axes[0], kernel_dof, "DoF of the softmax kernel"),
                                  (axes[1], attn, "DoF of the attention matrices")):
            ax.scatter(values, gain, s=18)
            for i, (x, y) in enumerate(zip(values, gain)):
                ax.annotate(str(i), (x, y), fontsize=7, xytext=(2, 2), textcoords="offset points")
            rho = spearman(values, gain)
            ax.set_xlabel(f"{label} (Spearman {rho:+.2f})")
        axes[0].set_ylabel("KL gain with the layer's exact attention back (nats)")
        fig.suptitle(f"{args.model}: per layer, what linearizing it costs against its DoF")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
