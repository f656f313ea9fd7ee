"""Recipes: everything a `dofattn distill` run does, as data. A recipe is a TOML file of six tables.

    recipe = load("window-lora", sets=["end_to_end.steps=800"])   # a packaged recipe (dofattn/recipes/*.toml)
    recipe = load("runs/window-lora/recipe.toml")              # a run folder's resolved recipe: the same run again
    print(recipe.to_toml())                                     # every key, resolved

The tables are the dataclasses below and their fields the keys; each field's `help` is its documentation
(`dofattn recipes --keys` prints it). A file may leave keys out: they take the defaults here, which are the `window`
recipe's (the default recipe, `DEFAULT`, is `long-context`). A packaged file also says what its student `reaches`
and what it `costs` (`packaged_info`), which `dofattn recipes` lists. The [student] table holds the student's two
configs whole, the linear layers' `spec.Attention` (`recipe.student.attention`) and the kept softmax layers'
`spec.Kept` (`recipe.student.kept`): their keys are the table's keys (`student.window`, `student.select`), their
rules their own. `validate` holds every other rule.
"""

from __future__ import annotations

import difflib
import math
import tomllib
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path

from dofattn.errors import UserError
from dofattn.options import option
from dofattn.spec import LORA_TARGETS, Attention, Kept, StudentSpec, check_kept, check_lora, estimates_kernel

FORMAT = 1          # of recipe files: a file with another `format` is refused
DEFAULT = "long-context"   # what `dofattn distill` trains without --recipe: the best student measured
DEFAULT_RUN = f"runs/{DEFAULT}"   # its run folder, where eval, export and generate look unless told otherwise
RENAMED = {"default": "window", "long": "window-lora"}    # packaged recipes' names before 2026-11-28
# keys that measured worse or flat, in no recipe, and left (docs/log/experiments.md, 2026-11-29): a run folder's
# recipe.toml still names them at the values it may hold, read as nothing. The rows drawn by position: moot where
# every row is read (`check_left`).
LEFT = {"student.delta": (False,), "end_to_end.carry": (0,), "layerwise.rows_by": ("log", "position")}
LOSSES = ("softmax", "l2")
DTYPES = ("float32", "bfloat16", "auto")
KEEP_BY = ("dof", "copy")
LOCAL = ("keep", "linearize")
DOF_DIMS = ("dof", "clip")   # student.dims rules the DoF stage decides at run time
DOF_BLOCKS, DOF_SEQ_LEN, DOF_POINTS = 32, 256, 1024   # the DoF stage's sample: blocks, their length, points/head


@dataclass(frozen=True)
class Run:
    model: str = option("smollm2-135m", "the teacher: built-in alias (smollm2-135m, gemma3-270m), hub id, model "
                                        "folder or .gguf")
    data: str = option("wiki-sample", "training text: wiki-sample, a .txt/.jsonl/.parquet file or folder, "
                                      "hf:NAME[:CONFIG[:SPLIT]], or several joined by + (pooled)")
    eval_data: str | None = option(None, "the text scored (its validation split) when it is not data's")
    seed: int = option(0, "seed of the features' start, the data order and the DoF sample")
    dtype: str = option("float32", "the frozen model's dtype; trained tensors stay float32. auto: bfloat16 where the "
                                   "device computes it fast (CUDA; CPUs with avx512_bf16 or AMX), else float32; the "
                                   "run folder's recipe.toml records which", choices=DTYPES)


