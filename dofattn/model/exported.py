"""A dofattn export: a student as a Hugging Face model folder, its classes, and loading such a folder back.

    model, tokenizer, spec = load_export("exports/student")      # what `dofattn eval` / `generate` do with one
    model, tokenizer, spec = load_any("runs/long-context")       # a run folder, a student folder or an export

Anyone with torch and transformers loads one the usual way, without dofattn:

    model = AutoModelForCausalLM.from_pretrained("exports/student", trust_remote_code=True)

The folder (written by `jobs.export`) holds
    config.json             the base model's config with model_type "dofattn", the student's spec under "dofattn",
                            what the export did under "dofattn_export", and an auto_map to modeling_dofattn.py
    modeling_dofattn.py     one line that binds DofattnConfig and DofattnForCausalLM, made by dofattn's one
                            factory (`student_classes`): subclasses of the base family's own classes (LlamaForCausalLM,
                            ...) whose __init__ builds the student into the model (`make_student`), so the parameter
                            names are the student's and the weights load as they are
    dofattn_code.py         the factory and all it runs: a copy of dofattn's own modules (`bundle`), so that loading
                            needs torch and transformers, not dofattn
    model.safetensors       every tensor of the student under its own name: the base model's in --dtype; the
                            student's own (feature maps, window gains, LoRA adapters) in float32, as they train and
                            as a dofattn student keeps them on a 16-bit base model. Above 5 GB, shards
                            (model-00001-of-0000N.safetensors ...) and their index, as transformers writes them
    generation_config.json, the tokenizer files, README.md (the model card), recipe.toml (a run's recipe)

model_type "dofattn" keeps a plain `from_pretrained` without trust_remote_code from loading the base architecture and
silently dropping the student's tensors: transformers refuses a type it does not know. On a loaded model the
config's `model_type` is the base family's again, which dofattn's per-family tables (LoRA targets) read.

LoRA adapters survive an export as peft layers (the base weights stay the teacher's, so `dofattn eval` can still
compare with it); an export with them merged is the base architecture plus the linear attention, without peft.
`load_export` gets the same two classes from `student_classes` itself: dofattn runs no code from a folder it is
given.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from dofattn.errors import UserError
from dofattn.io import check_safetensors
from dofattn.model.prompt import PromptReader, reading_forward
from dofattn.model.student import STUDENT_MODULES
from dofattn.spec import MODEL_TYPE, MODELING_FILE, WEIGHTS_INDEX, StudentSpec, is_export, read_config

WEIGHTS_FILE = "model.safetensors"
# Parameter-name parts of the tensors kept in float32 on a 16-bit base (transformers' keep-in-fp32 globs): the
# student's own.
FLOAT32_MODULES = list(STUDENT_MODULES)


# --- the exported model's classes ------------------------------------------------------------------------------

@functools.cache
def student_classes(base_architecture: str, module: str = __name__) -> tuple[type, type]:
    """(DofattnConfig, DofattnForCausalLM) of an export whose base class is transformers' `base_architecture`
    (LlamaForCausalLM, ...): subclasses of the family's own config and model classes whose __init__ builds the
    student into the model (`make_student`), so the parameter names are the student's and the weights load as they
    are. The one definition of an export's classes: the folder's modeling file binds them under its own `module`
    name (where transformers' save_pretrained finds the file to copy), and `load_export` makes them here, so that
    dofattn runs no code from a folder it is given. Made once per (base class, module)."""
    import transformers

    base_model = getattr(transformers, base_architecture, None)
    if base_model is None:
        raise UserError(f"this transformers ({transformers.__version__}) has no {base_architecture}, the export's "
                        f"base class: install the transformers it was exported with")

    class DofattnConfig(base_model.config_class):
        model_type = MODEL_TYPE

    class DofattnForCausalLM(PromptReader, base_model):
        config_class = DofattnConfig
        _keep_in_fp32_modules_strict = FLOAT32_MODULES
        forward = reading_forward(base_model)             # long prompts read in chunks (`model.prompt`)

        def __init__(self, config):
            super().__init__(config)
            make_student(self)

        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return after_loading(super().from_pretrained(*args, **kwargs))

    for cls in (DofattnConfig, DofattnForCausalLM):
        cls.__module__, cls.__qualname__ = module, cls.__name__
    return DofattnConfig, DofattnForCausalLM


def export_spec(data) -> StudentSpec:
    """The student spec of an export: config.json's "dofattn" entry."""
    if not isinstance(data, dict):
        raise UserError("config.json has no dofattn student spec (its \"dofattn\" entry): not a dofattn export")
    return StudentSpec.from_json(json.dumps(data), where="config.json (dofattn)")


def make_student(model: nn.Module) -> nn.Module:
    """Called by DofattnForCausalLM.__init__ (and by the modeling files of exports older than `student_classes`):
    give the config back its base family and build the student into `model` (its layers linearized, LoRA adapters
    added) as the config's spec says."""
    from dofattn.model.student import build

    model.config.model_type = model.config.dofattn_export["base_model_type"]
    return build(model, export_spec(getattr(model.config, "dofattn", None)))


def after_loading(loaded):
    """Called after `from_pretrained` (which may also return loading info beside the model): the attention
    implementation installed again (in case it was reset)."""
    from dofattn.model.install import install

    model = loaded[0] if isinstance(loaded, tuple) else loaded
    install(model)
    return loaded


# --- reading an export -----------------------------------------------------------------------------------------

def is_any_student(path: str | Path) -> bool:
    """Whether `path` holds a trained student: a run or student folder (dofattn.json), or an export."""
    from dofattn.spec import is_student

    return is_student(path) or is_export(path)


def spec_of(path: str | Path) -> StudentSpec:
    """The spec of the student at `path` (a student folder or an export), without loading a model."""
    from dofattn.model.student import read_spec

    return export_spec(read_config(path)["dofattn"]) if is_export(path) else read_spec(path)


def describe(path: str | Path, spec: StudentSpec | None = None, lora: bool = True) -> list[str]:
    """`spec.describe` of the student at `path` (its spec unless given), with its base model's own sliding-window
    layers named as such: read from the base's config where it can be read here (a built-in, a local folder, a
    hub model in the cache), else described as kept softmax layers."""
    from dofattn.model.hf import local_layers, model_config

    spec = spec or spec_of(path)
    try:
        local = local_layers(model_config(spec.base_model))
    except (UserError, OSError, ValueError):
        local = []
    return spec.describe(lora=lora, local=local)


def load_any(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", merge_lora: bool = False):
    """(model, tokenizer, spec) of the student at `path`: a student folder (`student.load_student`) or an export."""
    from dofattn.model.student import load_student

    if not isinstance(path, (str, Path)):
        raise UserError(f"load takes the path of a student (a run folder, a student folder or an export), got "
                        f"{type(path).__name__} {path!r}")
    if not Path(path).expanduser().exists():
        raise UserError(f"{path} does not exist: give a run folder (dofattn distill --out), a student folder or an "
                        f"export")
    load = load_export if is_export(path) else load_student
    return load(path, dtype=dtype, device=device, merge_lora=merge_lora)


def load_export(folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                merge_lora: bool = False):
    """(model, tokenizer, spec) of the export in `folder`, in eval mode; `merge_lora` folds LoRA adapters into the
    weights (faster inference, but the base model, i.e. the teacher, is gone)."""
    from transformers import AutoTokenizer

    from dofattn.model.hf import padded

    folder = Path(folder)
    config = read_config(folder)
    if config is None:
        raise UserError(f"{folder} is not a dofattn export: its config.json has no dofattn student spec")
    if not {"base_model_type", "base_architecture"} <= set(config.get("dofattn_export", {})):
        raise UserError(f"{folder}/config.json lacks dofattn_export's base_model_type and base_architecture: export "
                        f"the student again")
    spec = export_spec(config["dofattn"])
    if spec.lora_rank:
        from dofattn.model.lora import require_peft
        require_peft()
    check_weights(folder)                           # a missing or damaged file: one line, not a traceback
    config_cls, model_cls = student_classes(config["dofattn_export"]["base_architecture"])
    hf_config = config_cls.from_pretrained(folder)
    try:                                            # config=: not the folder's code, nor a prompt for it
        tokenizer = AutoTokenizer.from_pretrained(folder, config=hf_config)
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{folder} has no usable tokenizer ({first}); copy the export again, or export again") \
            from None
    model = model_cls.from_pretrained(folder, config=hf_config, dtype=dtype).to(device).eval()
    if merge_lora and spec.lora_rank:
        from dofattn.model.lora import merge_lora as merge

        merge(model)
    return model, padded(tokenizer), spec


def check_weights(path: str | Path) -> None:
    """The one-line UserError of a missing, truncated or foreign weight file of the student at `path` (an export's
    model.safetensors or shards, a student folder's features.safetensors), from the headers alone: before a job
    spends time on anything else."""
    from dofattn.spec import WEIGHTS_FILE as FEATURES_FILE

    path = Path(path)
    for name in weight_files(path) if is_export(path) else [FEATURES_FILE]:
        check_safetensors(path / name)


def weight_files(folder: Path) -> list[str]:
    """The weight files of an export: model.safetensors, or the shards its index names."""
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return [WEIGHTS_FILE]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise UserError(f"{index} is damaged (no weight_map); copy the export again, or export again") from None


def lora_merged(folder: str | Path) -> bool:
    """Whether the export in `folder` had LoRA adapters folded into its weights (its base model is not inside it)."""
    config = read_config(folder) or {}
    return config.get("dofattn_export", {}).get("lora") == "merged"
