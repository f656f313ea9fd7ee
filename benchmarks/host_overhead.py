"""The host's share of a prefill through dofattn's Triton op: the Python of the call path, with every kernel launch
replaced by a no-op, on CPU tensors, without a GPU.

    python benchmarks/host_overhead.py [--T 8192] [--heads 12] [--features 128] [--out host_overhead.json]

At 8K tokens the op is bound by the host on a GPU (its kernels take about 0.06 ms from a CUDA graph on an H100),
so the Python between the call and the launches is part of its time. This times that Python alone, as the best
CPU time per call over batches (`time.process_time`, so other processes on the machine count less), for:
    linear_attention        `ops.linear_attention(..., backend="triton")` without autograd, bf16 inputs
    window_forward          the window-64 hybrid's prefill (`triton/window.py: window_forward`) without autograd
Triton's own launch cost (its launcher, per kernel) is not in these numbers: the stubs replace it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"          # lets the module load without a GPU; no kernel runs here

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dofattn.ops import linear_attention, load_triton  # noqa: E402

KERNELS = {"scan": ("_block_state", "_prefix_states", "_block_scan", "_decode_step"), "window": ("_window_exact",)}


class NoLaunch:
    """Stands for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def best_cpu_us(fn, calls: int = 50, batches: int = 30) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(batches):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls * 1e6)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--out", default="host_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = load_triton()[0]
    for module, names in KERNELS.items():
        for name in names:
            setattr(getattr(kernels, module), name, NoLaunch())
    T, H, M, D = args.T, args.heads, args.features, 64
    phi_q, phi_k = (torch.rand(1, T, H, M).bfloat16() for _ in range(2))
    q, k, v = (torch.randn(1, T, H, D).bfloat16() for _ in range(3))
    scale, offset = torch.zeros(1, T, H), torch.zeros(H)
    with torch.no_grad():
        rows = {"linear_attention": best_cpu_us(lambda: linear_attention(phi_q, phi_k, v, backend="triton")),
                "window_forward": best_cpu_us(lambda: kernels.window.window_forward(q, k, v, phi_q, phi_k, scale,
                                                                                    offset, 0.125, 64))}
    for name, us in rows.items():
        print(f"{name:>18}: {us:.1f} us of host CPU time per call")
    result = {"us_per_call": rows, "T": T, "heads": H, "features": M, "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__, "command": " ".join(sys.argv)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
