"""What a student's short convolutions learned: per layer, how much of q, k and v comes from the tokens before.

    python experiments/conv_stats.py runs/hh-gate-conv4-mlp [--out conv-stats.json] [--plot conv-stats.png]

A filter (`--conv K`, `attention.LinearAttention`) weighs the token itself by w_0 and the token j back by w_j, one
filter per channel, started at w_0 = 1 and w_j = 0. For each layer and each of q, k and v this prints the mean over
channels of |w_j| for every tap j, the share of the filter's absolute weight that lies on earlier tokens,
Σ_{j≥1} |w_j| / Σ_j |w_j| (0 at the start), and the signed mean of w_j over channels. A tap that moved the same way
in every channel (a shared shape, such as a previous-token filter) has a signed mean as large as its mean |w_j|; one
that drifted by noise, each channel its own sign, has a signed mean near 0. It reads the student's saved tensors
only; no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from dofattn.model.student import read_spec
from dofattn.spec import WEIGHTS_FILE

STREAMS = ("q", "k", "v")
NAME = re.compile(r"\.layers\.(\d+)\..*\.dofattn\.(?:conv\.)?conv_([qkv])$")   # (older folders: no part)


def filter_stats(weights: dict[str, torch.Tensor]) -> list[dict]:
    """[{"layer", "q"|"k"|"v": {"taps": [mean |w_j| over channels], "earlier": share, "signed": [mean w_j over
    channels]}}] from a student's tensors, by layer."""
    layers: dict[int, dict] = {}
    for name, w in weights.items():
        match = NAME.search(name)
        if match is None:
            continue
        w = w.float().flatten(1)                                             # [K, channels]
        taps = w.abs()
        layers.setdefault(int(match[1]), {})[match[2]] = {
            "taps": [round(float(x), 4) for x in taps.mean(1)],
            "earlier": round(float(taps[1:].sum() / taps.sum().clamp_min(1e-12)), 4),
            "signed": [round(float(x), 4) for x in w.mean(1)]}
    return [{"layer": i, **layers[i]} for i in sorted(layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("student", help="a student folder distilled with --conv K")
    parser.add_argument("--out", help="write the numbers to this JSON file")
    parser.add_argument("--plot", help="draw the share on earlier tokens per layer to this PNG")
    args = parser.parse_args()
    config = read_spec(args.student)
    if not config.attention.conv:
        raise SystemExit(f"{args.student} has no convolutions (distill it with --conv K)")
    rows = filter_stats(load_file(str(Path(args.student) / WEIGHTS_FILE)))
    width = config.attention.conv
    print(f"{args.student}: conv {width}; per layer, mean |w_j| over channels for j = 0..{width - 1}, "
          f"the share of |w| on earlier tokens, and [the signed mean w_j of the earlier taps]")
    for row in rows:
        cells = [f"{s}: {' '.join(f'{x:.3f}' for x in row[s]['taps'])} ({row[s]['earlier']:.2f}) "
                 f"[{' '.join(f'{x:+.3f}' for x in row[s]['signed'][1:])}]" for s in STREAMS]
        print(f"layer {row['layer']:2d}  " + "  ".join(cells))
    if args.out:
        Path(args.out).write_text(json.dumps({"student": args.student, "conv": config.attention.conv, "layers": rows},
                                             indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        for s in STREAMS:
            ax.plot([r["layer"] for r in rows], [r[s]["earlier"] for r in rows], marker="o", label=s)
        ax.set(xlabel="layer", ylabel="share of |w| on earlier tokens", ylim=(0, None),
               title=f"{Path(args.student).name}: what the {config.attention.conv}-token filters take from the "
                     f"tokens before")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
