"""How far each layer's residual stream is from the teacher's, in finished students.

    python benchmarks/hidden_error.py runs/a runs/b ... [--blocks 2] [--seq-len 512] [--out hidden-error.json]

For each student, on validation blocks of --data (the built-in text by default): after every layer, each token's
|h_student − h_teacher|² / |h_teacher|², averaged over tokens (the term `distill --hidden-weight` adds to the
end-to-end loss, per layer and as its mean), beside the student's KL to the teacher on the same tokens. The
teacher is the student's own base model (`teacher_mode`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dofattn.data import token_blocks
from dofattn.distill import hidden_error
from dofattn.evaluate import teacher_mode
from dofattn.hf import parse_dtype
from dofattn.student import load_student


@torch.no_grad()
def measure(folder: str, data: str, blocks: int, seq_len: int, dtype: str) -> dict:
    model, tokenizer, _ = load_student(folder, dtype=parse_dtype(dtype))
    model.eval()
    ids = token_blocks(data, tokenizer, seq_len, blocks, split="validation", seed=0)
    student = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    with teacher_mode(model):
        teacher = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    layers = [hidden_error((s,), (t,)).item() for s, t in zip(student.hidden_states[1:], teacher.hidden_states[1:])]
    log_s, log_t = (torch.log_softmax(out.logits.float(), -1) for out in (student, teacher))
    kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean().item()
    return {"student": folder, "kl": kl, "hidden_error": sum(layers) / len(layers), "per_layer": layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("students", nargs="+", help="student folders (run folders of `dofattn distill`)")
    parser.add_argument("--data", default="wiki-sample", help="text whose validation split is scored")
    parser.add_argument("--blocks", type=int, default=2, help="validation blocks")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", help="the frozen model's dtype: float32 or bfloat16")
    parser.add_argument("--out", type=Path, help="write the numbers to this JSON file")
    args = parser.parse_args()
    rows = [measure(folder, args.data, args.blocks, args.seq_len, args.dtype) for folder in args.students]
    for row in rows:
        print(f"{row['student']}: KL {row['kl']:.3f}, hidden error {row['hidden_error']:.3f}; per layer "
              + " ".join(f"{e:.2f}" for e in row["per_layer"]))
    if args.out:
        args.out.write_text(json.dumps({"blocks": args.blocks, "seq_len": args.seq_len, "students": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