@dataclass(frozen=True)
class Student:
    attention: Attention = field(default_factory=Attention, metadata={"holds": Attention})  # keys: student.window
    kept: Kept = field(default_factory=Kept, metadata={"holds": Kept})                 # keys: student.select
    dims: str = option("dof", "features per layer: dof (in proportion to each layer's DoF, mean = head size), clip "
                              "(dof capped at the head size), fix, fix:C, or a dof.json from `dofattn dof`")
    keep_softmax: float = option(0.0, "keep K layers as softmax attention, chosen by keep_softmax_by: a count >= 1, "
                                      "or a share < 1 of the layers that may be linearized (0.4: 12 of SmolLM2's "
                                      "30, 1 of Gemma 3's 3 global layers)")
    keep_softmax_by: str = option("dof", "which layers keep_softmax keeps: dof (the largest DoF of their attention "
                                         "matrices) or copy (the teacher's heads that copy most from far back, which "
                                         "recall beyond the window needs; their KV cache grows with the context unless "
                                         "student.select bounds it)",
                                  choices=KEEP_BY)
    exact_heads: float = option(0.0, "keep this many key/value heads exact inside the linear layers (a count >= 1, or "
                                   "a share < 1 of the model's key/value heads), their query heads with them, "
                                   "those that copy most on the copy probe, bounded after the prompt as kept layers "
                                   "are (student.select); the other heads of their layers linear (0: none)")
    local_layers: str = option("keep", "the model's own sliding-window layers (Gemma 2/3, Mistral): keep (exact, as "
                                       "they are bounded already) or linearize (like the rest)", choices=LOCAL)
    lora_rank: int = option(0, "LoRA adapters of this rank, trained in the end-to-end phase (0: none)")
    lora_targets: str = option("attention", "what LoRA adapts: attention (q, k, v, o) or all (the MLP too)",
                               choices=LORA_TARGETS)


@dataclass(frozen=True)
class Dof:
    lam: float = option(2.0 ** -8, "λ of the DoF estimate, relative to the trace of each head's Gram matrix")


@dataclass(frozen=True)
class Layerwise:
    loss: str = option("softmax", "each layer's loss against the teacher: softmax (KL of attention rows) or l2 "
                                  "(kernel values; prf or performer)", choices=LOSSES)
    steps: int = option(150, "Adam steps per layer (0: no layerwise stage)")
    batch_size: int = option(4, "blocks per step")
    seq_len: int = option(256, "tokens per block")
    rows: int = option(0, "query rows per block the softmax loss reads, so that long blocks cost rows × seq_len, "
                          "not seq_len² (0: every row); every doubling of the context gets an equal share of them, "
                          "rows the window reads exactly none")
    blocks: int = option(64, "training blocks whose teacher q/k/v the stage keeps")
    lr: float = option(0.02, "learning rate of feature directions and projections")
    lr_weights: float = option(0.2, "learning rate of the PRF weights")


@dataclass(frozen=True)
class EndToEnd:
    steps: int = option(30, "steps of the whole student against the teacher (0: none)")
    batch_size: int = option(1, "blocks per step in each process")
    seq_len: int = option(512, "tokens per block")
    blocks: int | None = option(None, "training blocks the steps draw from (default: layerwise.blocks)")
    lr: float = option(2e-3, "Adam learning rate")
    conv_lr: float | None = option(None, "learning rate of the convolution filters (default: lr)")
    kd_weight: float = option(1.0, "weight of KL(teacher || student) on the logits beside the text's cross-entropy")
    cooldown_steps: int = option(0, "lower the learning rate linearly towards 0 over the last N steps (0: constant)")
    eval_every: int = option(0, "validation perplexity every N steps, kept in log.json (0: at the end only)")
    checkpoint_every: int = option(10, "steps between checkpoints")
    loss_chunk: int = option(1024, "positions per chunk of the logits in the loss, so the teacher's and the student's "
                                   "full logits never exist at once; fewer where the vocabulary is large (at most "
                                   "1024 x 49,152 logits a chunk: 192 positions of Gemma 3's); 0: the whole block")
    activation_checkpointing: bool = option(False, "recompute each decoder layer's activations in the backward pass: "
                                                   "less memory, about a third more time")


@dataclass(frozen=True)
class Eval:
    blocks: int = option(8, "validation blocks scored at the end")
    seq_len: int = option(512, "tokens per validation block")


TABLES = {"run": Run, "student": Student, "dof": Dof, "layerwise": Layerwise, "end_to_end": EndToEnd,
          "eval": Eval}
# What `--continue-from` may change of the run it copies: the end-to-end phase's text and length, not the student.
CONTINUE_MAY_CHANGE = ("run.data", "run.eval_data", "end_to_end.steps", "end_to_end.blocks",
                       "end_to_end.cooldown_steps", "end_to_end.eval_every", "end_to_end.checkpoint_every")


