"""Where a decode step's time goes: a trained student and its teacher, one token at a time after a prompt.

    python benchmarks/decode_profile.py runs/long-context --context 512 8192 --out decode_profile.json

For each model and prompt length: the prompt is read (random tokens), then `--steps` cached forwards of one token
each (what HF `generate` runs per token) are timed with the profiler on. Each step's time is split by the module it
is spent in (the linear layers' attention, the kept layers' attention, the q/k/v/o projections, the MLPs, the norms,
the LM head; the rest is HF's code around them: masks, rotary embeddings, the cache's bookkeeping), and the aten
operators that take the most self time are listed. `--threads` sets torch's intra-op threads (default: torch's).
"""

from __future__ import annotations

import argparse
import json
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
    if hasattr(module, "dofattn") and module.dofattn is not None:
        return None                                     # its projections and its linear attention separately
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
    if name.endswith(("self_attn", "attention", "attn")):
        return None                                     # the kept layer's attention: its own time below
    return None


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
def measure(model, tokenizer, context: int, steps: int) -> dict:
    from transformers import DynamicCache

    from dofattn.hf import cache_kwargs

    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(context))
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(3):                                   # warm-up steps
        token = model(input_ids=token, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, True)
    start = time.perf_counter()
    for _ in range(steps):
        token = model(input_ids=token, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, True)
    plain = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("step"):
                token = model(input_ids=token, use_cache=True,
                              **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
    events = prof.key_averages()
    step_us = next(e.cpu_time_total for e in events if e.key == "step") / steps
    parts = {e.key[len("part: "):]: e.cpu_time_total / steps / 1e3 for e in events if e.key.startswith("part: ")}
    parts["linear attention"] = parts.get("linear attention", 0.0)
    parts["rest (HF code, kept layers' attention, cache)"] = step_us / 1e3 - sum(parts.values())
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)[:15]
    return {"context": context, "step_ms": plain * 1e3, "profiled_step_ms": step_us / 1e3,
            "parts_ms": parts, "aten_calls_per_step": sum(e.count for e in events if e.key.startswith("aten::"))
            / steps, "top_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                                  "self_ms_per_step": e.self_cpu_time_total / steps / 1e3} for e in ops]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("student", help="a student: run folder or export")
    parser.add_argument("--context", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="decode_profile.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dofattn.export import load_any, spec_of
    from dofattn.hf import load_model

    rows = defaultdict(list)
    for kind in ("teacher", "student"):
        if kind == "student":
            model, tokenizer = load_any(args.student, merge_lora=True)[:2]
        else:
            model, tokenizer = load_model(spec_of(args.student).base_model)
        model.eval()
        label(model)
        for context in args.context:
            row = measure(model, tokenizer, context, args.steps)
            rows[kind].append(row)
            parts = ", ".join(f"{k} {v:.2f}" for k, v in row["parts_ms"].items())
            print(f"{kind:8} after {context:6}: {row['step_ms']:.1f} ms a step ({row['aten_calls_per_step']:.0f} "
                  f"aten calls); profiled {row['profiled_step_ms']:.1f} ms: {parts}", flush=True)
            for op in row["top_ops"][:8]:
                print(f"    {op['op']:32} {op['calls_per_step']:6.0f} calls {op['self_ms_per_step']:7.2f} ms")
        del model
    Path(args.out).write_text(json.dumps({"student": args.student, "threads": torch.get_num_threads(),
                                          "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
