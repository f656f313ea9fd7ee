"""A model of the size users bring, on random weights: its teacher's and its student's decode rates beside their
memory floors, and the training steps' throughput (what an 8 B job's GPU-hours are projected from).

    python3 benchmarks/scale.py --out scale.json                       # Llama-3.2-1B's shape, long-context's student
    python3 benchmarks/scale.py --contexts 256,512 --batches 1,2 --new-tokens 4    # the CPU standing in

The teacher is built from a config.json alone (random weights: speed and memory do not depend on them), in the
device's fast dtype; the student is a recipe's architecture on it, untrained, its kept softmax layers the last K
(standing in for those a run chooses: same count and shapes). Both decode in `engine.StaticDecoder` (one CUDA graph
replay per token on CUDA; the teacher's layers on static slots of T + new tokens, read through SDPA), at each batch
size after a prompt of each length of random tokens.

A decode step must read every weight once (the input embedding only its B rows, unless the LM head shares it) and
every byte of the cache: its memory floor is B × bandwidth / (weights + cache) tokens/s, the bandwidth measured here
as a device copy. Each decode row gives the rate, the floor and their ratio. The layerwise row times one step of a
linear layer at the recipe's shapes (`costs.layerwise_step_seconds`); the end-to-end row, steps of
`end_to_end.train` at the recipe's batch (the difference of 1 and 1 + n steps, over n). Rows are written to --out as
each is measured; a row that does not fit in memory says so and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

CONFIG = "docs/plans/llama-3.2-1b/config.json"


def bandwidth(device: str) -> float:
    """Bytes/s of a device copy (read and write), the best of 5: what a decode step's reads can reach."""
    n = (1 << 30 if device.startswith("cuda") else 1 << 27) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    src.fill_(1.0)
    best = float("inf")
    for _ in range(6):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best


def weights_read(model) -> int:
    """Bytes of weights a decode step reads: all but the input embedding, which it gathers rows of (unless tied)."""
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embedding
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embedding.numel() * embedding.element_size()


def decode_rows(name: str, model, softmax_only: bool, args, bw: float, report) -> None:
    from dofattn.attention.cache import cache_bytes
    from dofattn.jobs.bench import PeakMemory
    from dofattn.engine import StaticDecoder

    weights, vocab = weights_read(model), model.get_input_embeddings().weight.shape[0]
    for B in args.batches:
        for T in args.contexts:
            row = {"part": "decode", "model": name, "batch": B, "context": T, "new_tokens": args.new_tokens}
            ids = torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(T)).to(args.device)
            decoder = StaticDecoder(model, softmax_only=softmax_only)
            memory = PeakMemory(args.device)
            memory.start()
            try:
                decoder.generate(ids, args.new_tokens)
            except torch.OutOfMemoryError as e:
                row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
                report(row)
                del decoder
                torch.cuda.empty_cache()
                continue
            t, cache = decoder.timings, cache_bytes(decoder.cache)
            rate = (t["replays"] / t["replay_s"]) if "replays" in t else t["decode_steps"] / t["decode_s"]
            floor = B * bw / (weights + cache)
            row.update(engine="graph" if "replays" in t else "eager", prefill_s=round(t["prefill_s"], 3),
                       tokens_per_s=rate * B, steps_per_s=rate, cache_bytes=cache, weights_bytes=weights,
                       floor_tokens_per_s=floor, of_floor=rate * B / floor, peak_above_model_bytes=memory.above())
            report(row)
            del decoder, ids
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


def layerwise_row(recipe, plan, device: str) -> dict:
    from dofattn.distill.costs import layerwise_step_seconds

    lw = recipe.layerwise
    seconds = layerwise_step_seconds(recipe, plan, device)
    tokens = lw.batch_size * lw.seq_len
    return {"part": "layerwise", "step_s": seconds, "tokens_per_step": tokens, "rows_per_step":
            lw.batch_size * (lw.rows or lw.seq_len), "tokens_per_s": tokens / seconds,
            "features": round(plan.layers.mean_dim), "steps_per_layer": lw.steps}


def end_to_end_row(model, recipe, device: str, steps: int) -> dict:
    from dofattn.distill.end_to_end import train

    e2e = replace(recipe.end_to_end, eval_every=0, checkpoint_every=10 ** 6)
    vocab = model.get_input_embeddings().weight.shape[0]
    blocks = torch.randint(3, vocab, (8 * e2e.batch_size, e2e.seq_len),
                           generator=torch.Generator().manual_seed(0))
    seconds = []
    for n in (1, 1 + steps):
        with tempfile.TemporaryDirectory() as out:
            seconds.append(train(model, blocks, Path(out), replace(e2e, steps=n), seed=0, eval_blocks=blocks[:1],
                                 progress=False)["seconds"])
    step = (seconds[1] - seconds[0]) / steps
    tokens = e2e.batch_size * e2e.seq_len
    return {"part": "end_to_end", "step_s": step, "tokens_per_step": tokens, "tokens_per_s": tokens / step,
            "activation_checkpointing": e2e.activation_checkpointing}


def main() -> None:
    from dofattn import recipe as recipes
    from dofattn.model.install import install
    from dofattn.jobs.bench import hardware
    from dofattn.distill.plan import make_plan
    from dofattn.model.hf import RANDOM_WEIGHTS, load_model, model_config
    from dofattn.recipe import resolve_dtype
    from dofattn.distill.choose import build_untrained
    from dofattn.model.student import attention_modules

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=CONFIG, help="a config.json (random weights)")
    parser.add_argument("--recipe", default="long-context", help="the student's architecture and training shapes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="the frozen weights' dtype; auto: bfloat16 where the device "
                        "computes it fast")
    parser.add_argument("--contexts", default="8192,32768,131072", help="prompt lengths before decoding")
    parser.add_argument("--batches", default="1,16", help="batch sizes of the decode rows")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded after each prompt")
    parser.add_argument("--e2e-steps", type=int, default=3, help="end-to-end steps timed (after one)")
    parser.add_argument("--parts", default="decode,layerwise,end_to_end")
    parser.add_argument("--out", default="scale.json")
    args = parser.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]

    recipe = recipes.load(args.recipe)
    recipe = resolve_dtype(replace(recipe, run=replace(recipe.run, dtype=args.dtype)), args.device)
    dtype = getattr(torch, recipe.run.dtype)
    result = {"config": args.config, "weights": RANDOM_WEIGHTS, "recipe": recipe.name, "dtype": recipe.run.dtype,
              "hardware": hardware(args.device), "rows": []}

    def report(row: dict) -> None:
        result["rows"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(row), flush=True)

    result["bandwidth_bytes_per_s"] = bw = bandwidth(args.device)
    print(f"device copy: {bw / 1e9:.0f} GB/s", flush=True)
    parts = args.parts.split(",")
    model, _ = load_model(args.config, dtype=dtype, device=args.device, random_weights=True)
    model.eval()
    if "decode" in parts:
        install(model)                       # the teacher's layers read static slots through dofattn's attention
        decode_rows("teacher", model, True, args, bw, report)
    plan = make_plan(recipe, 1, model_config(args.config))
    build_untrained(model, recipe, [round(plan.layers.mean_dim)] * len(attention_modules(model)), stand_in=True)
    model.eval()
    if "decode" in parts:
        decode_rows(f"student ({recipe.name}, untrained)", model, False, args, bw, report)
    if "layerwise" in parts:
        report(layerwise_row(recipe, plan, args.device))
    if "end_to_end" in parts:
        report(end_to_end_row(model, recipe, args.device, args.e2e_steps))


if __name__ == "__main__":
    main()
