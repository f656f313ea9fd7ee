"""The linear-attention op on CUDA, in detail: dofattn's Triton kernels against fla and SDPA, forward and training.

    python benchmarks/cuda_ops.py --out docs/results/cuda-ops.json

For every feature dim M and length T (bf16, B = 1, H = 12, V = 64, causal), the median of --repeats CUDA-event
timings of:
    sdpa, sdpa_train        softmax attention (flash), forward / forward + backward
    triton, triton_graph    dofattn's op, eager / replayed from a CUDA graph (the difference is launch overhead)
    triton_train            forward + backward
    triton_decay[_train]    the same with a per-head decay (log γ from -2^-4 to -2^-11 over the heads)
    chunk_decay[_train]     the decayed op in PyTorch (`ops.chunk`), what a decayed layer ran on CUDA before the
                            Triton kernels had a decay (up to --max-train-T)
    triton_gate[_train]     the same with a gate (a log factor per token and head, -2^-4 to -2^-11 by head, times
                            a random factor in [0.5, 1.5]: `log_gates`)
    chunk_gate[_train]      the gated op in PyTorch (`ops.chunk`), what a gated layer ran on CUDA before the
                            Triton kernels had a gate (up to --max-train-T)
    fla, fla_train          flash-linear-attention's chunk_linear_attn through `ops.fla` (if fla imports)
    window, window_train    the sliding-window hybrid (--window W tokens exact + the linear op beyond) in
                            dofattn's Triton kernels, forward / forward + backward
    window_decay[_train]    the same with the decay in its linear part
    window_torch[_train]    the same hybrid in its PyTorch form (banded blocks + the Triton linear op)
    features                the PRF feature map of the queries in one Triton kernel (`triton/prf.py`)
    features@P              with --exact P,...: the same with its projection at input precision P instead of the
                            default for bf16 (`common.EXACT_HALF`), and features@P_err: the largest difference from
                            the default's result, relative to its largest entry
    triton@C,S,W            with --scan-launch C,S,W;...: the op with its scan launched at chunk C, S pipeline
                            stages and W warps instead of `scan._scan_launch`'s choice, and triton@C,S,W_err: its
                            largest difference from the default's output (`kernel_registers.py` reports the spills
                            of each launch)
plus the op's memory floor: reading φq, φk, v and writing o once, at the copy bandwidth measured here.
Training rows stop at --max-train-T (SDPA's backward and the others' activations grow with T).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dofattn.jobs.bench import cuda_time, hardware  # noqa: E402
from dofattn.ops import fla_available, linear_attention  # noqa: E402
from dofattn.ops.window import blocked_window_linear_attention, window_linear_attention  # noqa: E402


def graphed(fn):
    """fn captured into a CUDA graph; returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.empty(2 ** 30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 2 / (ms / 1e3)


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def safe(fn, repeats):
    """The median time, or the error's one-line text: out of memory, or a launch Triton cannot fit (its
    OutOfResources is not a RuntimeError), must not end the run."""
    try:
        ms = cuda_time(fn, repeats)
        print(f" {ms:.3f}", end="", flush=True)           # as it goes: a run cut short still shows its numbers
        return ms
    except Exception as error:  # noqa: BLE001 - every failure becomes that row's text
        torch.cuda.empty_cache()
        return error_text(error)


def window_rows(q, k, v, phi_q, phi_k, window, repeats, train: bool) -> dict:
    """The hybrid's timings: Triton kernels against the PyTorch form, forward and (train) forward + backward; the
    Triton kernels with a decay too."""
    B, T, H, _ = q.shape
    scale = torch.zeros(B, T, H, device="cuda")
    offset = torch.zeros(H, device="cuda")
    inputs = (q, k, v, phi_q, phi_k, scale, offset)
    forms = {"window": (window_linear_attention, None), "window_torch": (blocked_window_linear_attention, None),
             "window_decay": (window_linear_attention, log_decays(H))}
    row = {}
    for name, (op, log_decay) in forms.items():   # backend triton: the Triton hybrid, or the Triton linear op
        with torch.no_grad():
            row[name] = safe(lambda: op(*inputs, 0.125, window, backend="triton", log_decay=log_decay), repeats)
        if train:
            leaves = [x.detach().clone().requires_grad_() for x in inputs]
            decay = None if log_decay is None else log_decay.clone().requires_grad_()
            row[name + "_train"] = safe(lambda: op(*leaves, 0.125, window, backend="triton", log_decay=decay)[0]
                                        .float().sum().backward(), repeats)
    return row


def log_decays(heads: int) -> torch.Tensor:
    """log γ per head, -2^-4 to -2^-11: half-lives of about 11 to 1 400 tokens."""
    return -torch.exp2(-torch.linspace(4, 11, heads, device="cuda"))


def log_gates(T: int, heads: int) -> torch.Tensor:
    """Log gates [1, T, H]: each head's `log_decays` value times a per-token factor in [0.5, 1.5]."""
    g = torch.Generator(device="cuda").manual_seed(T)
    return log_decays(heads) * (0.5 + torch.rand(1, T, heads, generator=g, device="cuda"))


def exact_rows(q, M, repeats, precisions) -> dict:
    """The PRF feature map's forward (queries, one kernel) at the default projection precision for q's dtype
    (`common.exact_precision`) and at each of `precisions`, with each one's largest difference from the default."""
    from dofattn.features import MAX_KEY_EXCESS, make_feature_map
    from dofattn.ops import load_triton

    kernels = load_triton()[0]
    common = kernels.common
    H, D = q.shape[2:]
    fmap = make_feature_map("prf", H, D, M, scaling=D ** -0.5).to(q.device)

    def features():
        return kernels.prf.prf_features(fmap.prf(), q, "query", MAX_KEY_EXCESS)[0]

    default, row, ref = common.exact_precision(q), {}, None
    saved = common.EXACT, common.EXACT_HALF
    try:
        for precision in [default, *precisions]:
            common.EXACT = common.EXACT_HALF = precision
            suffix = "" if precision == default else "@" + precision
            with torch.no_grad():
                row["features" + suffix] = safe(features, repeats)
                out = features().float()
            if ref is None:
                ref = out
            else:
                row[f"features{suffix}_err"] = float((out - ref).abs().max() / ref.abs().max())
    finally:
        common.EXACT, common.EXACT_HALF = saved
    return row


def launch_rows(phi_q, phi_k, v, repeats, launches) -> dict:
    """The op's forward with the scan's (chunk, stages, warps) forced to each of `launches`, and each one's largest
    difference from the default launch's output, relative to its largest entry."""
    from dofattn.ops import load_triton

    if not launches:
        return {}
    scan = load_triton()[0].scan
    try:
        ref = linear_attention(phi_q, phi_k, v, backend="triton")[0].float()
    except Exception as error:  # noqa: BLE001 - the default launch failed: nothing to compare against
        return {"launches": error_text(error)}
    row, chosen = {}, scan._scan_launch
    try:
        for launch in launches:
            name = "triton@" + ",".join(map(str, launch))
            scan._scan_launch = lambda BK, gate=False, launch=launch: launch
            row[name] = safe(lambda: linear_attention(phi_q, phi_k, v, backend="triton"), repeats)
            if isinstance(row[name], float):
                out = linear_attention(phi_q, phi_k, v, backend="triton")[0].float()
                row[name + "_err"] = float((out - ref).abs().max() / ref.abs().max())
                del out
    finally:
        scan._scan_launch = chosen
    return row


def run(dims, lengths, repeats, max_train_T, window=64, heads=12, V=64, precisions=(), launches=(),
        save=lambda result: None):
    """Every row, timed in turn; `save` gets the result so far after each row, so a run cut short keeps them."""
    bandwidth = copy_bandwidth()
    rows = []
    for M in dims:
        for T in lengths:
            g = torch.Generator(device="cuda").manual_seed(T + M)
            phi_q, phi_k = (torch.rand(1, T, heads, M, generator=g, device="cuda").bfloat16() for _ in range(2))
            q, k, v = (torch.randn(1, T, heads, V, generator=g, device="cuda").bfloat16() for _ in range(3))
            qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
            print(f"M={M} T={T}:", end="", flush=True)
            floor_ms = (2 * T * heads * M + 2 * T * heads * V) * 2 / bandwidth * 1e3
            row = {"M": M, "T": T, "heads": heads, "V": V, "dtype": "bfloat16", "floor_ms": floor_ms,
                   "sdpa": safe(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), repeats),
                   "triton": safe(lambda: linear_attention(phi_q, phi_k, v, backend="triton"), repeats)}
            log_decay = log_decays(heads)
            row["triton_decay"] = safe(lambda: linear_attention(phi_q, phi_k, v, backend="triton",
                                                                log_decay=log_decay), repeats)
            log_gate = log_gates(T, heads)
            row["triton_gate"] = safe(lambda: linear_attention(phi_q, phi_k, v, backend="triton",
                                                               log_gate=log_gate), repeats)
            try:
                row["triton_graph"] = cuda_time(graphed(lambda: linear_attention(phi_q, phi_k, v, backend="triton")),
                                                repeats)
            except RuntimeError as error:
                row["triton_graph"] = error_text(error)
            if fla_available():
                row["fla"] = safe(lambda: linear_attention(phi_q, phi_k, v, backend="fla"), repeats)
            if T <= max_train_T:
                leaves = [x.detach().clone().requires_grad_() for x in (phi_q, phi_k, v)]
                heads_layout = [x.detach().clone().requires_grad_() for x in (qh, kh, vh)]

                def train(backend, log_decay=None, log_gate=None):
                    decay = None if log_decay is None else log_decay.clone().requires_grad_()
                    gate = None if log_gate is None else log_gate.clone().requires_grad_()
                    o, _ = linear_attention(*leaves, backend=backend, log_decay=decay, log_gate=gate)
                    o.float().sum().backward()

                def sdpa_train():
                    F.scaled_dot_product_attention(*heads_layout, is_causal=True).float().sum().backward()

                row["sdpa_train"] = safe(sdpa_train, repeats)
                row["triton_train"] = safe(lambda: train("triton"), repeats)
                row["triton_decay_train"] = safe(lambda: train("triton", log_decay), repeats)
                row["chunk_decay"] = safe(lambda: linear_attention(phi_q, phi_k, v, backend="chunk",
                                                                   log_decay=log_decay), repeats)
                row["chunk_decay_train"] = safe(lambda: train("chunk", log_decay), repeats)
                row["triton_gate_train"] = safe(lambda: train("triton", log_gate=log_gate), repeats)
                row["chunk_gate"] = safe(lambda: linear_attention(phi_q, phi_k, v, backend="chunk",
                                                                  log_gate=log_gate), repeats)
                row["chunk_gate_train"] = safe(lambda: train("chunk", log_gate=log_gate), repeats)
                if fla_available():
                    row["fla_train"] = safe(lambda: train("fla"), repeats)
            if window:
                row.update(window_rows(q, k, v, phi_q, phi_k, window, repeats, T <= max_train_T))
            row.update(exact_rows(q, M, repeats, precisions))
            row.update(launch_rows(phi_q, phi_k, v, repeats, launches))
            rows.append(row)
            print("\n" + " ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                           for key, value in row.items()), flush=True)
            save({"copy_bandwidth_bytes_per_s": bandwidth, "rows": rows})
            del phi_q, phi_k, q, k, v, qh, kh, vh
            torch.cuda.empty_cache()
    return {"copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--lengths", default="2048,8192,32768,131072")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-train-T", type=int, default=32768)
    parser.add_argument("--window", type=int, default=64, help="the hybrid's window (16, 32 or 64); 0: no rows")
    parser.add_argument("--exact", default="", help="comma-separated input precisions (ieee, tf32) to time the "
                        "feature map's projection at, against the default")
    parser.add_argument("--scan-launch", default="", help="semicolon-separated chunk,stages,warps launches of the "
                        "scan to time against its default, e.g. '32,2,8;64,2,8'")
    parser.add_argument("--out", default="cuda-ops.json")
    args = parser.parse_args()
    try:
        launches = [tuple(int(x) for x in item.split(",")) for item in args.scan_launch.split(";") if item]
    except ValueError:
        launches = [()]
    if any(len(launch) != 3 or launch[0] not in (16, 32, 64) or min(launch) < 1 for launch in launches):
        parser.error(f"--scan-launch takes chunk,stages,warps triples with a chunk of 16, 32 or 64, separated by ';'; "
                     f"got {args.scan_launch!r}")
    if not torch.cuda.is_available():
        print("cuda_ops.py needs a CUDA GPU", file=sys.stderr)
        return 2
    about = {"hardware": hardware("cuda"), "command": " ".join(sys.argv)}

    def save(result):
        Path(args.out).write_text(json.dumps({**result, **about}, indent=2))

    save(run([int(x) for x in args.dims.split(",")], [int(x) for x in args.lengths.split(",")], args.repeats,
             args.max_train_T, args.window, precisions=[p for p in args.exact.split(",") if p], launches=launches,
             save=save))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
