"""Time a student's attention and generation against softmax attention (SDPA) and its teacher, on this machine.

    dofattn bench --model runs/long-context --parts generation     # a trained student against its base model

--student is what is timed: a recipe (its student's architecture with untrained features: speed does not depend on
training; `window` unless given) or a trained student, a run folder or an export (also as --model). Prefill: one layer's causal
attention over T tokens (SDPA against the student's layer and pure linear attention with its features, and the
linear op alone). Decode: one token against a context of T (SDPA over a KV cache against one step on the student's
fixed-size cache). Generation: the teacher and the student read a prompt of 512, 8 K and 32 K tokens and generate
greedily: the decode steps' tokens/s, the prompt's time, the cache and the peak memory above the model. Medians of
--repeats runs; a JSON with the hardware goes to --out, a figure of the generation beside it.

    dofattn bench --parts serve --student EXPORT --gen-contexts 1024,8000 --serve-batch 1,8    # in vLLM

Serve (only when asked): an export and its teacher, each in vLLM in the serving environment (bash
scripts/serve-env.sh; --serve-python): output tokens/s of each batch, time to the first token, the decode rate and
the most requests of that length the cache holds.
"""

from __future__ import annotations

from pathlib import Path

from dofattn.commands import add_verb, config


def options() -> list[type]:
    """`jobs.bench.BenchConfig`'s fields."""
    from dofattn.jobs.bench import BenchConfig

    return [BenchConfig]


def add_parser(verbs):
    return add_verb(verbs, "bench", __doc__, options())


def run(ns) -> int:
    """The `bench` verb: `bench.run` (the JSON written after every row), then its tables."""
    from dofattn.jobs.bench import BenchConfig, format_tables, run as bench

    result = bench(config(BenchConfig, ns), progress=print)
    print(format_tables(result))
    out = result["config"]["out"]
    if out:
        print(f"wrote {out}" + (f" and {Path(out).with_suffix('.png')}" if result["generation"] else ""))
    return 0
