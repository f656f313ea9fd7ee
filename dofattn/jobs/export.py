"""`dofattn export`: a student (a run folder or a student folder) written as a Hugging Face model folder
(`exported` says what the folder holds and loads it back).

    export("runs/long-context", "exports/student")
    export("runs/window-lora", "exports/window-lora", merge_lora=True, dtype="bfloat16")
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from pathlib import Path

from dofattn import __version__
from dofattn.model.bundle import BUNDLE_FILE, bundle_text
from dofattn.errors import UserError
from dofattn.io import save_tensors, write_atomic, write_json
from dofattn.options import option
from dofattn.recipe import DEFAULT_RUN
from dofattn.spec import MODEL_TYPE, MODELING_FILE, WEIGHTS_INDEX, StudentSpec, is_export, read_config

MAX_SHARD = "5GB"                 # transformers' and the hub's default shard size
CARD_FILE = "README.md"

MODELING_TEMPLATE = '''"""A dofattn student of {base_model}: transformers' {model_class} with linear attention,
written by `dofattn export` (dofattn {version}).

    model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)     # torch and transformers only

The classes are dofattn's own (`exported.student_classes`), from the copy of its code beside this file
(dofattn_code.py); dofattn itself is not needed, and where it is installed it is not imported.
"""

from .dofattn_code import load

DofattnConfig, DofattnForCausalLM = load("model.exported").student_classes("{model_class}", module=__name__)
'''


def write_weights(tensors: dict[str, torch.Tensor], folder: Path, max_shard: int | str = MAX_SHARD) -> list[str]:
    """Write `tensors` into `folder` as model.safetensors, or above `max_shard` as shards with their index (the
    names transformers gives them); returns the files written."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard)
    for name, names in split.filename_to_tensors.items():
        save_tensors({n: tensors[n] for n in names}, folder / name,
                     metadata={"format": "pt", "dofattn_version": __version__})
    if split.is_sharded:
        write_json(folder / WEIGHTS_INDEX, {"metadata": split.metadata, "weight_map": split.tensor_to_filename},
                   indent=2)
    return list(split.filename_to_tensors)


# --- writing an export -----------------------------------------------------------------------------------------

def _source(path: Path) -> tuple[Path, Path | None]:
    """(student folder, run folder or None) for --model; a UserError if it is neither."""
    from dofattn.distill.run_folder import RECIPE_FILE
    from dofattn.spec import is_student

    if not path.is_dir():
        raise UserError(f"--model {path} is not a folder; give a dofattn distill run folder or a student folder")
    if not is_student(path):
        if (path / RECIPE_FILE).is_file():
            raise UserError(f"--model {path} is a distill run that has not saved its student yet; finish it first "
                            f"(rerun its dofattn distill command)")
        what = "a dofattn export already" if is_export(path) else "not a dofattn student"
        raise UserError(f"--model {path} is {what}; give a distill run folder or a student folder (dofattn.json + "
                        f"features.safetensors)")
    from dofattn.model.student import read_spec

    read_spec(path)
    if not (path / RECIPE_FILE).is_file():
        return path, None
    from dofattn.distill.run_folder import RunFolder

    run = RunFolder(path)
    done = (run.log or {}).get("end_to_end") or {}
    steps = run.recipe.end_to_end.steps
    if done and not done.get("stopped") and done.get("steps", 0) < steps:   # e.g. a --continue-from copy going on
        raise UserError(f"--model {path} is a distill run going on ({done.get('steps', 0)} of {steps} end-to-end "
                        f"steps): its student and log are not this recipe's yet; finish the run first")
    return path, path


# what an export made before it recorded its files (`dofattn_export.files`) may hold
EXPORT_NAMES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                MODELING_FILE, BUNDLE_FILE, CARD_FILE, "recipe.toml", "tokenizer*", "special_tokens_map.json",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def check_out(out: Path) -> None:
    """Refuse an --out that holds anything but a previous export (which is replaced): a file, a folder of other
    things, or an export beside which the user keeps files it did not write (they would go with it)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    config = read_config(out)
    if config is None:
        raise UserError(f"--out {out} is not empty and holds no dofattn export; give a new or empty folder")
    written = (config.get("dofattn_export") or {}).get("files")
    own = (lambda name: name in written) if written else (lambda name: any(fnmatch(name, p) for p in EXPORT_NAMES))
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if not own(p.name))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UserError(f"--out {out} holds {shown} beside an earlier export, which the export did not write and "
                        f"replacing it would delete: move them, or give another --out")


def _unwrap_lora(model: nn.Module) -> None:
    """Put each merged LoRA layer's base projection back in its place: the model no longer needs peft."""
    from dofattn.model.lora import lora_layers

    layers = set(lora_layers(model))
    assert all(layer.merged for layer in layers), "fold the adapters (merge_lora) before unwrapping"
    for name in [name for name, module in model.named_modules() if module in layers]:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, getattr(parent, child).get_base_layer())


