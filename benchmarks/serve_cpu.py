"""A student against its teacher in the same serving engine (vLLM; run it with the serving environment's python,
`bash scripts/serve-env.sh`): output tokens/s of a batch of greedy requests and the time to the first token.

    .venv-serve/bin/python benchmarks/serve_cpu.py exports/window --teacher ~/.cache/dofattn/models/smollm2-135m \
        --batch 1 8 --prompt-tokens 1024 --new-tokens 32 --out serve.json

What is timed, and how, is `dofattn.serve.bench`'s (as `dofattn bench --parts serve` times it); here the prompts are
real text (wiki-sample, train split), each exactly `--prompt-tokens` tokens and each a different stretch, and the
engine runs in this python (the serving environment's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dofattn.serve.bench import serve                                           # noqa: E402


def prompts(folder: str, count: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from dofattn.data import token_blocks

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return token_blocks("wiki-sample", tokenizer, seq_len=length, num_blocks=count, split="train").tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("student", help="a dofattn export (dofattn export --out)")
    parser.add_argument("--teacher", required=True, help="the teacher's model folder (safetensors)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default="serve_cpu.json")
    parser.add_argument("--only", choices=["teacher", "student"], help="serve one of the two (the other's rows, if "
                        "--out holds them, are kept)")
    args = parser.parse_args()
    rows = prompts(args.teacher, max(args.batch), args.prompt_tokens)     # the student's tokenizer is its teacher's
    max_len = args.prompt_tokens + args.new_tokens + 8
    result = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "cache_gib": float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")), "models": {}}
    if args.only and os.path.exists(args.out):
        result["models"] = json.load(open(args.out)).get("models", {})
    for name, folder in (("teacher", args.teacher), ("student", args.student)):
        if args.only and name != args.only:
            continue
        started = time.perf_counter()
        result["models"][name] = served = serve(folder, rows, args.batch, args.new_tokens, max_len)   # this python
        for r in served["rows"]:
            decode = r["decode_tokens_per_s"]
            print(f"{name:8} batch {r['batch']:3}: {r['output_tokens_per_s']:6.1f} output tokens/s, first token "
                  f"{r['ttft_s']:6.2f} s (median), all first tokens {r['batch_first_token_s']:6.2f} s, then "
                  f"{decode or 0:6.1f} tokens/s, {r['preemptions']} preemptions", flush=True)
        print(f"{name:8} cache {served['cache_tokens']} tokens, at most {served['max_concurrency']} requests of "
              f"{max_len} tokens at once ({time.perf_counter() - started:.0f} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
