"""A student against its teacher in the same serving engine (vLLM; run it with the serving environment's python,
`bash scripts/serve-env.sh`): output tokens/s of a batch of greedy requests and the time to the first token.

    .venv-serve/bin/python benchmarks/serve_cpu.py exports/window --teacher ~/.cache/dofattn/models/smollm2-135m \
        --batch 1 8 --prompt-tokens 1024 --new-tokens 32 --out serve.json

Each model runs in its own engine (float32, eager, no prefix caching, `VLLM_CPU_KVCACHE_SPACE` GiB of cache,
default 2). The prompts are real text (wiki-sample, train split), each exactly `--prompt-tokens` tokens and each a
different stretch. For each batch size: one timed `generate` of B prompts for `--new-tokens` tokens (output tokens/s
= B × new tokens / wall time, the prompts' reading included, as a server's throughput counts it), and, from the
engine's own request metrics: the median request's time to its first token (queueing behind
the batch's other prompts included), the batch's time until every request has its first token, and the decode rate
after it (B × (new tokens - 1) / the time from the last first token to the last token). The engine's cache budget
and the most requests of that length it holds at once are read from its log line ("Maximum concurrency").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ENGINE = r"""
import json, statistics, sys, time

if __name__ == "__main__":
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    folder, prompts, batches, new_tokens, max_len = json.load(open(sys.argv[1]))
    llm = vllm.LLM(folder, dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=max_len,
                   max_num_seqs=max(batches), disable_log_stats=False)
    rows = []
    for B in batches:
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[:B]]
        llm.generate(batch[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        out = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                           use_tqdm=False)
        seconds = time.perf_counter() - start
        made = sum(len(o.outputs[0].token_ids) for o in out)
        stats = [o.metrics for o in out]
        first = max(m.first_token_ts for m in stats) - min(m.scheduled_ts for m in stats)
        decode = max(m.last_token_ts for m in stats) - max(m.first_token_ts for m in stats)
        rows.append({"batch": B, "seconds": seconds, "output_tokens": made, "output_tokens_per_s": made / seconds,
                     "ttft_s": statistics.median(m.first_token_latency for m in stats), "batch_first_token_s": first,
                     "decode_tokens_per_s": B * (new_tokens - 1) / decode if decode > 0 else None,
                     "preemptions": sum(m.num_preemptions for m in stats)})
        print("ROW", json.dumps(rows[-1]), flush=True)
    print("RESULT", json.dumps(rows), flush=True)
"""


def prompts(folder: str, count: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from dofattn.data import token_blocks

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return token_blocks("wiki-sample", tokenizer, seq_len=length, num_blocks=count, split="train").tolist()


def serve(folder: str, rows: list, batches: list[int], new_tokens: int, max_len: int) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as job:       # the prompts: too long for a command line
        json.dump([folder, rows, batches, new_tokens, max_len], job)
        job.flush()
        done = subprocess.run([sys.executable, "-c", ENGINE, job.name], env=env, capture_output=True, text=True,
                              timeout=3600)
    log = done.stdout + done.stderr
    if done.returncode:
        sys.exit(f"vLLM on {folder} failed:\n{log[-4000:]}")
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))[7:])
    concurrency = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.,]+)x", log)
    cache = re.search(r"GPU KV cache size: ([\d,]+) tokens|KV cache size: ([\d,]+) tokens", log)
    return {"model": folder, "rows": result,
            "max_concurrency": float(concurrency.group(2).replace(",", "")) if concurrency else None,
            "cache_tokens": int((cache.group(1) or cache.group(2)).replace(",", "")) if cache else None}


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
        result["models"][name] = served = serve(folder, rows, args.batch, args.new_tokens, max_len)
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
