"""The jobs the commands run, a module each, every one `run(config, progress=None)` on a config dataclass whose
fields are its command's options (the device options inherited from `options.Machine`):

    dof        `dofattn dof`: each layer's degrees of freedom and the feature dims they give (`DofConfig`)
    eval       `dofattn eval`: a student against its teacher: perplexity, KL, by position, recall (`EvalConfig`)
    generate   `dofattn generate`: a prompt continued, HF generate or the static decoder (`GenerateConfig`)
    bench      `dofattn bench`: prefill, decode and generation timed against softmax attention (`BenchConfig`)
    sample     `dofattn sample`: text from the teacher to train on (`SampleConfig`)
    export     `dofattn export`: a student written as a Hugging Face model folder (`ExportConfig`; the folder and
               its loading: `exported`)

`dofattn distill`'s job is the distillation stages' own (`distill.run`).

A job module imports torch, transformers and the model code inside its functions, not at its top: its config
dataclass is the command's options and its checks run on the options alone, so `--help` and a refusal of a bad
value take a fraction of a second (tests/test_cli.py checks that such a refusal imports neither).
"""

from __future__ import annotations

import functools
from pathlib import Path

from dofattn.errors import UserError
from dofattn.recipe import DEFAULT_RUN


def no_grad(fn):
    """`torch.no_grad()` as a decorator that imports torch only when `fn` is called."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)
    return wrapped


def check_default_run(path: str, takes_base: bool = True) -> None:
    """A UserError when `path` is the default recipe's run folder (`recipe.DEFAULT_RUN`) and no run made it yet
    (eval, export, generate and bench look there unless told otherwise); `takes_base`: the command also takes a
    base model (export does not)."""
    if path == DEFAULT_RUN and not Path(path).exists():
        raise UserError(f"no student in {DEFAULT_RUN} yet: train it with `dofattn distill`, or pass --model (a run "
                        f"folder or a student folder" + (", an export, or smollm2-135m for the teacher)" if takes_base
                                                         else ")"))


def load_for_job(path: str, recipe=None, dims: str | list[int] = "fix", *, dtype, device: str,
                 merge_lora: bool = False, random_weights: bool = False, stand_in: bool = False):
    """(model, tokenizer, spec) of what a job runs, the one choice of eval, generate and bench: a student folder or
    an export as saved (`exported.load_any`); else the model at `path` as it is (spec None) or, given a `recipe`,
    made that recipe's untrained student with `dims` features (`choose.build_untrained`; `stand_in`: its chosen
    softmax layers stood in for, for speed and memory). `random_weights`: a config alone is built with random
    weights (bench), else refused."""
    from dofattn.distill.choose import build_untrained, resolve_dims
    from dofattn.model.exported import is_any_student, load_any
    from dofattn.model.hf import load_model

    if is_any_student(path):
        if recipe is not None:
            raise UserError(f"{path} is already a student; drop --student")
        return load_any(path, dtype=dtype, device=device, merge_lora=merge_lora)
    model, tokenizer = load_model(str(path), dtype=dtype, device=device, random_weights=random_weights)
    if recipe is None:
        return model, tokenizer, None
    spec = build_untrained(model, recipe, resolve_dims(dims, model, str(path)), stand_in=stand_in)
    return model.eval(), tokenizer, spec
