"""Time the student's attention and generation against softmax attention (SDPA) on this machine.

Prefill: one layer's causal attention over T tokens (SDPA vs PRF features + linear attention, the linear op
alone, and the sliding-window hybrid). Decode: one token against a context of T (SDPA over a KV cache vs one
step on the constant-size state). Generation: --model and its linearized student (untrained features; speed
does not depend on training) prefill a prompt and generate greedily. Medians of --repeats runs; a JSON with the
hardware goes to --out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dofattn.commands import add_verb, config
from dofattn.options import option


@dataclass
class BenchOutput:
    """Where `bench.bench`'s result goes."""

    out: str = option("bench.json", "where to write the JSON result (rewritten after each part)")


def options() -> list[type]:
    """`bench.BenchConfig`'s fields, then --out."""
    from dofattn.bench import BenchConfig

    return [BenchConfig, BenchOutput]


def add_parser(verbs):
    return add_verb(verbs, "bench", __doc__, options())


def run(ns) -> int:
    """The `bench` verb: `bench.bench`, its tables, and the JSON written after every row."""
    from dofattn.bench import BenchConfig, bench, format_tables
    from dofattn.io import check_output, write_atomic

    cfg = config(BenchConfig, ns)
    out = check_output(config(BenchOutput, ns).out, "--out", (".json",))
    result = bench(cfg, save=lambda partial: write_atomic(out, json.dumps(partial, indent=2)))
    print(format_tables(result))
    write_atomic(out, json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0
