"""Time a student's attention and generation against softmax attention (SDPA) and its teacher, on this machine.

--student is what is timed: a recipe (its student's architecture with untrained features: speed does not depend on
training; `window` unless given) or a trained student, a run folder or an export. Prefill: one layer's causal
attention over T tokens (SDPA against the student's layer and pure linear attention with its features, and the
linear op alone). Decode: one token against a context of T (SDPA over a KV cache against one step on the student's
fixed-size cache). Generation: the teacher and the student prefill a prompt and generate greedily. Medians of
--repeats runs; a JSON with the hardware goes to --out.
"""

from __future__ import annotations

from dofattn.commands import add_verb, config


def options() -> list[type]:
    """`bench.BenchConfig`'s fields."""
    from dofattn.bench import BenchConfig

    return [BenchConfig]


def add_parser(verbs):
    return add_verb(verbs, "bench", __doc__, options())


def run(ns) -> int:
    """The `bench` verb: `bench.run` (the JSON written after every row), then its tables."""
    from dofattn.bench import BenchConfig, format_tables, run as bench

    cfg = config(BenchConfig, ns)
    result = bench(cfg)
    print(format_tables(result))
    if cfg.out:
        print(f"wrote {cfg.out}")
    return 0