def weights(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors an export stores: the model's state dict less tied copies (transformers ties them again), the
    base model's floating tensors in `dtype`, the student's own as they are (float32)."""
    from dofattn.model.student import is_student_tensor

    tied = getattr(model, "all_tied_weights_keys", None) or {}
    state = model.state_dict()
    out = {}
    for name, tensor in state.items():
        source = tied.get(name)
        if source in state and state[source].data_ptr() == tensor.data_ptr():
            continue
        if tensor.is_floating_point() and not is_student_tensor(name):
            tensor = tensor.to(dtype)
        out[name] = tensor.detach().contiguous()
    return out


def export_config(model: nn.Module, spec: StudentSpec, dtype: str, lora: str, source: str) -> dict:
    """config.json of an export: the base config, the spec, and the classes to load it with."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)       # a GGUF base's: the weights written are plain
    base_type, architecture = config["model_type"], type(model).__name__
    config.update(model_type=MODEL_TYPE, architectures=["DofattnForCausalLM"], dtype=dtype,
                  auto_map={"AutoConfig": f"{MODELING_FILE[:-3]}.DofattnConfig",
                            "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.DofattnForCausalLM"},
                  dofattn=json.loads(spec.to_json()),
                  dofattn_export={"base_model_type": base_type, "base_architecture": architecture, "lora": lora,
                                  "source": source, "dofattn_version": __version__})
    return config


def modeling_file(model: nn.Module, base_model: str) -> str:
    """modeling_dofattn.py for `model`'s family."""
    return MODELING_TEMPLATE.format(base_model=base_model, version=__version__, model_class=type(model).__name__)


@dataclass
class ExportConfig:
    """A `dofattn export` job; its fields are the command's options."""

    model: str = option(DEFAULT_RUN, "a dofattn distill run folder (the default recipe's unless given), or "
                                             "a student folder")
    out: str | None = option(None, "the folder to write: new, empty, or a previous export (replaced)", required=True)
    merge_lora: bool = option(False, "fold LoRA adapters into the projection weights (no peft needed to load; the "
                                     "base model is then no longer inside); without it they are kept as peft layers")
    dtype: str = option("float32", "dtype of the base model's weights: float32, bfloat16 or float16")
    extend_to: int | None = option(None, "make the folder read to this many tokens, past the base model's context "
                                         "(SmolLM2: 8192): its RoPE scaled by YaRN, as `dofattn eval --extend-to` "
                                         "reads it; a little worse within the context", none="off")


def run(cfg: ExportConfig) -> Path:
    """`export` as `cfg` says; the folder written."""
    from dofattn.options import check_extend_to
    from dofattn.jobs import check_default_run

    check_default_run(cfg.model, takes_base=False)
    if not cfg.out:
        raise UserError("give --out DIR, the folder to write the export to")
    check_extend_to(cfg.extend_to)
    return export(cfg.model, cfg.out, merge_lora=cfg.merge_lora, dtype=cfg.dtype, extend_to=cfg.extend_to)


def export(model_path: str | Path, out: str | Path, merge_lora: bool = False, dtype: str = "float32",
           max_shard: int | str = MAX_SHARD, extend_to: int | None = None) -> Path:
    """Write the student in `model_path` (a run folder or a student folder) as a Hugging Face model folder `out`.

    `out` must be new, empty, or a previous export (replaced whole: the new export is written beside it, then moved
    into place). `dtype` is the base model's weights' (the student's own tensors stay float32); weights above
    `max_shard` (bytes, or "5GB") are written in shards. `extend_to`: the config's RoPE scaled to that many tokens
    (`hf.extend_context`), so that `from_pretrained` builds it so."""
    source, run = _source(Path(model_path))
    out = Path(out)
    check_out(out)
    import torch

    from dofattn.model.hf import parse_dtype
    from dofattn.model.student import load_student, read_spec

    torch_dtype = parse_dtype(dtype)
    spec = read_spec(source)
    if merge_lora and not spec.lora_rank:
        raise UserError(f"--merge-lora: the student in {model_path} has no LoRA adapters to fold; drop --merge-lora")
    if spec.lora_rank:
        from dofattn.model.lora import require_peft
        require_peft()
    # folding adapters is done in float32 and rounded once; without it the base loads in its export dtype
    model, tokenizer, _ = load_student(source, dtype=torch.float32 if merge_lora else torch_dtype)
    lora = "none"
    if spec.lora_rank:
        lora = "adapters"
        if merge_lora:
            from dofattn.model.lora import merge_lora as merge

            merge(model)
            _unwrap_lora(model)
            spec = replace(spec, lora_rank=0, lora_alpha=0.0, lora_targets="attention")
            lora = "merged"
    if extend_to:
        from dofattn.model.hf import extend_context

        extend_context(model, extend_to)
    dtype_name = str(torch_dtype).removeprefix("torch.")

    stage = out.with_name(f"{out.name}.{os.getpid()}.partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        write_weights(weights(model, torch_dtype), stage, max_shard)
        write_atomic(stage / MODELING_FILE, modeling_file(model, spec.base_model))
        write_atomic(stage / BUNDLE_FILE, bundle_text())
        model.generation_config.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        recipe = None
        if run is not None:
            from dofattn.distill.run_folder import RECIPE_FILE, RunFolder

            shutil.copy2(run / RECIPE_FILE, stage / RECIPE_FILE)
            recipe = RunFolder(run)
        from dofattn.model.hf import local_layers

        write_atomic(stage / CARD_FILE, model_card(spec, dtype_name, lora, recipe, out.name, extend_to,
                                                   local=local_layers(model.config)))
        config = export_config(model, spec, dtype_name, lora, str(model_path))
        files = {p.name for p in stage.iterdir()} | {"config.json"}
        config["dofattn_export"]["files"] = sorted(files)               # what a later export may replace
        write_json(stage / "config.json", config, indent=2)
        _move_into_place(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def _move_into_place(stage: Path, out: Path) -> None:
    """Replace `out` (absent, empty, or a previous export) by the finished `stage`: the old one is moved aside
    first and removed only once the new one is in place."""
    old = None
    if out.exists():
        old = out.with_name(f"{out.name}.{os.getpid()}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    try:
        stage.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- the model card --------------------------------------------------------------------------------------------

def _architecture(spec: StudentSpec, lora: str, local=()) -> list[str]:
    """The student's architecture, one card line each: its spec's own description, and what the export did with
    its LoRA adapters."""
    lines = [f"- {line}" for line in spec.describe(lora=False, local=local)]
    if lora == "adapters":
        lines.append(f"- LoRA adapters of rank {spec.lora_rank} on the {spec.lora_targets} projections, kept as "
                     f"peft layers (needs peft)")
    elif lora == "merged":
        lines.append("- LoRA adapters merged into the projection weights")
    return lines


def _base_origin(base: str) -> str:
    """Where a built-in base model comes from, for the card ("" for any other)."""
    from dofattn.model.hf import BUILTIN

    if base not in BUILTIN:
        return ""
    return f"dofattn's built-in model {BUILTIN[base].title}: {BUILTIN[base].source()}, "


def _recipe(run) -> list[str]:
    """How the student was trained: the recipe, what the run changed in it, the training text."""
    from dofattn import recipe as recipes

    if run is None:
        return ["Exported from a student folder; its training recipe is not recorded here."]
    r, log = run.recipe, run.log or {}
    changed = []
    if r.name in recipes.packaged():           # the keys the run set otherwise (--set), beside its [run] table
        packaged = recipes.load(r.name).keys()
        changed = [f"`{k} = {v}`" for k, v in r.keys().items() if not k.startswith("run.") and packaged[k] != v]
    steps = (log.get("end_to_end") or {}).get("steps")
    what = f"Recipe `{r.name}`" + (f" ({r.description})" if r.description else "")
    what += f" with {', '.join(changed)}." if changed else "."
    return [what, f"Trained on `{r.run.data}` (seed {r.run.seed}, {r.run.dtype})"
            + (f", {steps} end-to-end steps" if steps is not None else "") + ". The full recipe is `recipe.toml`: "
            "`dofattn distill --recipe recipe.toml` runs it again."]


def _evaluation(run) -> list[str]:
    """The run's validation numbers (log.json), one card line each."""
    log = run.log if run is not None else None
    ev = (log or {}).get("evaluation") or {}
    if not ev:
        return ["No evaluation numbers: the export was made from a student folder without a finished run. "
                "`dofattn eval --model FOLDER` measures them."]
    recipe = run.recipe
    text = recipe.run.eval_data or recipe.run.data
    lines = [f"Validation perplexity on `{text}` ({ev['tokens']} tokens in blocks of {ev['seq_len']}), measured by "
             f"`dofattn distill` in {recipe.run.dtype} before the export:", "",
             "| model | perplexity | × teacher |", "|---|---:|---:|",
             f"| teacher (the base model) | {ev['teacher_ppl']:.2f} | 1 |"]
    if "layerwise_student_ppl" in ev:
        lines.append(f"| student after the layerwise stage | {ev['layerwise_student_ppl']:.2f} | "
                     f"{ev['layerwise_vs_teacher']:.3f} |")
    lines.append(f"| **this student** | **{ev['student_ppl']:.2f}** | **{ev['student_vs_teacher']:.3f}** |")
    if "performer_ppl" in ev:
        lines.append(f"| untrained Performer, {ev['performer_dim']} features | {ev['performer_ppl']:.2f} | "
                     f"{ev['performer_vs_teacher']:.3f} |")
    if "kl" in ev:
        lines += ["", f"KL(teacher ‖ student) {ev['kl']:.4f} per token; top-1 agreement with the teacher "
                      f"{ev['top1_agreement']:.3f}."]
    return lines


def _extended(extend_to: int | None) -> list[str]:
    if not extend_to:
        return []
    return [f"It reads to {extend_to} tokens: its RoPE is scaled by YaRN (`dofattn export --extend-to "
            f"{extend_to}`, no attention temperature), a little worse within the base model's own context; the "
            "evaluation below was read without it.", ""]


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def model_card(spec: StudentSpec, dtype: str, lora: str, run, name: str, extend_to: int | None = None,
               local: list[int] | tuple[int, ...] = ()) -> str:
    """README.md of an export: base model, recipe, evaluation, how to load it; `local`: the base model's own
    sliding-window layers (`hf.local_layers`)."""
    import torch

    base = spec.base_model
    hub_id = "/" in base and not base.startswith((".", "/", "~")) and not Path(base).exists()
    front = ["---", "library_name: transformers", "tags: [dofattn, linear-attention]"]
    front += [f"base_model: {base}"] if hub_id else []
    front += ["---", ""]
    lines = front + [
        f"# {name}", "",
        f"A linear-attention student of `{base}`, made with dofattn {__version__}: its "
        "attention layers keep a state of fixed size instead of a KV cache that grows with the context.", "",
        "## Base model", "", f"`{base}` ({_base_origin(base)}{spec.base.get('model_type', '?')}, {len(spec.dims)} "
        "layers). Its weights are all here; the base model is not needed to load this one.", "",
        "## Student", "", *_architecture(spec, lora, local), "", *_extended(extend_to), *_recipe(run), "",
        "## Evaluation", "", *_evaluation(run), "",
        "## Weights", "", f"The base model's weights in {dtype}; the student's own tensors (feature maps, window "
        "gains, LoRA adapters) in float32, as it trains and runs them.", "",
        "## Load it", "", f"Needs Python 3.11 or later, torch and transformers 5 (exported with torch "
        f"{torch.__version__.split('+')[0]}, transformers {transformers_version()})"
        + (", and peft for the LoRA adapters (`pip install peft`)" if lora == "adapters" else "")
        + "; not dofattn: `trust_remote_code=True` runs the folder's `modeling_dofattn.py`, which takes the student's "
        "classes from `dofattn_code.py`, a copy of the dofattn code it was trained with. On CUDA, where Triton "
        "imports, its kernels run; otherwise PyTorch's.", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)',
        'ids = tokenizer("The history of mathematics", return_tensors="pt").input_ids',
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=40)[0]))", "```", "",
        "`generate` keeps one fixed-size state per linear layer (`LinearStateLayer` slots in the cache) and reads a "
        "long prompt in chunks of 512 tokens (`prefill_chunk_size=N` sets another). With dofattn installed, from the "
        "command line:", "", "```bash", f"dofattn generate --model {name}",
        f"dofattn eval --model {name}", "```", ""]
    return "\n".join(lines)

