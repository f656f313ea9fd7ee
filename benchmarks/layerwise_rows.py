"""What one layerwise step costs at length: the softmax loss on every row against a sample of rows
(`layerwise.rows`), for a layer shaped as SmolLM2-135M's (9 heads of 64, a window of 64, a sink of 4, a decay per
head, M PRF features), on random queries and keys.

    python benchmarks/layerwise_rows.py --lengths 512 2048 8192 --rows 0 256 --out layerwise_rows.json

Each (length, rows) times `--steps` Adam steps (forward, backward, update; after one warm-up) of one layer on
`--batch` blocks, and the process's peak resident memory above what it held before (`bench.PeakMemory`); a full
loss (rows 0) above `--max-full` tokens is skipped (T × T per head and block: 9.7 GB at 8 K, batch 4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_time(T: int, rows: int, batch: int, features: int, steps: int) -> dict:
    from dofattn.attention import LinearAttention
    from dofattn.jobs.bench import PeakMemory
    from dofattn.distill.losses import sample_rows, softmax_loss
    from dofattn.features import make_feature_map
    from dofattn.spec import Attention

    H, D = 9, 64
    layer = LinearAttention(Attention(window=64, sink=4, decay="head"),
                            make_feature_map("prf", H, D, features, scaling=D ** -0.5, seed=0))
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, T, H, D, generator=g) for _ in range(2))
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.02)
    times, peak = [], PeakMemory("cpu")
    peak.start()
    for i in range(steps + 1):
        start = time.perf_counter()
        at = sample_rows(T, rows, g) if 0 < rows < T else None
        loss = softmax_loss(layer, q, k, k, D ** -0.5, at=at)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i:
            times.append(time.perf_counter() - start)
    above = peak.above()
    return {"length": T, "rows": rows, "batch": batch, "features": features, "step_s": statistics.median(times),
            "peak_mib": None if above is None else above / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--features", type=int, default=74, help="M (74: the long-context student's mean)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-full", type=int, default=2048)
    parser.add_argument("--out", default="layerwise_rows.json")
    args = parser.parse_args()
    results = []
    for T in args.lengths:
        for rows in args.rows:
            if (rows == 0 or rows >= T) and T > args.max_full:
                continue
            row = step_time(T, rows, args.batch, args.features, args.steps)
            results.append(row)
            print(f"T {T:6}  rows {rows or 'all':>5}: {row['step_s']:.2f} s a step, peak +{row['peak_mib'] or 0:.0f} "
                  f"MiB", flush=True)
    Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
