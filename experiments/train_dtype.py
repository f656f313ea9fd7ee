"""Speed of one end-to-end training step of a linearized SmolLM2-135M with its frozen model in float32 and bfloat16,
and how far the two steps' gradients are apart.

    python experiments/train_dtype.py [--students window,linear] [--runs RUN ...] [--dtypes float32,bfloat16]
                                     [--steps 5] [--out train_dtype.json]
    python experiments/train_dtype.py --students linear --dtypes float32,float32-rounded,bfloat16 --steps 2

What `dofattn distill`'s end-to-end phase does per step: the student's and the teacher's forward on B blocks of T
tokens of the Wikipedia sample's train split, next-token loss plus KL to the teacher, backward into the trained
tensors (features, LoRA adapters), one Adam step. The first step is a warm-up; the median of the others is reported
(tokens/s = B·T over it). With bfloat16 only the frozen model is 16-bit; the trained tensors stay float32.

Students:
- `--students`: built here, untrained, 64 features in every layer and LoRA rank 8. window: learned PRF features, a
  64-token window and a 4-token sink (the default recipe's layers); linear: Hedgehog features, pure linear attention
  (the long runs without a window). For timing.
- `--runs`: students saved by `dofattn distill` (run folders), as trained.

For every student, the cosine between the first step's gradient in each dtype and in float32, per kind of trained
tensor (LoRA, feature weights, ...). On trained students that is the comparison that matters: the end-to-end phase
starts from a trained layerwise stage. `float32-rounded` computes in float32 with the frozen weights rounded to
bfloat16: how much the gradient moves from the weights' rounding alone (on an untrained student, a lot).

On a CPU, bfloat16 pays only where the matrix units take it (AVX512-BF16, AMX):
`lscpu | grep -o 'avx512_bf16\\|amx_bf16'`.
"""

import argparse
import json
import platform
import statistics
import time

import torch

from dofattn.spec import Attention
from dofattn.data import token_blocks
from dofattn.distill.end_to_end import loss as end_to_end_loss
from dofattn.model.hf import load_model, parse_dtype
from dofattn.model.lora import add_lora
from dofattn.model.student import is_student_tensor, linearize, load_student

ROUNDED = "float32-rounded"      # float32 compute, frozen weights rounded to bfloat16
STUDENTS = {"window": Attention(feature="prf", window=64, sink=4),
            "linear": Attention(feature="hedgehog", window=0, sink=0)}


def build(student: str, dtype: torch.dtype, device: str):
    """(model, tokenizer): an untrained student of STUDENTS, or the student saved in run folder `student`."""
    if student not in STUDENTS:
        return load_student(student, dtype=dtype, device=device)[:2]
    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m", dtype=dtype, device=device)
    layers = len(model.model.layers)
    linearize(model, [64] * layers, STUDENTS[student], layers=list(range(layers)), seed=0)
    add_lora(model, 8, seed=0)
    return model, tokenizer


def round_frozen(model) -> None:
    """The frozen (teacher) weights rounded to bfloat16 and kept in their own dtype."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not is_student_tensor(name):
                p.copy_(p.to(torch.bfloat16))


def kind(name: str) -> str:
    return "lora" if ".lora_" in name else name.rsplit(".", 1)[-1]


def cosines(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Cosine between two gradients, per kind of tensor (all tensors of a kind as one vector)."""
    sums: dict[str, list[float]] = {}
    for name in a:
        x, y = a[name].double().flatten(), b[name].double().flatten()
        acc = sums.setdefault(kind(name), [0.0, 0.0, 0.0])
        acc[0] += float(x @ y)
        acc[1] += float(x @ x)
        acc[2] += float(y @ y)
    return {k: xy / max((xx * yy) ** 0.5, 1e-300) for k, (xy, xx, yy) in sums.items()}


def train_steps(student: str, dtype: str, steps: int, batch: int, seq_len: int,
                device: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Seconds per end-to-end step and each step's loss; and the first step's gradients."""
    model, tokenizer = build(student, torch.float32 if dtype == ROUNDED else parse_dtype(dtype), device)
    if dtype == ROUNDED:
        round_frozen(model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_student_tensor(name))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.Adam([p for _, p in named], lr=2e-3)
    ids = token_blocks("wiki-sample", tokenizer, seq_len, steps * batch, split="train", seed=0)
    ids = ids.view(steps, batch, seq_len).to(device)
    times, losses, first = [], [], {}
    for step in range(steps):
        start = time.perf_counter()
        loss = end_to_end_loss(model, ids[step], kd_weight=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            first = {n: p.grad.float().clone() for n, p in named if p.grad is not None}
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    median = statistics.median(times[1:])
    row = {"student": student, "dtype": dtype, "seconds_per_step": median, "tokens_per_s": batch * seq_len / median,
           "step_seconds": times, "losses": losses, "trained_dtypes": sorted({str(p.dtype) for _, p in named})}
    return row, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", default="window,linear", help="untrained students: window, linear, or ''")
    parser.add_argument("--runs", nargs="*", default=[], help="run folders of trained students")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=5, help="steps per student and dtype, the first a warm-up")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="train_dtype.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up")
    students = [s for s in args.students.split(",") if s]
    if unknown := [s for s in students if s not in STUDENTS]:
        parser.error(f"unknown --students {unknown}; use {', '.join(STUDENTS)} (trained ones: --runs)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, grads = [], {}
    for student in students + args.runs:
        for dtype in args.dtypes.split(","):
            row, grads[student, dtype] = train_steps(student, dtype, args.steps, args.batch, args.seq_len,
                                                     args.device)
            if dtype != "float32" and (student, "float32") in grads:
                row["first_grad_cosine_vs_float32"] = cosines(grads[student, "float32"], grads[student, dtype])
            rows.append(row)
    config = {"untrained_students_model": "smollm2-135m", "batch": args.batch, "seq_len": args.seq_len,
              "steps": args.steps, "device": args.device, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    with open(args.out, "w") as f:
        json.dump({"config": config, "results": rows}, f, indent=2)
    print(f"{'student':>28} {'dtype':>9} {'s/step':>7} {'tokens/s':>9} {'first loss':>11} {'speed-up':>9}")
    base = {r["student"]: r["seconds_per_step"] for r in rows if r["dtype"] == "float32"}
    for r in rows:
        ratio = f"{base[r['student']] / r['seconds_per_step']:.2f}x" if r["student"] in base else "-"
        agree = r.get("first_grad_cosine_vs_float32")
        agree = "  gradient cosine: " + ", ".join(f"{k} {v:.4f}" for k, v in agree.items()) if agree else ""
        print(f"{r['student'][-28:]:>28} {r['dtype']:>9} {r['seconds_per_step']:>7.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['losses'][0]:>11.4f} {ratio:>9}{agree}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
