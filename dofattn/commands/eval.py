"""Evaluate a linearized student against its teacher on held-out text.

Reports perplexity of both, the mean per-token KL(teacher || student), top-1 agreement of their next-token
predictions, and per layer (on the teacher's own queries, keys and values) the relative error of the linear
attention output against softmax attention and the L2 kernel error of PRF features. Also by context length:
the predictions that see 1, 2-3, 4-7, ... tokens, each bucket's perplexities and KL, which tell a student that
falls behind at long range (a gap growing with the context) from one that is off everywhere. Writes
everything to --out and, with --plot / --plot-positions, figures of the per-layer errors and of the buckets.
Without --teacher the teacher is the student's own base model. A plain .txt file given with --data is scored
whole: every token, in blocks of --seq-len and a last shorter one.

Long context: --seq-len 8192 --num-blocks 4 scores the validation articles joined into blocks of
8 K tokens, by position. --recall passkey,multikey asks both models for a fact hidden at --depths depths of
prompts of --lengths tokens: a five-digit pass key in repeated filler, and one of four magic numbers in the
data's text (RULER's multi-key needle). A prompt counts when the model's greedy answer is exactly right; chance
is about 0. --plot-recall draws the accuracy per length and depth; each prompt also records the cache the model
holds per sequence there. --num-blocks 0 skips the perplexity; --teacher-answers reuses an earlier run's
teacher answers or task scores (most of the time, with RULER). --tasks niah_single_1 --task-lengths 4096,8192
--prompts 25 scores RULER's needle task as lm-eval does, offline (the eval extra: pip install -e '.[eval]'), each
length printed as it ends; past the context, add --extend-to.
"""

from __future__ import annotations

from dofattn.commands import add_verb, config


def options() -> list[type]:
    """`jobs.eval.EvalConfig`'s fields."""
    from dofattn.jobs.eval import EvalConfig

    return [EvalConfig]


def add_parser(verbs):
    return add_verb(verbs, "eval", __doc__, options())


def run(ns) -> int:
    """The `eval` verb: `jobs.eval.run`, its tables printed as they are ready."""
    from dofattn.jobs import eval as eval_job

    eval_job.run(config(eval_job.EvalConfig, ns), progress=print)
    return 0
