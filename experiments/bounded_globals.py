"""A model's global layers all kept exact and bounded after the prompt, none linearized: RULER on it (issue 68, item 2).

    python3 experiments/bounded_globals.py gemma3-270m --lengths 4096,8192 --prompts 10 --out bounded-globals.json
    python3 experiments/bounded_globals.py gemma3-270m --read 32768 --out bounded-globals-read.json

On a model with its own sliding-window layers (Gemma 2/3, Mistral's windowed configs) the global layers are the only
ones whose cache grows. One choice for them is what `long-context` does with its kept layers: read the prompt
exactly, then keep the sink, the window and the `--select` keys the prompt's last queries attend to most
(`model.bounded`). With every global layer so, nothing is linear and nothing trains, so `dofattn distill` refuses it;
this builds it in memory (`linearize(..., layers=[])`, the default recipe's `student.attention` and `student.kept`)
and scores RULER's `niah_single_1` on it as `dofattn eval --tasks` does (`evaluate.lm_eval_tasks`). Its perplexity
on blocks is the teacher's by construction (a block is one prompt, read exactly), so only what comes after a prompt
tells it from its teacher. `--read L` measures instead what `benchmarks/bounded_memory.py` measures of a student
folder: the state after a real prompt of L tokens, the read's time and its peak (in this process, which holds the
model alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model with its own sliding-window layers, e.g. gemma3-270m")
    parser.add_argument("--lengths", default="4096,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--select", type=int, default=None, help="keys kept per kv head (default: the recipe's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--read", type=int, default=0, help="measure reading a prompt of this many tokens instead")
    parser.add_argument("--out", type=Path, default=Path("bounded-globals.json"))
    args = parser.parse_args()

    import torch

    from dofattn.evaluate import lm_eval_tasks
    from dofattn.model.hf import load_model, local_layers
    from dofattn.model.student import attention_modules, linearize
    from dofattn.recipe import load

    student = load("long-context").student
    kept = student.kept if args.select is None else replace(student.kept, select=args.select)
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    count = len(attention_modules(model))
    local = local_layers(model.config)
    if not local:
        raise SystemExit(f"{args.model} has no sliding-window layers of its own: every layer would be bounded exact")
    linearize(model, [0] * count, student.attention, kept=kept, layers=[])
    if args.read:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
        from bounded_memory import measure_model
        from dofattn.model.prompt import PROMPT_CHUNK

        row = measure_model(model, tokenizer, "bounded-globals", args.read, 16, PROMPT_CHUNK)
        args.out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "rows": [row]}, indent=1))
        print(row, f"wrote {args.out}", sep="\n")
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    started = time.perf_counter()
    found = lm_eval_tasks(model, tokenizer, ["niah_single_1"], limit=args.prompts, batch_size=1, lengths=lengths,
                          scored=lambda length, now: print(f"bounded globals at {length} tokens: {now}", flush=True))
    result = {"model": args.model, "dtype": args.dtype, "global_layers": [i for i in range(count) if i not in local],
              "attention": vars(student.attention) if hasattr(student.attention, "__dict__") else str(student.attention),
              "kept": vars(kept) if hasattr(kept, "__dict__") else str(kept), "prompts": args.prompts,
              "tasks": found, "seconds": time.perf_counter() - started}
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
