"""Peak memory and speed of generation vs context length: a linearized SmolLM2 against its teacher, on CPU.

    python benchmarks/generate_memory.py [--contexts 512 4096] [--new-tokens 32] [--out generate_memory.json]

Each (model, context) pair runs in its own process so peak RSS (ru_maxrss) is its own. The prompt is real text
(wiki-sample, train split) of exactly `context` tokens, prefilled in chunks of `--prefill-chunk` tokens (HF
generate's `prefill_chunk_size`), so activations are bounded by the chunk and what grows with context is the
cache alone: the teacher's KV cache, or the student's constant-size linear state. The student's features are
untrained (`--dims fix`): memory and speed do not depend on training.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dofattn.spec import Attention


def measure(kind: str, context: int, new_tokens: int, chunk: int) -> dict:
    import torch

    from dofattn.data import token_blocks
    from dofattn.model.hf import load_model
    from dofattn.distill.choose import resolve_dims
    from dofattn.model.student import linearize

    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    if kind == "student":
        linearize(model, resolve_dims("fix", model), Attention(window=0, sink=0))
    prompt = token_blocks("wiki-sample", tokenizer, seq_len=context, num_blocks=1)
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, prefill_chunk_size=chunk,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    cache_bytes = 0
    for layer in out.past_key_values.layers:
        for name in ("keys", "values", "state"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                cache_bytes += tensor.numel() * tensor.element_size()
    return {"model": kind, "context": context, "new_tokens": new_tokens, "prefill_chunk": chunk,
            "seconds": round(elapsed, 2), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loaded_rss_mb": rss_loaded / 1024, "cache_mb": cache_bytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--models", nargs="+", default=["teacher", "student"])
    parser.add_argument("--out", default="generate_memory.json")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: run one measurement
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.new_tokens, args.prefill_chunk)))
        return
    rows = []
    for kind in args.models:
        for context in args.contexts:
            proc = subprocess.run([sys.executable, __file__, "--one", kind, str(context), "--new-tokens",
                                   str(args.new_tokens), "--prefill-chunk", str(args.prefill_chunk)],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{r['model']:>8} context {r['context']:>6}: peak RSS {r['peak_rss_mb']:7.0f} MB "
                  f"(after load {r['loaded_rss_mb']:.0f}), cache {r['cache_mb']:7.2f} MB, "
                  f"{r['new_tokens']} tokens + prefill in {r['seconds']:.1f} s", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
