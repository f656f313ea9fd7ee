"""Write text sampled from the teacher, as a .jsonl training source for `dofattn distill --data`.

Each sample is a prompt cut from the train split of --data (never its validation split), continued by the model
for --new-tokens tokens at --temperature (1 samples the model's own distribution). Pool it with the real text
and keep scoring on held-out real text:

    dofattn sample --samples 2000 --out teacher.jsonl
    dofattn distill --data wiki-sample+teacher.jsonl --eval-data wiki-sample ...

Samples are appended one batch at a time; the same command goes on after an interruption.
"""

from __future__ import annotations


from dofattn.commands import add_verb, config


ORDER = ("model", "data", "samples")      # then the spec's fields, then SampleRun's


def options() -> list[type]:
    from dofattn.jobs.sample import SampleRun, SampleSpec

    return [SampleSpec, SampleRun]


def add_parser(verbs):
    return add_verb(verbs, "sample", __doc__, options(), order=ORDER)


def run(ns) -> int:
    """The `sample` verb: `sample.run`."""
    from dofattn.jobs import sample

    spec = config(sample.SampleSpec, ns)
    result = sample.run(sample.SampleConfig(spec, config(sample.SampleRun, ns)), progress=print)
    rate = f", {result['new'] * spec.new_tokens / result['seconds']:.0f} new tokens/s" if result["new"] else ""
    print(f"{result['out']}: {result['samples']} samples of {spec.prompt_tokens}+{spec.new_tokens} tokens "
          f"({result['new']} new in {result['seconds']:.0f} s{rate})")
    return 0