@dataclass(frozen=True)
class Recipe:
    name: str = "window"
    description: str = ""
    run: Run = field(default_factory=Run)
    student: Student = field(default_factory=Student)
    dof: Dof = field(default_factory=Dof)
    layerwise: Layerwise = field(default_factory=Layerwise)
    end_to_end: EndToEnd = field(default_factory=EndToEnd)
    eval: Eval = field(default_factory=Eval)

    @property
    def end_to_end_blocks(self) -> int:
        return self.end_to_end.blocks or self.layerwise.blocks

    def student_spec(self, dims: list[int], layers: list[int], base: dict | None = None,
                     exact_heads: list[list[int]] | tuple = ()) -> StudentSpec:
        """The student a run of this recipe trains: these dims and linear layers, its [student] table's attention
        config whole, its LoRA adapters (alpha = rank), `exact_heads` (per layer, the key/value heads kept exact:
        `distill.choose.exact_heads`) and `base`, the base model's fingerprint (`student.fingerprint`; None where
        the weights have no values, as in the dry run's plan)."""
        s = self.student
        return StudentSpec(base_model=self.run.model, dims=dims, layers=layers, attention=s.attention, kept=s.kept,
                           seed=self.run.seed, base=base or {}, lora_rank=s.lora_rank,
                           lora_alpha=float(s.lora_rank), lora_targets=s.lora_targets,
                           exact_heads=tuple(tuple(h) for h in exact_heads))

    def keys(self) -> dict[str, object]:
        """Every key as `table.key` -> value."""
        return {f"{t}.{k}": v for t in TABLES for k, v in _flat(getattr(self, t)).items()}

    def to_toml(self) -> str:
        lines = ["# dofattn recipe (dofattn recipes --keys explains every key)", f"format = {FORMAT}",
                 f"name = {_toml(self.name)}", f"description = {_toml(self.description)}"]
        for table in TABLES:
            lines.append(f"\n[{table}]")
            for key, value in _flat(getattr(self, table)).items():
                if value is not None:
                    lines.append(f"{key} = {_toml(value)}")
        return "\n".join(lines) + "\n"


def resolve_dtype(recipe: Recipe, device: str) -> Recipe:
    """`recipe` with run.dtype `auto` made the dtype `device` computes fast (`hf.fast_bfloat16`), so that a run
    folder records what its student was built with."""
    if recipe.run.dtype != "auto":
        return recipe
    from dataclasses import replace

    from dofattn.model.hf import fast_bfloat16

    return replace(recipe, run=replace(recipe.run, dtype="bfloat16" if fast_bfloat16(device) else "float32"))


def _flat(table) -> dict[str, object]:
    """A table's keys -> values, with a config it holds whole (the student's `Attention`) spread into its keys."""
    out = {}
    for f in fields(table):
        value = getattr(table, f.name)
        out.update(asdict(value) if is_dataclass(value) else {f.name: value})
    return out


def _build(cls, values: dict[str, object]):
    """The table `cls` from its keys' values, a config it holds whole built from its own keys."""
    own = {}
    for f in fields(cls):
        held = f.metadata.get("holds")
        if held is not None:
            own[f.name] = held(**{k: values[k] for k in (g.name for g in fields(held)) if k in values})
        elif f.name in values:
            own[f.name] = values[f.name]
    return cls(**own)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


# --- reading --------------------------------------------------------------------------------------------------------

def packaged_info() -> dict[str, dict[str, str]]:
    """The packaged recipes, the default first: name -> {"description", "reaches", "costs"}."""
    found = {}
    for path in sorted(resources.files("dofattn.recipes").iterdir(), key=lambda p: p.name):
        if path.name.endswith(".toml"):
            data = tomllib.loads(path.read_text())
            found[path.name[:-5]] = {key: str(data.get(key, "")).split("\n")[0]
                                     for key in ("description", "reaches", "costs")}
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != DEFAULT, kv[0])))


def packaged() -> dict[str, str]:
    """The packaged recipes, the default first: name -> description (the first line)."""
    return {name: info["description"] for name, info in packaged_info().items()}


