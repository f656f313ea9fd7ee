"""Peak memory and time of one end-to-end training step against `loss_chunk` and `activation_checkpointing`.

    python benchmarks/end_to_end_memory.py [--seq-len 1024] [--batch 1] [--layers 30] [--out e2e_memory.json]

The model has SmolLM2-135M's shape (vocab 49 152, 576 wide, 9 query and 3 kv heads) with random weights (no
download), linearized with 32 PRF features per head and LoRA rank 8 on the attention projections; a step is the
loss (teacher and student) and its backward pass. Each setting runs in its own process, so its peak is its own:
on CPU the rise of peak RSS (ru_maxrss) over the step, on CUDA `torch.cuda.max_memory_allocated` above what the
model holds.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dofattn.spec import Attention


def measure(chunk: int, checkpointed: bool, seq_len: int, batch: int, layers: int, device: str) -> dict:
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dofattn.distill.end_to_end import layers_checkpointed, loss
    from dofattn.evaluate import teacher_mode
    from dofattn.model.lora import add_lora
    from dofattn.model.student import attention_modules, is_student_tensor, linearize

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=8192)
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    linearize(model, [32] * layers, Attention(feature="prf", window=0, sink=0))
    add_lora(model, 8)
    for name, p in model.named_parameters():
        p.requires_grad_(is_student_tensor(name))
    for module in attention_modules(model):
        module.dofattn.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
    with torch.no_grad(), teacher_mode(model):   # warm-up: lazy allocations out of the measured peak
        model(input_ids=ids[:, :8], use_cache=False)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with layers_checkpointed(model) if checkpointed else contextlib.nullcontext():
        value = loss(model, ids, 1.0, chunk)
        value.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return {"loss_chunk": chunk, "activation_checkpointing": checkpointed, "seq_len": seq_len, "batch": batch,
            "layers": layers, "device": device, "step_seconds": round(time.perf_counter() - start, 2),
            "peak_mib_over_model": round(peak_mib), "loss": round(value.item(), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 256])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # chunk, checkpointed: measure in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1] == "1", args.seq_len, args.batch, args.layers,
                                 args.device)))
        return
    rows = []
    for chunk in args.chunks:
        for checkpointed in (False, True):
            cmd = [sys.executable, __file__, "--one", str(chunk), str(int(checkpointed)), "--seq-len",
                   str(args.seq_len), "--batch", str(args.batch), "--layers", str(args.layers), "--device",
                   args.device]
            row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
