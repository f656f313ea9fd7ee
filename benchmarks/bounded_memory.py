"""Memory per sequence of a saved student (and its teacher) against prompt length: after the prompt, during
generation, and the prefill's peak (and, for a folder, the prefill's time: `prefill_s`).

    python benchmarks/bounded_memory.py runs/long-context --lengths 1024 8192 32768 --out memory.json
    python benchmarks/bounded_memory.py runs/long-context --chunk 0 --models student   # the prompt in one piece
    python benchmarks/bounded_memory.py exports/student --models export --lengths 32768  # an export, HF generate

Each (model, length) runs in its own process. The prompt is real text (wiki-sample, train split, the blocks
joined) of exactly `length` tokens, given to the model in one call as `generate` gives it: the student reads it in
chunks of `--chunk` tokens (`attention.prompt`; 0: in one piece), the teacher in one piece; then `--new-tokens`
tokens are generated one at a time. An export (`--models export`, the folder an export) is loaded by transformers
alone (`from_pretrained(trust_remote_code=True)`: its own copy of dofattn's code) and reads the prompt and generates
through HF `generate`, as a user of the folder would; its peak is over the whole call. The prefill peak is the process's peak resident set while it reads the prompt,
above what it held just before, after one short warm-up call (`bench.PeakMemory`: VmHWM, reset through
/proc/self/clear_refs; Linux). `cache_bytes` counts every tensor the cache holds for the sequence (a KV cache; or
states, windows, sinks and selected keys).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

MIB = 2 ** 20


def real_prompt(tokenizer, length: int):
    """[1, length] token ids of real text: wiki-sample's train split, its blocks of up to 8 K joined."""
    from dofattn.data import token_blocks

    block = min(length, 8192)
    ids = token_blocks("wiki-sample", tokenizer, seq_len=block, num_blocks=-(-length // block), split="train")
    return ids.reshape(1, -1)[:, :length]


def measure(folder: str, kind: str, length: int, new_tokens: int, chunk: int) -> dict:
    from dofattn.model.hf import load_model
    from dofattn.model.student import load_student, read_spec

    if kind == "export":
        return measure_export(folder, length, new_tokens)
    if kind == "student":
        from dofattn.model.prompt import set_prompt_chunk

        model, tokenizer, _ = load_student(folder)
        set_prompt_chunk(model, chunk)
    else:
        model, tokenizer = load_model(read_spec(folder).base_model)
    return measure_model(model, tokenizer, kind, length, new_tokens, chunk)


def measure_model(model, tokenizer, kind: str, length: int, new_tokens: int, chunk: int) -> dict:
    """`measure` on a model in memory (its process should hold nothing else of size: the peak is the process's)."""
    import torch
    from transformers import DynamicCache

    from dofattn.attention.cache import cache_bytes, cache_kwargs
    from dofattn.jobs.bench import PeakMemory

    model.eval()
    prompt = real_prompt(tokenizer, length)
    with torch.no_grad():                 # warm-up: the code and the allocator's first pages are not the prompt's
        warm = DynamicCache(config=model.config)
        model(input_ids=prompt[:, :64], use_cache=True, logits_to_keep=1, **cache_kwargs(model, warm))
        del warm
    memory = PeakMemory("cpu")            # the process's peak resident set, above what it holds now
    memory.start()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        start = time.perf_counter()
        logits = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits
        prefill_s = time.perf_counter() - start
        after_prompt = cache_bytes(cache)
        peak = memory.above()
        token = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens):
            logits = model(input_ids=token, use_cache=True, **cache_kwargs(model, cache)).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
    return {"model": kind, "length": length, "new_tokens": new_tokens, "chunk": chunk if kind != "teacher" else 0,
            "cache_after_prompt_mib": after_prompt / MIB, "cache_after_generation_mib": cache_bytes(cache) / MIB,
            "prefill_peak_mib": peak / MIB, "prefill_s": prefill_s}


def measure_export(folder: str, length: int, new_tokens: int) -> dict:
    """An export loaded and run as its model card says: transformers' API, HF generate on the whole prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dofattn.jobs.bench import PeakMemory

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    prompt = real_prompt(tokenizer, length)
    with torch.no_grad():
        model.generate(prompt[:, :64], max_new_tokens=2, do_sample=False)                 # warm-up
    memory = PeakMemory("cpu")
    memory.start()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    peak = memory.above()
    from dofattn.attention.cache import cache_bytes

    held = cache_bytes(out.past_key_values if hasattr(out, "past_key_values") else out.cache)
    return {"model": "export", "length": length, "new_tokens": new_tokens, "chunk": model.prompt_chunk,
            "cache_after_prompt_mib": float("nan"), "cache_after_generation_mib": held / MIB,
            "prefill_peak_mib": peak / MIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("student", help="a student folder (dofattn distill --out)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=None, help="tokens a chunk of the student's prompt (0: one "
                                                                    "piece; default: the package's)")
    parser.add_argument("--models", nargs="+", default=["student", "teacher"], choices=["student", "teacher", "export"])
    parser.add_argument("--out", default="bounded_memory.json")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)               # internal: KIND LENGTH
    args = parser.parse_args()
    if args.chunk is None:
        from dofattn.model.prompt import PROMPT_CHUNK

        args.chunk = PROMPT_CHUNK
    if args.one:
        print(json.dumps(measure(args.student, args.one[0], int(args.one[1]), args.new_tokens, args.chunk)))
        return
    rows = []
    for kind in args.models:
        for length in args.lengths:
            done = subprocess.run([sys.executable, __file__, args.student, "--new-tokens", str(args.new_tokens),
                                   "--chunk", str(args.chunk), "--one", kind, str(length)],
                                  capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{kind} at {length} tokens failed:\n{done.stderr[-2000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{kind:8} {length:6} tokens: cache {r['cache_after_prompt_mib']:7.1f} MiB after the prompt, "
                  f"{r['cache_after_generation_mib']:7.1f} after {args.new_tokens} tokens; prefill peak "
                  f"{r['prefill_peak_mib']:7.0f} MiB", flush=True)
    with open(args.out, "w") as f:
        json.dump({"student": args.student, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
