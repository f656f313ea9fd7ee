"""CPU forward time of the naive (quadratic) and chunked linear-attention ops at growing sequence lengths.

    python benchmarks/ops_cpu.py [--lengths 512 2048 8192] [--chunk-sizes 64] [--repeats 5] [--out ops_cpu.json]
    python benchmarks/ops_cpu.py --lengths 512 --batch 2 --gate --backward    # what a gate costs in training

Shapes: B=1, H=9, M=64, V=64, float32, no grad. Each op is run once to warm up, then timed `--repeats` times with
time.perf_counter; the median is reported, in a printed table and in the JSON file `--out`. The naive op holds
B·H·T² floats twice (scores and masked scores): 4.8 GB at T=8192. It is skipped, with a note in the table and the
JSON, when that would exceed `--max-naive-gb` or half the memory available now.

--gate adds the chunked op with a gate (a decay per token). --backward times forward plus backward of the output's
sum (inputs requiring gradients), as training runs them.

Timings on a shared machine are only as good as its idleness: check the load first (`uptime`), or pin `--threads`.
"""

import argparse
import json
import platform
import statistics
import time

import torch

from dofattn.ops import chunk_linear_attention, naive_linear_attention


def available_gb() -> float:
    """MemAvailable from /proc/meminfo in GB (inf where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return float("inf")


def time_ms(fn, repeats: int) -> list[float]:
    """Wall times of `repeats` calls of fn() in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def make_inputs(T: int, B: int = 1, H: int = 9, M: int = 64, V: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(B, T, H, M, generator=g)                         # [B, T, H, M]
    phi_k = torch.rand(B, T, H, M, generator=g)                         # [B, T, H, M]
    v = torch.randn(B, T, H, V, generator=g)                            # [B, T, H, V]
    return phi_q, phi_k, v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-naive-gb", type=float, default=8.0, help="skip naive above this score memory")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="ops_cpu.json")
    parser.add_argument("--batch", type=int, default=1, help="B (default 1)")
    parser.add_argument("--gate", action="store_true", help="also the gated chunk op")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    B, H, M, V = args.batch, 9, 64, 64
    rows = []
    with torch.set_grad_enabled(args.backward):
        for T in args.lengths:
            phi_q, phi_k, v = (x.requires_grad_(args.backward) for x in make_inputs(T, B, H, M, V))
            g = torch.Generator().manual_seed(1)
            log_gate = (-0.01 * torch.rand(B, T, H, generator=g)).requires_grad_(args.backward)
            ops = [("naive", None, lambda: naive_linear_attention(phi_q, phi_k, v))]
            ops += [("chunk", C, lambda C=C: chunk_linear_attention(phi_q, phi_k, v, chunk_size=C))
                    for C in args.chunk_sizes]
            if args.gate:
                ops += [("gate", C, lambda C=C: chunk_linear_attention(phi_q, phi_k, v, chunk_size=C,
                                                                        log_gate=log_gate))
                        for C in args.chunk_sizes]
            if args.backward:
                ops = [(name, C, lambda fn=fn: fn()[0].sum().backward()) for name, C, fn in ops]
            for name, C, fn in ops:
                row = {"T": T, "op": name, "chunk_size": C}
                need_gb = 2 * B * H * T * T * 4 / 1e9
                if name == "naive" and need_gb > min(args.max_naive_gb, available_gb() / 2):
                    row["skipped"] = f"needs ~{need_gb:.1f} GB of scores, {available_gb():.1f} GB available"
                else:
                    times = time_ms(fn, args.repeats)
                    row.update(median_ms=statistics.median(times), runs_ms=times)
                rows.append(row)

    config = {"B": B, "H": H, "M": M, "V": V, "dtype": "float32", "grad": args.backward, "repeats": args.repeats,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or
              platform.machine()}
    with open(args.out, "w") as f:
        json.dump({"config": config, "results": rows}, f, indent=2)

    print(f"{'T':>6} {'op':>10} {'median ms':>10} {'vs naive':>9}")
    naive_ms = {row["T"]: row.get("median_ms") for row in rows if row["op"] == "naive"}
    for row in rows:
        op = row["op"] if row["chunk_size"] is None else f"{row['op']}{row['chunk_size']}"
        if "skipped" in row:
            print(f"{row['T']:>6} {op:>10} {'skipped':>10}  ({row['skipped']})")
            continue
        speedup = f"{naive_ms[row['T']] / row['median_ms']:.1f}x" if naive_ms.get(row["T"]) else "-"
        print(f"{row['T']:>6} {op:>10} {row['median_ms']:>10.1f} {speedup:>9}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
