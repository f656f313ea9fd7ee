"""Where a decode step's time goes: a trained student and its teacher, one token at a time after a prompt.

    python benchmarks/decode_profile.py runs/long-context --context 512 8192 --out decode_profile.json
    python benchmarks/decode_profile.py docs/plans/llama-3.2-1b/config.json --recipe window    # a shape alone

Both models read each prompt (random tokens, the same for both); then blocks of `--steps` cached forwards of one
token each (what HF `generate` runs per token, with its mask) are timed, the models' and lengths' blocks
interleaved over `--rounds` (a median each), so that the machine's drift does not fall on one row; then a block
runs with the profiler on. Each step's time is split by the module it is spent in (the linear layers' attention,
the q/k/v/o projections, the MLPs, the norms, the LM head; the rest is HF's code around them, the kept layers'
attention and the cache's bookkeeping), and the aten operators with the most self time are listed. `--threads` sets
torch's intra-op threads (default: torch's). Given a config.json and `--recipe`, the teacher has random weights and
the student is that recipe's, untrained (a step's time does not depend on the weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def category(name: str, module) -> str | None:
    """The part of a step a module's time counts to (None: its children are counted instead)."""
    kind = type(module).__name__
    if kind == "LinearAttention":
        return "linear attention"
    if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "c_attn", "c_proj", "dense",
                      "query_key_value")) and "mlp" not in name:
        return "q/k/v/o projections"
    if name.endswith("mlp"):
        return "MLP"
    if "norm" in kind.lower():
        return "norms"
    if name.endswith("lm_head"):
        return "LM head"
    return None                                         # a kept layer's attention counts to the rest


def label(model) -> None:
    """Profiler ranges around each counted module's forward (and the kept layers' attention function)."""
    for name, module in model.named_modules():
        part = category(name, module)
        if part is None:
            continue
        ranges = {}

        def enter(m, args, part=part, ranges=ranges):
            ranges[id(m)] = record_function(f"part: {part}").__enter__()

        def leave(m, args, out, ranges=ranges):
            ranges.pop(id(m)).__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


@torch.no_grad()
def prefill(model, context: int) -> list:
    """[cache, next token, attention mask] after a random prompt of `context` tokens (the same for every model)."""
    from transformers import DynamicCache

    from dofattn.attention.cache import cache_kwargs

    ids = torch.randint(3, 40000, (1, context), generator=torch.Generator().manual_seed(context))
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits
    return [cache, logits[:, -1].argmax(-1, keepdim=True), torch.ones(1, context + 1, dtype=torch.long)]


@torch.no_grad()
def steps(model, held: list, count: int) -> None:
    """`count` decode steps continuing `held` (updated), each a cached forward of one token with its mask, as
    `generate` calls it."""
    from dofattn.attention.cache import cache_kwargs

    cache, token, mask = held
    for _ in range(count):
        token = model(input_ids=token, attention_mask=mask, use_cache=True,
                      **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask[:, :1]], 1)
    held[1:] = [token, mask]


@torch.no_grad()
def profiled(model, held: list, count: int) -> dict:
    """The parts of `count` profiled steps and the aten operators with the most self time."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(count):
            with record_function("step"):
                steps(model, held, 1)
    events = prof.key_averages()
    step_us = next(e.cpu_time_total for e in events if e.key == "step") / count
    parts = {e.key[len("part: "):]: e.cpu_time_total / count / 1e3 for e in events if e.key.startswith("part: ")}
    parts["linear attention"] = parts.get("linear attention", 0.0)
    parts["rest (HF code, kept layers' attention, cache)"] = step_us / 1e3 - sum(parts.values())
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)[:15]
    return {"profiled_step_ms": step_us / 1e3, "parts_ms": parts,
            "aten_calls_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / count,
            "top_ops": [{"op": e.key, "calls_per_step": e.count / count,
                         "self_ms_per_step": e.self_cpu_time_total / count / 1e3} for e in ops]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("student", help="a student: run folder or export; or a config.json (with --recipe)")
    parser.add_argument("--recipe", help="with a config.json: the recipe whose untrained student is timed")
    parser.add_argument("--context", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--steps", type=int, default=8, help="decode steps a timed block")
    parser.add_argument("--rounds", type=int, default=4, help="timed blocks per model and context, interleaved")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="decode_profile.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dofattn.model.exported import load_any, spec_of
    from dofattn.model.hf import load_model

    if args.recipe:
        from dofattn.recipe import load as load_recipe
        from dofattn.distill.choose import build_untrained
        from dofattn.model.student import attention_modules

        teacher = load_model(args.student, random_weights=True)[0].eval()
        student = load_model(args.student, random_weights=True)[0].eval()
        build_untrained(student, load_recipe(args.recipe), [64] * len(attention_modules(student)), stand_in=True)
        models = {"teacher": teacher, "student": student}
    else:
        models = {"teacher": load_model(spec_of(args.student).base_model)[0].eval(),
                  "student": load_any(args.student, merge_lora=True)[0].eval()}
    held = {(name, c): prefill(model, c) for c in args.context for name, model in models.items()}
    times = {key: [] for key in held}
    for _ in range(args.rounds):          # interleaved, so that the machine's drift falls on every row alike
        for key in held:
            start = time.perf_counter()
            steps(models[key[0]], held[key], args.steps)
            times[key].append((time.perf_counter() - start) / args.steps * 1e3)
    for model in models.values():
        label(model)
    rows = defaultdict(list)
    for (name, context), h in held.items():
        row = {"context": context, "step_ms": statistics.median(times[name, context]),
               "step_ms_rounds": times[name, context], **profiled(models[name], h, args.steps)}
        rows[name].append(row)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["parts_ms"].items())
        print(f"{name:8} after {context:6}: {row['step_ms']:.1f} ms a step (median of {args.rounds}; "
              f"{row['aten_calls_per_step']:.0f} aten calls); profiled {row['profiled_step_ms']:.1f} ms: {parts}",
              flush=True)
        for op in row["top_ops"][:8]:
            print(f"    {op['op']:32} {op['calls_per_step']:6.0f} calls {op['self_ms_per_step']:7.2f} ms")
    for context in args.context:
        ratio = statistics.median(times["teacher", context]) / statistics.median(times["student", context])
        print(f"student's tokens/s over the teacher's after {context}: {ratio:.2f}x")
    Path(args.out).write_text(json.dumps({"student": args.student, "threads": torch.get_num_threads(),
                                          "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
