"""Speed of one end-to-end training step of a linearized SmolLM2-135M with its frozen model in float32 and bfloat16.

    python benchmarks/train_dtype.py [--students window,linear] [--dtypes float32,bfloat16] [--steps 5]
                                     [--out train_dtype.json]

What `dofattn distill`'s end-to-end phase does per step: the student's and the teacher's forward on B blocks of T
tokens, next-token loss plus KL to the teacher, backward into the trained tensors (features and LoRA adapters),
one Adam step. Students, both with 64 features in every layer and LoRA rank 8:
- window: learned PRF features, 64-token window and 4-token sink (the default recipe's layers);
- linear: Hedgehog features, pure linear attention (the long runs without a window).

With `--dtype bfloat16` only the frozen model is 16-bit; the trained tensors stay float32. Each step draws the same
blocks in every dtype, so the first step's loss shows how far the two forms are apart. The first step is a
warm-up; the median of the others is reported (tokens/s = B·T over it). On a CPU, bfloat16 pays only where the
matrix units take it (AVX512-BF16, AMX): `lscpu | grep -o 'avx512_bf16\\|amx_bf16'`.
"""

import argparse
import json
import platform
import statistics
import time

import torch

from dofattn.distill import direct_loss
from dofattn.hf import load_model, parse_dtype
from dofattn.lora import add_lora
from dofattn.student import is_student_tensor, linearize

STUDENTS = {"window": {"feature": "prf", "window": 64, "sink": 4},
            "linear": {"feature": "hedgehog", "window": 0, "sink": 0}}


def step_times(student: str, dtype: str, steps: int, batch: int, seq_len: int, device: str) -> dict:
    """Seconds per end-to-end step (the first one a warm-up) and each step's loss."""
    torch.manual_seed(0)
    model, _ = load_model("smollm2-135m", dtype=parse_dtype(dtype), device=device)
    layers = len(model.model.layers)
    linearize(model, [64] * layers, layers=list(range(layers)), seed=0, **STUDENTS[student])
    add_lora(model, 8, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(is_student_tensor(name))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=2e-3)
    ids = torch.randint(0, model.config.vocab_size, (steps, batch, seq_len), generator=torch.Generator()
                        .manual_seed(0)).to(device)
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        loss = direct_loss(model, ids[step], kd_weight=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    median = statistics.median(times[1:])
    return {"student": student, "dtype": dtype, "seconds_per_step": median, "tokens_per_s": batch * seq_len / median,
            "step_seconds": times, "losses": losses, "trained_dtypes": sorted({str(p.dtype) for p in params})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", default="window,linear")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [step_times(s, d, args.steps, args.batch, args.seq_len, args.device)
            for s in args.students.split(",") for d in args.dtypes.split(",")]
    config = {"model": "smollm2-135m", "features": 64, "lora_rank": 8, "batch": args.batch, "seq_len": args.seq_len,
              "steps": args.steps, "device": args.device, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    with open(args.out, "w") as f:
        json.dump({"config": config, "results": rows}, f, indent=2)
    print(f"{'student':>8} {'dtype':>9} {'s/step':>7} {'tokens/s':>9} {'first loss':>11} {'speed-up':>9}")
    base = {r["student"]: r["seconds_per_step"] for r in rows if r["dtype"] == "float32"}
    for r in rows:
        ratio = f"{base[r['student']] / r['seconds_per_step']:.2f}x" if r["student"] in base else "-"
        print(f"{r['student']:>8} {r['dtype']:>9} {r['seconds_per_step']:>7.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['losses'][0]:>11.4f} {ratio:>9}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
