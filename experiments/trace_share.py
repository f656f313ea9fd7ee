"""How much of each head's Gram trace its single largest-norm point holds, next to the head's DoF.

    python experiments/trace_share.py --layers 0 7 23 [--model smollm2-135m] [--lam 0.00390625]
    python experiments/trace_share.py --model gemma3-270m --layers all --json docs/results/trace-share-gemma3.json

Trace-relative DoF counts how spread the kernel's energy is across points: a head where one outlier holds most of
tr G has a DoF near 1. Prints one line per head: its DoF, the top point's share of tr G, how many points hold the
trace (exp of the entropy of G_ii / tr G), the median and largest exponent s|x|^2 of its sampled queries and of its
keys, and the DoF of the same points' kernel with every point weighted alike (the unit-diagonal Gaussian kernel K of
the estimator, N = sum of e / (e + lam J) over its eigenvalues e): what the DoF would be if no point's norm
outweighed another's.
"""

import argparse
import json

import torch

from dofattn.data import token_blocks
from dofattn.dof import PointSampler, head_dof
from dofattn.model.capture import capture, run_forward
from dofattn.model.hf import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", nargs="+", default=["0", "7", "23"], help="layer indices, or all")
    parser.add_argument("--lam", type=float, default=2.0 ** -8)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--balance", action="store_true",
                        help="first scale each head's queries by c and its keys by 1/c, c^4 = mean |k|^2 / mean |q|^2 "
                             "(the attention's q.k is unchanged; the union's norms are balanced)")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    blocks = token_blocks("wiki-sample", tokenizer, args.seq_len, args.num_blocks)
    sampler = PointSampler(args.num_blocks, args.seq_len, args.samples)     # as dofattn.dof.sample_points draws
    with capture(model, sampler), torch.no_grad():
        for start in range(0, args.num_blocks, 4):
            sampler.offset = start
            run_forward(model, blocks[start:start + 4])
    layers = sorted(sampler.points) if args.layers == ["all"] else [int(x) for x in args.layers]
    print(f"{'layer':>5} {'head':>4} {'DoF':>7} {'top share':>9} {'points':>7} {'q med/max s|x|^2':>17} "
          f"{'k med/max s|x|^2':>17} {'DoF, alike':>10}")
    rows = []
    for layer in layers:
        points, scaling = sampler.points[layer].double(), sampler.scaling[layer]
        is_key = sampler._where[layer][..., 0] == 1                   # [H, J]
        if args.balance:
            norms = points.square().sum(-1)
            ratio = (norms * is_key).sum(-1) / is_key.sum(-1) / ((norms * ~is_key).sum(-1) / (~is_key).sum(-1))
            c = ratio.clamp_min(1e-12) ** 0.25                         # [H]
            points = torch.where(is_key[..., None], points / c[:, None, None], points * c[:, None, None])
        log_diag = scaling * points.square().sum(-1)                 # [H, J]
        weights = torch.softmax(log_diag, -1)
        share = weights.max(-1).values                               # [H]
        spread = torch.exp(-(weights * weights.clamp_min(1e-300).log()).sum(-1))
        dof = head_dof(points, scaling, args.lam)                    # [H]
        sq = points.square().sum(-1)
        dist2 = (sq[..., :, None] + sq[..., None, :] - 2 * points @ points.transpose(-1, -2)).clamp_min(0)
        eig = torch.linalg.eigvalsh(torch.exp(-0.5 * scaling * dist2)).clamp_min(0)     # [H, J]
        alike = (eig / (eig + args.lam * points.shape[1])).sum(-1)
        for h in range(points.shape[0]):
            q, k = log_diag[h][~is_key[h]], log_diag[h][is_key[h]]
            row = {"layer": layer, "head": h, "dof": dof[h].item(), "top_share": share[h].item(),
                   "points": spread[h].item(), "q_median": q.median().item(), "q_max": q.max().item(),
                   "k_median": k.median().item(), "k_max": k.max().item(), "dof_alike": alike[h].item()}
            rows.append(row)
            print(f"{layer:>5} {h:>4} {row['dof']:>7.2f} {row['top_share']:>9.3f} {row['points']:>7.1f} "
                  f"{row['q_median']:>8.1f}/{row['q_max']:<8.1f} {row['k_median']:>8.1f}/{row['k_max']:<8.1f} "
                  f"{row['dof_alike']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "lam": args.lam, "samples": args.samples, "num_blocks": args.num_blocks,
                       "seq_len": args.seq_len, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
