"""How much of each head's Gram trace its single largest-norm point holds, next to the head's DoF.

    python experiments/trace_share.py --layers 0 7 23 [--model smollm2-135m] [--lam 0.00390625]

Trace-relative DoF counts how spread the kernel's energy is across points: a head where one outlier holds most of
tr G has a DoF near 1. Prints one line per head.
"""

import argparse

import torch

from dofattn.data import token_blocks
from dofattn.dof import head_dof, sample_points
from dofattn.model.hf import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 7, 23])
    parser.add_argument("--lam", type=float, default=2.0 ** -8)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    blocks = token_blocks("wiki-sample", tokenizer, args.seq_len, args.num_blocks)
    sample = sample_points(model, blocks, args.samples)
    print(f"{'layer':>5} {'head':>4} {'DoF':>7} {'top share':>9} {'max s|x|^2':>10}")
    for layer in args.layers:
        points, scaling = sample.points[layer].double(), sample.scaling[layer]
        log_diag = scaling * points.square().sum(-1)                 # [H, J]
        share = torch.softmax(log_diag, -1).max(-1).values          # [H]
        dof = head_dof(points, scaling, args.lam)                   # [H]
        for h in range(points.shape[0]):
            print(f"{layer:>5} {h:>4} {dof[h].item():>7.2f} {share[h].item():>9.3f} {log_diag[h].max().item():>10.1f}")


if __name__ == "__main__":
    main()
