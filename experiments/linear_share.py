"""Where a window student's long-context gap comes from: per layer and by position, the share of each query's
normaliser that the linear branch takes, against the teacher's own mass beyond the window, and the layer's output
error against the teacher's attention output.

    python experiments/linear_share.py runs/distill --length 8192 --out docs/results/linear-share.json \
        --plot docs/results/linear-share.png

The teacher runs once over a block of `--length` tokens of the validation articles (joined, as `dofattn eval`
reads them); every linearized layer's q, k, v are captured there, so each layer is judged on the same inputs as
its teacher (no drift from the layers below). For each query t, by buckets of position (64-127, ..., 4-8 K):
- `teacher_far`: the teacher's attention mass on the keys the student's linear branch stands in for (s <= t - W,
  not a sink key), of its whole row;
- `student_linear`: the linear branch's share of the student's normaliser (`ops.window.window_parts`: e^λ of the
  linear part over the sum over window, sink and linear parts);
- `error`: |o_student - o_teacher| / |o_teacher| of the layer's attention output, mean over heads and queries.
If `student_linear` grows past `teacher_far` with the position, the linear mass drowns the exact window.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch


def buckets(length: int, first: int = 64) -> list[tuple[int, int]]:
    """[lo, hi) position buckets, doubling from `first` (positions below it are inside a 64-token window)."""
    out, lo = [], first
    while lo < length:
        out.append((lo, min(2 * lo, length)))
        lo *= 2
    return out


@torch.no_grad()
def layer_rows(linear, q, k, v, scaling: float, spans, chunk: int = 512) -> dict:
    """By span: teacher_far, student_linear and error of one linear layer on q [1, T, H, D], k, v [1, T, Hkv, D]."""
    from dofattn.ops.softmax import expand_kv
    from dofattn.ops.window import first_keys, window_parts

    a, T = linear.attention, q.shape[1]
    k, v = expand_kv(k, q.shape[2]).float(), expand_kv(v, q.shape[2]).float()
    q = q.float()
    fmap = linear.feature_map
    phi_q, q_scale = fmap.features(q, "query")
    phi_k, k_scale = fmap.features(k, "key")
    sink = first_keys(None, 1, T, a.sink, q.device) if a.sink else None
    parts, _ = window_parts(q, k, v, phi_q, phi_k, q_scale, k_scale + linear.window.log_gain, fmap.scaling,
                            a.window, sink_mask=sink, **linear.op_arguments(v))
    lam = torch.stack([torch.where(has, lam, -torch.inf) for _, lam, has in parts])     # [parts, 1, T, H]
    total = torch.logsumexp(lam, 0)
    student_linear = torch.exp(lam[1] - total)[0]                                       # [T, H]
    o_student = linear.attend(q, k, v)[0][0]                                             # [T, H, V]
    teacher_far = torch.zeros(T, q.shape[2])
    o_teacher = torch.zeros_like(o_student)
    pos = torch.arange(T)
    far_keys = (pos >= a.sink)                                                           # not a sink key
    for lo in range(0, T, chunk):                                                        # the teacher's rows, exact
        rows = slice(lo, min(lo + chunk, T))
        logits = scaling * torch.einsum("thd,shd->hts", q[0, rows], k[0])                # [H, C, T]
        causal = pos[None, :] <= pos[rows, None]
        logits = logits.masked_fill(~causal, -torch.inf)
        weights = torch.softmax(logits, -1)
        o_teacher[rows] = torch.einsum("hts,shv->thv", weights, v[0])
        far = causal & (pos[None, :] <= pos[rows, None] - a.window) & far_keys[None, :]
        teacher_far[rows] = (weights * far).sum(-1).T
    error = (o_student - o_teacher).norm(dim=-1) / o_teacher.norm(dim=-1).clamp_min(1e-12)   # [T, H]
    out = {}
    for lo, hi in spans:
        out[f"{lo}-{hi - 1}"] = {"teacher_far": float(teacher_far[lo:hi].mean()),
                                 "student_linear": float(student_linear[lo:hi].mean()),
                                 "error": float(error[lo:hi].mean())}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("student", help="a window student's folder (dofattn distill)")
    parser.add_argument("--length", type=int, default=8192, help="tokens of the block")
    parser.add_argument("--data", default="wiki-sample", help="text (its validation split)")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    parser.add_argument("--plot", type=Path, help="a figure of the three measures by position, per layer")
    args = parser.parse_args(argv)

    from dofattn.model.capture import capture, run_forward
    from dofattn.data import token_blocks
    from dofattn.evaluate import teacher_mode
    from dofattn.model.student import attention_modules, load_student

    model, tokenizer, spec = load_student(args.student)
    if not spec.attention.window:
        raise SystemExit(f"{args.student} is not a window student (student.window = 0)")
    block = token_blocks(args.data, tokenizer, args.length, 1, split="validation", seed=0)
    modules = attention_modules(model)
    linear = {i: modules[i].dofattn for i in spec.layers}
    spans = buckets(args.length)
    rows: dict[int, dict] = {}

    def record(x) -> None:
        if x.layer in linear:
            rows[x.layer] = layer_rows(linear[x.layer], x.query, x.key, x.value, x.scaling, spans)
            print(f"layer {x.layer:>2}: " + "  ".join(f"{k} {r['teacher_far']:.2f}/{r['student_linear']:.2f}/"
                                                      f"{r['error']:.2f}" for k, r in rows[x.layer].items()),
                  flush=True)

    with teacher_mode(model), capture(model, record):
        run_forward(model, block)
    mean = {k: {m: sum(rows[i][k][m] for i in rows) / len(rows) for m in ("teacher_far", "student_linear", "error")}
            for k in rows[next(iter(rows))]}
    print("mean over layers (teacher far mass / student linear share / output error):")
    for k, r in mean.items():
        print(f"  {k:>10}  {r['teacher_far']:.3f}  {r['student_linear']:.3f}  {r['error']:.3f}")
    result = {"student": args.student, "length": args.length, "data": args.data, "window": spec.attention.window,
              "sink": spec.attention.sink, "layers": {str(i): rows[i] for i in sorted(rows)}, "mean": mean}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = list(mean)
        x = range(len(labels))
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for ax, m, title in zip(axes, ("teacher_far", "student_linear", "error"),
                                ("teacher's mass beyond window and sink", "student's linear share",
                                 "attention output error (relative)")):
            for i in sorted(rows):
                ax.plot(x, [rows[i][k][m] for k in labels], color="0.8", lw=0.8)
            ax.plot(x, [mean[k][m] for k in labels], color="C0", lw=2, label="mean over layers")
            ax.set_xticks(list(x), labels, rotation=45, fontsize=8)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("position in the block (tokens)")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{Path(args.student).name}: window {spec.attention.window} + sink {spec.attention.sink}, "
                     f"{args.length} tokens", fontsize=10)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
    assert math.isfinite(sum(r["error"] for r in mean.values()))


if __name__ == "__main__":
    main()
