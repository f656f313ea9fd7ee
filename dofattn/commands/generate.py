"""Generate text with a linearized student (or any supported model) and its constant-size state.

--model takes a student folder written by `dofattn distill` (or `dofattn.model.student.save_student`), a folder
written by `dofattn export`, or a base model (alias, hub id, folder, .gguf). With a base model, --student RECIPE
makes it that recipe's student with untrained features (--dims per layer: useful to check plumbing and speed, not
quality); without it the base model generates as it is.
"""

from __future__ import annotations

import sys

from dofattn.commands import add_verb, config


def options() -> list[type]:
    from dofattn.jobs.generate import GenerateConfig

    return [GenerateConfig]


def add_parser(verbs):
    return add_verb(verbs, "generate", __doc__, options())


def run(ns) -> int:
    """The `generate` verb: `generate.run`, the text on stdout, the speed on stderr."""
    from dofattn.jobs.generate import GenerateConfig, run as generate

    result = generate(config(GenerateConfig, ns), progress=lambda line: print(line, file=sys.stderr))
    print(result["text"])
    rate = result["tokens_per_s"]
    after = f", then {rate:.1f} tokens/s" if rate == rate else ""          # nan: no token after the first
    read = result["prompt_tokens"] / max(result["prompt_s"], 1e-9)
    print(f"[{result['model']}: read {result['prompt_tokens']} prompt tokens in {result['prompt_s']:.2f} s "
          f"({read:.0f} tokens/s); {result['new_tokens']} new tokens in {result['seconds']:.2f} s{after}; stopped "
          f"{result['stopped']}]", file=sys.stderr)
    return 0
