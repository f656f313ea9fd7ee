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
"""

from __future__ import annotations

from pathlib import Path

from dofattn.errors import UserError
from dofattn.recipe import DEFAULT_RUN


def check_default_run(path: str, takes_base: bool = True) -> None:
    """A UserError when `path` is the default recipe's run folder (`recipe.DEFAULT_RUN`) and no run made it yet
    (eval, export, generate and bench look there unless told otherwise); `takes_base`: the command also takes a
    base model (export does not)."""
    if path == DEFAULT_RUN and not Path(path).exists():
        raise UserError(f"no student in {DEFAULT_RUN} yet: train it with `dofattn distill`, or pass --model (a run "
                        f"folder or a student folder" + (", an export, or smollm2-135m for the teacher)" if takes_base
                                                         else ")"))
