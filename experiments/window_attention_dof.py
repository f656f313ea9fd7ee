"""What a window leaves to the linear part, per layer: the attention's mass beyond the last W keys, and the DoF of
that part of the attention matrices beside the DoF of the whole.

    python experiments/window_attention_dof.py --window 64 --out docs/results/window-attention-dof.json \
        --plot docs/results/window-attention-dof.png

With a window, a layer's features only produce the attention beyond each query's last W keys. `--dims attn-dof`
allocates by the DoF of the whole matrices (`dofattn.dof.attention_dof`); `attention_dof(..., window=W)` counts
the directions of the part beyond the window against the whole matrix's energy. This script measures both, the
mass beyond the window and how much of it sits on the first --sink keys (an attention sink), on the blocks
`dofattn distill --dims attn-dof --seed S` estimates on (--blocks training blocks of --seq-len tokens), and
compares the dims each allocates at a mean of --budget features per layer (`dofattn.dof.allocate`). No training:
one teacher forward per block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.dof_sensitivity import compare  # noqa: E402
from experiments.layer_sensitivity import spearman, top  # noqa: E402
from dofattn.ops.softmax import attention_logits, expand_kv  # noqa: E402


def far_mass(query: torch.Tensor, key: torch.Tensor, scaling: float, window: int,
             sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H] twice: the mean over queries t >= W of their softmax attention's mass on keys s <= t - W, and of the
    part of it on the first `sink` keys (float64)."""
    A = torch.softmax(attention_logits(query, key, scaling, torch.float64), -1)   # [B, H, T, T]
    T = A.shape[-1]
    far = torch.ones(T, T, dtype=torch.bool, device=A.device).tril(-window)
    return (A * far).sum(-1)[..., window:].mean(-1), (A * far)[..., :sink].sum(-1)[..., window:].mean(-1)


def main() -> int:
    from tqdm import tqdm

    from dofattn.model.capture import capture, run_forward
    from dofattn.data import token_blocks
    from dofattn.dof import allocate, attention_dof
    from dofattn.model.hf import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-sample")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512, help="distill's estimate: min(--eval-seq-len, 512)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="distill's --seed: which training blocks")
    parser.add_argument("--lam", type=float, default=2.0 ** -8)
    parser.add_argument("--budget", type=int, default=64, help="mean features per layer for the dims compared")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--sink", type=int, default=4, help="report the mass beyond the window on the first SINK keys")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if not 0 < args.window < args.seq_len:
        parser.error(f"--window must be between 1 and --seq-len - 1 ({args.seq_len - 1}), got {args.window}")

    model, tokenizer = load_model(args.model)[:2]
    model.eval()
    blocks = token_blocks(args.data, tokenizer, args.seq_len, args.blocks, split="train", seed=args.seed)
    sums: dict[str, dict[int, torch.Tensor]] = {"whole": {}, "beyond": {}, "mass": {}, "sink_mass": {}}

    def sink(x) -> None:
        key = expand_kv(x.key, x.num_heads)
        mass, sink_mass = far_mass(x.query, key, x.scaling, args.window, args.sink)
        for name, value in (("whole", attention_dof(x.query, key, x.scaling, args.lam)),
                            ("beyond", attention_dof(x.query, key, x.scaling, args.lam, args.window)),
                            ("mass", mass), ("sink_mass", sink_mass)):
            sums[name][x.layer] = sums[name].get(x.layer, 0) + value.sum(0)   # [H]

    with torch.no_grad(), capture(model, sink):
        for block in tqdm(blocks, desc="attention", unit="block"):
            run_forward(model, block[None])
    layers = sorted(sums["whole"])
    per_layer = {name: [float(sums[name][i].mean()) / len(blocks) for i in layers] for name in sums}
    total = args.budget * len(layers)
    dims = {name: allocate(per_layer[name], total) for name in ("whole", "beyond")}
    result = {
        "command": " ".join(["experiments/window_attention_dof.py", *sys.argv[1:]]), "model": args.model,
        "window": args.window, "seq_len": args.seq_len, "blocks": args.blocks, "seed": args.seed, "lam": args.lam,
        "attention_dof": per_layer["whole"], "beyond_window_dof": per_layer["beyond"],
        "beyond_window_mass": per_layer["mass"], "sink": args.sink, "sink_mass": per_layer["sink_mass"],
        "heads": {name: [(sums[name][i] / len(blocks)).tolist() for i in layers] for name in sums},
        "dims": dims, "dims_compared": compare(dims["beyond"], dims["whole"]),
        "spearman": {"beyond-window DoF vs whole DoF": spearman(per_layer["beyond"], per_layer["whole"]),
                     "beyond-window mass vs whole DoF": spearman(per_layer["mass"], per_layer["whole"]),
                     "beyond-window DoF vs mass": spearman(per_layer["beyond"], per_layer["mass"])},
        "top": {name: top(per_layer[name], args.keep) for name in sums},
    }
    print(f"| layer | attention DoF | beyond {args.window}: DoF | beyond: mass | of it on the first {args.sink} keys "
          f"| dims: whole | dims: beyond |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i in layers:
        print(f"| {i} | {per_layer['whole'][i]:.1f} | {per_layer['beyond'][i]:.1f} | {per_layer['mass'][i]:.3f} "
              f"| {per_layer['sink_mass'][i]:.3f} | {dims['whole'][i]} | {dims['beyond'][i]} |")
    for name, value in result["spearman"].items():
        print(f"Spearman, {name}: {value:+.2f}")
    print(f"dims, beyond against whole: {result['dims_compared']}")
    print(f"top {args.keep}: {result['top']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, mass_ax) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
        x = torch.arange(len(layers), dtype=torch.float64)
        ax.bar(x - 0.2, per_layer["whole"], 0.4, label="whole attention matrix")
        ax.bar(x + 0.2, per_layer["beyond"], 0.4, label=f"beyond the last {args.window} keys")
        ax.set_ylabel("DoF (mean over heads)")
        ax.legend(fontsize=8)
        mass_ax.bar(x, per_layer["mass"], 0.6, color="tab:gray", label=f"beyond the last {args.window} keys")
        mass_ax.bar(x, per_layer["sink_mass"], 0.6, color="tab:red", label=f"of it on the first {args.sink} keys")
        mass_ax.set_ylabel("attention mass")
        mass_ax.legend(fontsize=8)
        mass_ax.set_xlabel("layer")
        fig.suptitle(f"{args.model}: what a {args.window}-token window leaves to the linear part")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
