"""Timing an export in vLLM beside its teacher, each in its own engine in the serving environment's python
(`bash scripts/serve-env.sh`), from dofattn's own: `dofattn bench --parts serve` and `benchmarks/serve_cpu.py`.
Nothing here imports vLLM.

Each model runs in a subprocess (float32, eager, no prefix caching, `VLLM_CPU_KVCACHE_SPACE` GiB of cache, default
2). For each batch size B, one warm-up and one timed `generate` of B prompts for `new_tokens` tokens: output tokens/s
= B × new tokens / wall time (the prompts' reading included, as a server's throughput counts it), and, from the
engine's own request metrics, the median request's time to its first token (queueing behind the batch's other
prompts included), the batch's time until every request has its first token, the decode rate after it (B × (new
tokens - 1) / the time from the last first token to the last token) and the preemptions. The most requests of that
length the cache holds at once is read from the engine's log ("Maximum concurrency").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from dofattn.errors import UserError

SERVING_PYTHON = Path(".venv-serve") / "bin" / "python"     # scripts/serve-env.sh's default virtualenv

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


def serving_python(path: str | None) -> str:
    """The serving environment's python: `path`, else .venv-serve/bin/python here or in dofattn's checkout; a
    UserError if there is none."""
    if path:
        if not Path(path).is_file():
            raise UserError(f"--serve-python {path} does not exist; give the python of the serving environment "
                            f"(bash scripts/serve-env.sh makes .venv-serve)")
        return path
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / SERVING_PYTHON).is_file():
            return str(root / SERVING_PYTHON)
    raise UserError("timing in vLLM needs the serving environment, and there is no .venv-serve here: make it with "
                    "bash scripts/serve-env.sh, or pass --serve-python PATH")


def teacher_folder(base_model: str) -> str:
    """The folder (or hub id) vLLM loads a student's base model from: a built-in alias's cached safetensors."""
    from dofattn.model.hf import BUILTIN, builtin_folder, model_source

    return str(builtin_folder(base_model) if base_model in BUILTIN else model_source(base_model))


def serve(folder: str, prompts: list[list[int]], batches: list[int], new_tokens: int, max_len: int,
          python: str = sys.executable) -> dict:
    """One model's rows in vLLM (the module's docstring), its cache's size and concurrency from its log."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as job:       # the prompts: too long for a command line
        json.dump([folder, prompts, batches, new_tokens, max_len], job)
        job.flush()
        done = subprocess.run([python, "-c", ENGINE, job.name], env=env, capture_output=True, text=True,
                              timeout=3600)
    log = done.stdout + done.stderr
    if done.returncode:
        raise UserError(f"vLLM on {folder} failed (the serving environment's log, its end):\n{log[-4000:]}")
    rows = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))[7:])
    concurrency = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.,]+)x", log)
    cache = re.search(r"GPU KV cache size: ([\d,]+) tokens|KV cache size: ([\d,]+) tokens", log)
    return {"model": folder, "rows": rows,
            "max_concurrency": float(concurrency.group(2).replace(",", "")) if concurrency else None,
            "cache_tokens": int((cache.group(1) or cache.group(2)).replace(",", "")) if cache else None}
