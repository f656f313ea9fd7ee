"""Reading a prompt: the time to the first new token, a student against its teacher, at several prompt lengths.

    python benchmarks/prompt_read.py runs/long-context --export exports/student --lengths 512 2048 8192 32768
    python benchmarks/prompt_read.py runs/long-context --routes generate --load 2      # with another job on the cores

Two routes, each the way a user reads a prompt: `generate` loads the model as `dofattn generate` does (a student
folder, or the teacher by its name in the student's spec) and calls HF `generate` on the prompt for one new token;
`export` loads the export folder with transformers alone (`from_pretrained(trust_remote_code=True)`) against the
teacher loaded the same way from dofattn's model cache. The prompt is real text (wiki-sample, train split) of
exactly `length` tokens, with its attention mask, as a tokenizer gives it. Past the teacher's context both read
with `--extend-to` (YaRN) to the longest length, so both compute what a user's long read computes. Each
(route, model, length) runs in its own process: one warm-up read of 64 tokens, then `--runs` timed reads; the
median is reported. `--load N` runs N busy processes beside the reads (each a 2-thread loop of matrix products),
the condition "another job on the cores". Writes JSON (`--out`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

LOAD = "import torch\na = torch.randn(768, 768)\nwhile True:\n    a = torch.tanh(a @ a)\n"


def read(route: str, model_kind: str, student: str, export: str | None, length: int, runs: int,
         extend_to: int | None) -> dict:
    import torch

    from bounded_memory import real_prompt          # benchmarks/, beside this script

    if route == "export" and model_kind == "student":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
    elif model_kind == "student":
        from dofattn.jobs.generate import GenerateConfig, load

        model, tokenizer, _ = load(GenerateConfig(model=student))
    else:
        from dofattn.model.hf import load_model
        from dofattn.model.student import read_spec

        model, tokenizer = load_model(read_spec(student).base_model)
    if extend_to:
        from dofattn.model.hf import extend_context

        extend_context(model, extend_to)
    model.eval()
    prompt = real_prompt(tokenizer, length)
    mask = torch.ones_like(prompt)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seconds = []
    with torch.no_grad():
        model.generate(prompt[:, :64], attention_mask=mask[:, :64], max_new_tokens=1, do_sample=False,
                       pad_token_id=pad)                                                  # warm-up
        for _ in range(runs):
            start = time.perf_counter()
            model.generate(prompt, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=pad)
            seconds.append(time.perf_counter() - start)
    return {"route": route, "model": model_kind, "length": length, "seconds": seconds,
            "median_s": statistics.median(seconds), "threads": torch.get_num_threads(), "extend_to": extend_to}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("student", help="a student folder (dofattn distill --out)")
    parser.add_argument("--export", help="the student's export folder (dofattn export --out), for --routes export")
    parser.add_argument("--routes", nargs="+", default=["generate", "export"], choices=["generate", "export"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--runs", type=int, default=3, help="timed reads per (route, model, length); the median")
    parser.add_argument("--long-runs", type=int, default=1, help="timed reads past 8192 tokens")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the reads (2 threads each)")
    parser.add_argument("--out", default="prompt_read.json")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)        # internal: ROUTE MODEL LENGTH RUNS
    args = parser.parse_args()
    longest = max(args.lengths)
    extend_to = longest if longest > 8192 else None
    if args.one:
        route, kind, length, runs = args.one
        print(json.dumps(read(route, kind, args.student, args.export, int(length), int(runs),
                              extend_to if int(length) > 8192 else None)))
        return
    if "export" in args.routes and not args.export:
        sys.exit("--routes export needs --export FOLDER (dofattn export --out FOLDER)")
    busy = [subprocess.Popen([sys.executable, "-c", LOAD], env={"OMP_NUM_THREADS": "2", "PATH": ""})
            for _ in range(args.load)]
    rows = []
    try:
        for route in args.routes:
            for length in args.lengths:
                pair = {}
                for kind in ("teacher", "student"):
                    runs = args.runs if length <= 8192 else args.long_runs
                    done = subprocess.run([sys.executable, __file__, args.student, *(["--export", args.export]
                                           if args.export else []), "--lengths", *map(str, args.lengths),
                                           "--one", route, kind, str(length), str(runs)],
                                          capture_output=True, text=True)
                    if done.returncode:
                        sys.exit(f"{route} {kind} at {length} tokens failed:\n{done.stderr[-2000:]}")
                    pair[kind] = json.loads(done.stdout.strip().splitlines()[-1])
                    rows.append(pair[kind])
                ratio = pair["teacher"]["median_s"] / pair["student"]["median_s"]
                print(f"{route:8} {length:6} tokens: teacher {pair['teacher']['median_s']:7.2f} s, student "
                      f"{pair['student']['median_s']:7.2f} s: the student {ratio:.2f}x the teacher's speed", flush=True)
                with open(args.out, "w") as f:
                    json.dump({"student": args.student, "export": args.export, "load": args.load, "rows": rows}, f,
                              indent=2)
    finally:
        for p in busy:
            p.kill()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