def read_text(name_or_path: str) -> tuple[str, str]:
    """(text, where) of a recipe given by packaged name or by path."""
    path = Path(name_or_path).expanduser()
    if name_or_path.endswith(".toml") or path.is_file():
        if not path.is_file():
            raise UserError(f"recipe file {name_or_path} does not exist")
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError:
            raise UserError(f"recipe file {name_or_path} is not text (a recipe is a TOML file: `dofattn recipes "
                            f"window` prints one)") from None
    names = packaged()
    if name_or_path in RENAMED:
        raise UserError(f"recipe {name_or_path!r} is now {RENAMED[name_or_path]!r} (the same student); without "
                        f"--recipe, dofattn distill trains {DEFAULT}")
    if name_or_path not in names:
        raise UserError(f"unknown recipe {name_or_path!r}; use one of {', '.join(names)}, or a .toml file")
    return resources.files("dofattn.recipes").joinpath(name_or_path + ".toml").read_text(), name_or_path


def load(name_or_path: str = DEFAULT, sets: list[str] = (), overrides: dict[str, object] | None = None) -> Recipe:
    """The recipe `name_or_path`, then `sets` ("key=value" strings, as `--set` gives them), then `overrides`
    (`table.key` -> value, already typed: the CLI's own flags), validated."""
    text, where = read_text(name_or_path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"recipe {where} is not valid TOML ({err})") from None
    fmt = data.pop("format", FORMAT)
    if fmt != FORMAT:
        raise UserError(f"recipe {where} has format {fmt}; this dofattn reads format {FORMAT}")
    name, description = data.pop("name", Path(where).stem), data.pop("description", "")
    data.pop("reaches", None), data.pop("costs", None)          # what a packaged student reaches and costs
    values, gone = {}, {}
    for table, content in data.items():
        if table not in TABLES or not isinstance(content, dict):
            raise UserError(f"recipe {where}: unknown table [{table}]; the tables are {', '.join(TABLES)}")
        for key, value in content.items():
            if left(f"{table}.{key}", value, where, gone):
                continue
            full = resolveoption(f"{table}.{key}")
            values[full] = coerce(full, value, where)
    for item in sets:
        key, sep, text_value = item.partition("=")
        if not sep:
            raise UserError(f"--set {item!r}: give KEY=VALUE, e.g. --set student.window=32")
        value = parse_value(text_value.strip())
        if left(key.strip(), value, "--set", gone):
            continue
        full = resolveoption(key.strip())
        if value is None and type(None) not in typing.get_args(key_fields()[full][0]):
            value = text_value.strip()        # "none" is a value of its own where a key cannot be unset
        values[full] = coerce(full, value, "--set")
    for full, value in (overrides or {}).items():
        values[full] = coerce(full, value, "the command line")
    tables = {t: _build(cls, {k.split(".")[1]: v for k, v in values.items() if k.split(".")[0] == t})
              for t, cls in TABLES.items()}
    recipe = Recipe(name=str(name), description=str(description), **tables)
    check_left(recipe, gone)
    validate(recipe)
    return recipe


def left(key: str, value, where: str, gone: dict) -> bool:
    """True for a key that has left dofattn given at a value it may hold (nothing to do; noted in `gone` with its
    source); a UserError for it set otherwise."""
    full = key if key in LEFT else next((k for k in LEFT if k.split(".")[1] == key), None)
    if full is None:
        return False
    if value not in LEFT[full]:
        raise UserError(f"{where}: {full} = {_toml(value)} measured worse or flat, no recipe used it, and it left "
                        f"dofattn (docs/log/experiments.md); remove the key")
    gone[full] = (value, where)
    return True


def check_left(recipe: Recipe, gone: dict) -> None:
    """A key that left at a value that would change this recipe's student: rows drawn by position where rows are
    drawn (`layerwise.rows`)."""
    value, where = gone.get("layerwise.rows_by", (None, ""))
    lw = recipe.layerwise
    if value == "position" and 0 < lw.rows < lw.seq_len:
        raise UserError(f"{where}: layerwise.rows_by = \"position\" (no recipe used it) left dofattn; the rows are "
                        f"drawn by log position now (docs/log/experiments.md): remove the key")


def key_fields() -> dict[str, tuple[type, object, str, tuple | None]]:
    """Every key: `table.key` -> (type, default, help, choices)."""
    found = {}
    for t, cls in TABLES.items():
        for f in fields(cls):
            held = f.metadata.get("holds")
            owner, keys = (held, fields(held)) if held is not None else (cls, [f])
            hints = typing.get_type_hints(owner)
            found.update({f"{t}.{g.name}": (hints[g.name], g.default, g.metadata["help"], g.metadata["choices"])
                          for g in keys})
    return found


def resolveoption(key: str) -> str:
    """`table.key`, or a bare key that only one table has, as `table.key`; else a one-line error."""
    keys = key_fields()
    if key in keys:
        return key
    matches = [k for k in keys if k.split(".")[1] == key]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UserError(f"recipe key {key!r} is in several tables: say which, {' or '.join(matches)}")
    close = difflib.get_close_matches(key, list(keys) + [k.split(".")[1] for k in keys], n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise UserError(f"unknown recipe key {key!r}{hint} (`dofattn recipes --keys` lists them)")


def parse_value(text: str):
    """A --set value as TOML reads it (true, 3, 2e-3, "text"), or the bare text; none: unset (where a key may be)."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


NAMES = {int: "an integer", float: "a number", str: "a text", bool: "true or false"}


def coerce(key: str, value, where: str):
    """`value` as key's type, or a one-line error naming the key and what it takes."""
    kind, default, _, choices = key_fields()[key]
    optional = type(None) in typing.get_args(kind)
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind) if optional else kind
    if value is None:
        if optional:
            return None
        raise UserError(f"{where}: {key} cannot be unset; give {NAMES[base]}")
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if base is float and isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where}: {key} = {value!r} is not a finite number")
    if base is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise UserError(f"{where}: {key} = {value!r} is not {NAMES[base]}"
                        + (f"; use one of {', '.join(choices)}" if choices else ""))
    if choices and value not in choices:
        raise UserError(f"{where}: {key} = {value!r}; use one of {', '.join(choices)}")
    return value


# --- the rules ------------------------------------------------------------------------------------------------------

def check_fixed_dims(rule: str, what: str = "--dims") -> None:
    """A one-line UserError naming option `what` unless `rule` is one of the forms `choose.resolve_dims` takes: C or
    fix:C with C >= 1, fix, or a dof.json file that exists; on the text alone, before any model loads."""
    from pathlib import Path

    if rule == "fix" or rule.startswith("fix:") or rule.isdigit():
        value = rule if rule.isdigit() else rule.partition(":")[2] or "1"
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"bad {what} {rule!r}; use C or fix:C with C >= 1, fix, or a dof.json file")
    elif rule.endswith(".json"):
        if not Path(rule).is_file():
            raise UserError(f"dims file {rule} does not exist; run `dofattn dof --out {rule}` first")
    else:
        raise UserError(f"bad {what} {rule!r}; use C, fix, fix:C, or a dof.json file")


def validate(recipe: Recipe) -> None:
    """Every rule on a recipe's keys, each a one-line UserError naming the key and what is allowed."""
    s, lw, e2e = recipe.student, recipe.layerwise, recipe.end_to_end
    a = s.attention                                   # its own rules ran as it was built
    check_lora(lora_rank=s.lora_rank, lora_targets=s.lora_targets)
    for key, value, what in (("keep_softmax", s.keep_softmax, "layers"),
                             ("exact_heads", s.exact_heads, "key/value heads")):
        if not value >= 0 or (value >= 1 and value != int(value)):
            raise UserError(f"student.{key} = {value:g}: give a count of {what} >= 1, a share between 0 and 1, "
                            f"or 0 (none)")
    check_kept(a, s.kept, s.keep_softmax, s.exact_heads)
    dims = s.dims
    if not (dims in (*DOF_DIMS, "fix") or dims.startswith("fix:") or dims.endswith(".json")):
        raise UserError(f"student.dims = {dims!r}; use dof, clip, fix, fix:C or a dof.json file")
    at_least = {"layerwise.batch_size": 1, "layerwise.seq_len": 2, "layerwise.blocks": 1, "end_to_end.batch_size": 1,
                "end_to_end.seq_len": 2, "end_to_end.checkpoint_every": 1, "eval.blocks": 1, "eval.seq_len": 2,
                "layerwise.steps": 0, "layerwise.rows": 0, "end_to_end.steps": 0, "end_to_end.cooldown_steps": 0,
                "end_to_end.eval_every": 0, "end_to_end.loss_chunk": 0}
    keys = recipe.keys()
    for key, low in at_least.items():
        if keys[key] < low:
            raise UserError(f"{key} = {keys[key]}: give >= {low}")
    if e2e.blocks is not None and e2e.blocks < 1:
        raise UserError(f"end_to_end.blocks = {e2e.blocks}: give >= 1 (or leave it out: layerwise.blocks)")
    for key in ("dof.lam", "layerwise.lr", "layerwise.lr_weights", "end_to_end.lr"):
        if not keys[key] > 0:
            raise UserError(f"{key} = {keys[key]}: give a value > 0")
    if e2e.conv_lr is not None and not e2e.conv_lr > 0:
        raise UserError(f"end_to_end.conv_lr = {e2e.conv_lr}: give a learning rate > 0 (or leave it out: lr)")
    if e2e.conv_lr is not None and not a.conv:
        raise UserError("end_to_end.conv_lr is the learning rate of the convolution filters: set student.conv too")
    if not e2e.kd_weight >= 0:
        raise UserError(f"end_to_end.kd_weight = {e2e.kd_weight}: give >= 0")
    if e2e.cooldown_steps > e2e.steps:
        raise UserError(f"end_to_end.cooldown_steps = {e2e.cooldown_steps} is longer than the phase "
                        f"(end_to_end.steps = {e2e.steps})")
    if lw.steps == 0 and e2e.steps == 0:
        raise UserError("layerwise.steps and end_to_end.steps are both 0: nothing would train")
    if s.lora_rank and e2e.steps == 0:
        raise UserError("student.lora_rank: adapters train in the end-to-end phase; set end_to_end.steps >= 1")
    if lw.steps and lw.loss == "l2":
        check_l2(a, lw.seq_len)
    if lw.rows and lw.loss != "softmax":
        raise UserError(f"layerwise.rows samples the rows of the softmax loss; layerwise.loss = {lw.loss!r} reads "
                        f"every pair: set layerwise.rows = 0 or layerwise.loss = 'softmax'")


def check_l2(attention: Attention, seq_len: int) -> None:
    """The l2 loss's rules, for a recipe and for the loss itself (`distill.losses.l2_loss`): it compares kernel
    values, which PRF and Performer features estimate, on the pairs beyond the window."""
    if not estimates_kernel(attention.feature):
        raise UserError(f"layerwise.loss = 'l2' compares kernel values: use student.feature prf or performer, not "
                        f"{attention.feature!r}")
    if attention.window >= seq_len:
        raise UserError(f"layerwise.loss = 'l2' fits only pairs beyond the window: set layerwise.seq_len > "
                        f"student.window ({attention.window})")


def type_name(kind) -> str:
    """int, float, str, bool; `int?` for a key that may be left unset."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return f"{args[0].__name__}?" if args else kind.__name__


def describe_keys() -> str:
    """Every key with its type, default and meaning: what `dofattn recipes --keys` prints."""
    fields = key_fields()
    width = max(len(key.split(".")[1]) for key in fields) + 2
    lines, table = [f"{'KEY':<{width + 2}}TYPE    DEFAULT         MEANING   (TYPE?: may be left unset)"], None
    for key, (kind, default, help, choices) in fields.items():
        t, name = key.split(".")
        if t != table:
            lines.append(f"[{t}]")
            table = t
        shown = "unset" if default is None else _toml(default)
        lines.append(f"  {name:<{width}}{type_name(kind):<8}{shown:<16}{help}"
                     + (f" [{', '.join(choices)}]" if choices else ""))
    return "\n".join(lines)
