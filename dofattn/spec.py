"""The student's architecture: one frozen `Attention` config for how a linearized layer attends, and the
`StudentSpec` of a whole student (base model, layers, dims, that config, LoRA), validated here and nowhere else.

    attention = Attention(window=64, sink=4)                       # the window recipe's linear layers
    spec = StudentSpec(base_model="smollm2-135m", dims=(64,) * 30, layers=tuple(range(30)), attention=attention)
    spec.to_json()                  # dofattn.json of a student folder
    StudentSpec.from_json(text)     # older folders (schemas 1 and 2) are read too

`Attention` is the one object that the recipe's [student] table holds (its fields are the table's attention keys,
their help the keys' documentation), the spec saves, and every `LinearAttention` receives whole. Its
`__post_init__` holds every rule on how the parts combine, so a bad combination fails with the same one-line
message before a model loads, when a folder is read, or when a layer is built; `linear_pairs` is the exact-token
rule (window, sink) that the losses, the DoF mask and the layer all read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from dofattn import __version__
from dofattn.errors import UserError
from dofattn.options import option

CONFIG_FILE = "dofattn.json"   # a student folder's spec
WEIGHTS_FILE = "features.safetensors"   # and its trained tensors (`model.student.save_student`)
SCHEMA = 4    # of dofattn.json; 3: the kept layers' keys in `attention`; 2: its keys flat in the spec; 1: flags
FEATURES = ("prf", "performer", "hedgehog", "dijiang")   # the feature maps (`features`)
DECAYS = ("none", "head", "gate")  # no decay; a learned decay per head; a decay per token read off its value
LORA_TARGETS = ("attention", "all")


def is_student(path) -> bool:
    """Whether `path` is a student folder (it holds a `CONFIG_FILE`)."""
    from pathlib import Path

    return (Path(path) / CONFIG_FILE).is_file()


# An export (`dofattn export`, loaded by `model.exported`): a Hugging Face folder whose config.json has this model
# type and a "dofattn" entry (the spec), its classes in MODELING_FILE, its weights in one file or shards (WEIGHTS_INDEX).
MODEL_TYPE = "dofattn"
MODELING_FILE = "modeling_dofattn.py"
WEIGHTS_INDEX = "model.safetensors.index.json"


def read_config(folder) -> dict | None:
    """config.json of `folder` if it is a dofattn export, else None."""
    from pathlib import Path

    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    is_export = isinstance(config, dict) and config.get("model_type") == MODEL_TYPE and "dofattn" in config
    return config if is_export else None


def is_export(folder) -> bool:
    """Whether `folder` is a dofattn export (`read_config`)."""
    return read_config(folder) is not None


def estimates_kernel(kind: str) -> bool:
    """Whether maps of `kind` estimate the softmax kernel exp(s·qᵀk) itself (prf, performer), not only its shape: the
    l2 loss and the kernel error compare their values (`FeatureMap.estimates_kernel`)."""
    return kind in ("prf", "performer")


@dataclass(frozen=True)
class Attention:
    """How every linearized layer attends: its feature map, the exact keys beside the linear branch (a window of the
    last W tokens, a sink of the first S), and the linear branch's mechanisms (a decay or a gate, a short
    convolution). `LinearAttention` composes one part per mechanism from it."""

    feature: str = option("prf", "feature map: learned positive random features (prf), fixed ones (performer), "
                                 "Hedgehog's learned softmax map, or DiJiang's", choices=FEATURES)
    window: int = option(64, "exact softmax attention over the last W tokens beside the linear part (0: pure linear)")
    sink: int = option(4, "the first S tokens stay exact for every query beside the window (0: none)")
    decay: str = option("none", "decay of the linear state: none, head (a learned rate per head, beside a window "
                                "counted from its edge) or gate (per token, read off its value; pure linear attention "
                                "only)", choices=DECAYS)
    conv: int = option(0, "a short causal convolution of this width on q, k and v (0: none)")

    def __post_init__(self):
        """Every rule on how the parts combine; a UserError names the recipe key (student.KEY)."""
        if self.feature not in FEATURES:
            raise UserError(f"student.feature = {self.feature!r} is not a feature map; use one of "
                            f"{', '.join(FEATURES)}")
        for name in ("window", "sink", "conv"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise UserError(f"student.{name} = {value!r} is not an integer")
        if self.decay not in DECAYS:
            raise UserError(f"student.decay = {self.decay!r}; use none, head (a learned decay per head) or gate "
                            f"(per token)")
        if self.window < 0:
            raise UserError(f"student.window = {self.window}: give >= 0 tokens (0: pure linear attention)")
        if self.sink < 0:
            raise UserError(f"student.sink = {self.sink}: give >= 0 tokens (0: none)")
        if self.sink and not self.window:
            raise UserError(f"student.sink = {self.sink} sits beside a softmax window: set student.window >= 1, or "
                            f"sink = 0")
        if self.decay == "gate" and self.window:
            raise UserError("student.decay = 'gate' is for pure linear attention: set student.window = 0 (and sink "
                            "= 0), or decay = 'head'")
        if self.conv < 0 or self.conv == 1:
            raise UserError(f"student.conv = {self.conv}: a filter is at least 2 tokens wide (0: none)")

    @property
    def decays(self) -> bool:
        """Whether the linear state decays (a decay per head, or a gate per token)."""
        return self.decay != "none"

    def linear_pairs(self, length: int, device=None):
        """[T, T] bool: the causal pairs (query t, key s) that the linear branch holds, the rest of the causal
        triangle being exact: all of them in pure linear attention; beside a window, s <= t - W and s >= S (the
        sink's keys stay exact). For a sequence that starts at position 0 without padding (`ops.window.window_pairs`).
        """
        import torch

        from dofattn.ops.window import window_pairs

        pos = torch.arange(length, device=device)
        if not self.window:
            return pos[None, :] <= pos[:, None]
        return window_pairs(pos[:, None], pos[None, :], self.window, pos[None, :] < self.sink)[1]

    def describe(self) -> str:
        """`window=64, sink=4, decay=head`: what differs from pure linear attention, for a layer's repr."""
        parts = [f"window={self.window}"] if self.window else []
        parts += [f"sink={self.sink}"] if self.sink else []
        parts += [f"decay={self.decay}"] if self.decays else []
        parts += [f"conv={self.conv}"] if self.conv else []
        return ", ".join(parts)


@dataclass(frozen=True)
class Kept:
    """How the layers kept as softmax attention (`student.keep_softmax`) hold their cache: every key (select = 0), or
    bounded after the prompt (`model.bounded.BoundedSoftmax`): the sink and window of the linear layers'
    `Attention`, and the C keys per kv head that the prompt's last queries attend to most."""

    select: int = option(0, "after the prompt, the kept softmax layers hold only the sink, the window and the C keys "
                            "per kv head that its last queries attend to most (SnapKV-style): recall of a fact asked "
                            "for at the end, in fixed memory (0: they hold every key)")
    select_observe: int = option(8, "the prompt's last queries whose attention chooses the selected keys (its "
                                    "question)")
    select_pool: int = option(15, "a selected key brings its neighbours: scores max-pooled over this many keys (odd)")

    def __post_init__(self):
        """Its own rules; a UserError names the recipe key (student.KEY)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise UserError(f"student.{f.name} = {value!r} is not an integer")
        if self.select < 0:
            raise UserError(f"student.select = {self.select}: give >= 0 keys per kv head (0: none)")
        if self.select_observe < 1 or self.select_pool < 1 or self.select_pool % 2 == 0:
            raise UserError(f"student.select_observe = {self.select_observe} must be >= 1 and student.select_pool "
                            f"= {self.select_pool} odd and >= 1")
        chooses = [f for f in fields(self) if f.name != "select"]
        if not self.select and any(getattr(self, f.name) != f.default for f in chooses):
            raise UserError("student.select_observe and select_pool choose the selected keys, but student.select = "
                            "0 selects none: set student.select >= 1, or leave them out")

    def describe(self, attention: Attention) -> str:
        """`sink=4, window=64, select=256`: what a kept layer holds after the prompt, for a layer's repr."""
        parts = [f"sink={attention.sink}"] if attention.sink else []
        return ", ".join([*parts, f"window={attention.window}", f"select={self.select}"])


def check_kept(attention: Attention, kept: Kept, num_kept: int, exact_heads: int | float = 0) -> None:
    """The rules between the linear layers' `attention` and what stays exact: `num_kept` whole layers kept as softmax
    attention, `exact_heads` key/value heads kept exact inside linear layers (a count or a share: any > 0 is some);
    the `kept` cache bound of both."""
    if kept.select and not attention.window:
        raise UserError(f"student.select = {kept.select}: a kept layer's bound holds the window's keys beside the "
                        f"selected ones; set student.window >= 1, or select = 0")
    if kept.select and not num_kept and not exact_heads:
        raise UserError(f"student.select = {kept.select} bounds the layers kept as softmax attention, and this "
                        f"student keeps none: set student.keep_softmax >= 1, or select = 0")
    if exact_heads and not kept.select:
        raise UserError("student.exact_heads keeps heads exact inside linear layers, bounded after the prompt as the "
                        "kept layers are: set student.select >= 1 (the keys they choose)")


def check_exact_heads(exact: tuple[tuple[int, ...], ...], layers: tuple[int, ...], num_layers: int,
                      num_kv_heads: int | None) -> None:
    """The rules on the key/value heads a student keeps exact inside its linear layers: an entry per layer, heads
    only in linear layers (a kept layer is exact whole), each once, at least one linear head left in each layer."""
    if len(exact) != num_layers:
        raise UserError(f"exact_heads gives {len(exact)} layers but the student has {num_layers}")
    for i, heads in enumerate(exact):
        if heads and i not in layers:
            raise UserError(f"exact_heads names heads {list(heads)} of layer {i}, which is not linear: a layer kept "
                            f"as softmax attention is exact whole")
        if len(set(heads)) != len(heads) or any(h < 0 for h in heads):
            raise UserError(f"exact_heads of layer {i} = {list(heads)}: give distinct key/value heads >= 0")
        if num_kv_heads is not None and heads and (max(heads) >= num_kv_heads or len(heads) >= num_kv_heads):
            raise UserError(f"exact_heads of layer {i} = {list(heads)}: the model has {num_kv_heads} key/value "
                            f"heads a layer, and a linear layer keeps at least one of them linear")


def check_lora(*, lora_rank: int, lora_targets: str) -> None:
    """The rules on a student's LoRA adapters; a UserError names the recipe key (student.KEY)."""
    if lora_targets not in LORA_TARGETS:
        raise UserError(f"student.lora_targets = {lora_targets!r}; use attention or all")
    if lora_rank < 0:
        raise UserError(f"student.lora_rank = {lora_rank}: give >= 0 (0: no LoRA)")
    if lora_targets != "attention" and not lora_rank:
        raise UserError(f"student.lora_targets = {lora_targets!r} needs adapters: set student.lora_rank >= 1")


@dataclass(frozen=True)
class StudentSpec:
    """A student: which base model, which layers are linear with how many features, how they attend (`attention`)
    and how the layers kept as softmax attention hold their cache (`kept`)."""

    base_model: str
    dims: tuple[int, ...]             # features per layer, one entry for every layer of the base model
    layers: tuple[int, ...]           # the linearized layers; the rest keep softmax attention
    attention: Attention = field(default_factory=Attention)
    kept: Kept = field(default_factory=Kept)
    seed: int = 0                     # of the untrained features
    base: dict = field(default_factory=dict, hash=False)   # the base model's fingerprint (`student.fingerprint`)
    lora_rank: int = 0
    lora_alpha: float = 0.0           # 0: the rank
    lora_targets: str = "attention"
    exact_heads: tuple[tuple[int, ...], ...] = ()   # per layer, its key/value heads kept exact (none: ())
    schema: int = SCHEMA
    dofattn_version: str = __version__

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(self, "layers", tuple(sorted(int(i) for i in self.layers)))
        if isinstance(self.attention, dict):
            object.__setattr__(self, "attention", Attention(**self.attention))
        if isinstance(self.kept, dict):
            object.__setattr__(self, "kept", Kept(**self.kept))
        exact = tuple(tuple(sorted(int(h) for h in heads)) for heads in self.exact_heads)
        object.__setattr__(self, "exact_heads", exact if any(exact) else ())
        check_kept(self.attention, self.kept, len(self.dims) - len(self.layers), self.exact_count)
        check_lora(lora_rank=self.lora_rank, lora_targets=self.lora_targets)
        if not self.dims or min(self.dims) < 1:
            raise UserError(f"a student needs >= 1 feature in every layer, got dims {list(self.dims)}")
        if any(i < 0 or i >= len(self.dims) for i in self.layers):
            raise UserError(f"linearized layers {list(self.layers)} out of range for {len(self.dims)} layers")
        if self.exact_heads:
            check_exact_heads(self.exact_heads, self.layers, len(self.dims), self.base.get("num_kv_heads"))

    @property
    def exact_count(self) -> int:
        """Key/value heads kept exact inside the linear layers."""
        return sum(len(heads) for heads in self.exact_heads)

    @property
    def softmax_layers(self) -> list[int]:
        return [i for i in range(len(self.dims)) if i not in self.layers]

    def describe(self, lora: bool = True, local: list[int] | tuple[int, ...] = ()) -> list[str]:
        """The architecture in words, a line each (the export's model card, `dofattn generate`): the linear layers
        and their features, the kept ones and what their cache holds, the model's own sliding-window layers
        (`local`, `hf.local_layers`) kept as they are, each mechanism the config names."""
        a, kept, dims = self.attention, self.kept, [self.dims[i] for i in self.layers]
        lines = [f"{len(self.layers)} of {len(self.dims)} attention layers linear" + (
            "" if not dims else f", `{a.feature}` features, " + (
                f"{dims[0]} per head" if len(set(dims)) == 1 else
                f"{min(dims)}-{max(dims)} per head by layer (mean {sum(dims) / len(dims):.0f})"))]
        own = [i for i in self.softmax_layers if i in local]
        softmax = [i for i in self.softmax_layers if i not in own]
        if own:
            lines.append(f"the model's own sliding-window layer{'s' if len(own) > 1 else ''} {', '.join(map(str, own))} as "
                         f"{'they are' if len(own) > 1 else 'it is'} (each holds its last window of tokens)")
        if softmax:
            held = (f"after the prompt each holds its first {a.sink} tokens, its last {a.window} and the "
                    f"{kept.select} keys per kv head that the prompt's last {kept.select_observe} queries attend to "
                    f"most: fixed memory" if kept.select else "their cache grows with the context")
            lines.append(f"softmax attention kept in layer{'s' if len(softmax) > 1 else ''} "
                         f"{', '.join(map(str, softmax))} ({held})")
        if self.exact_heads:
            mixed = [i for i, heads in enumerate(self.exact_heads) if heads]
            lines.append(f"{self.exact_count} key/value heads kept exact inside {len(mixed)} linear layers "
                         f"({', '.join(f'{i}: {list(self.exact_heads[i])}' for i in mixed)}; after the prompt each "
                         f"holds its first {a.sink} tokens, its last {a.window} and its {kept.select} chosen keys)")
        if a.window and self.layers:
            lines.append(f"exact softmax attention over the last {a.window} tokens"
                         + (f" and the first {a.sink}" if a.sink else "") + ", linear attention beyond")
        linear = bool(self.layers)
        for on, text in ((linear and a.decay == "head", "a learned decay per head"),
                         (linear and a.decay == "gate", "a decay per token (gate)"),
                         (linear and a.conv, f"a short convolution of {a.conv} tokens on q, k and v"),
                         (lora and self.lora_rank, f"LoRA adapters of rank {self.lora_rank} on the "
                                                   f"{self.lora_targets} projections")):
            if on:
                lines.append(text)
        return lines

    def to_json(self) -> str:
        data = asdict(self)
        data.update(dims=list(self.dims), layers=list(self.layers))
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str, where: str = "dofattn.json") -> StudentSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise UserError(f"{where} is not a dofattn student spec")
        schema = data.get("schema", 1)
        if schema == 1:
            data = _from_schema_1(data, where)
        if schema in (1, 2):
            data = _from_schema_2(data)
        if schema in (1, 2, 3):
            data = _from_schema_3(data, where)
        elif schema != SCHEMA:
            raise UserError(f"{where} has schema {schema}; this dofattn ({__version__}) reads schemas 1 to {SCHEMA}: "
                            f"upgrade dofattn")
        data = _pop_head_dims(data, where)
        if isinstance(data.get("attention"), dict):
            data = {**data, "attention": dict(data["attention"])}
            _pop_left(data["attention"], LEFT, where)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        for name, config in (("attention", Attention), ("kept", Kept)):
            if isinstance(data.get(name), dict):
                unknown += sorted(f"{name}.{k}" for k in set(data[name]) - {f.name for f in fields(config)})
        if unknown:
            raise UserError(f"{where} has unknown fields {unknown}: it was written by another dofattn version")
        try:
            return cls(**data)
        except TypeError as err:
            raise UserError(f"{where} is not a dofattn student spec ({err})") from None


def _from_schema_1(data: dict, where: str) -> dict:
    """A schema-1 dofattn.json (decay and gate as flags) as schema 2."""
    data = dict(data)
    gate, decay = data.pop("gate", False), data.pop("decay", False)
    data["decay"] = "gate" if gate else "head" if decay else "none"
    return data


def _pop_head_dims(data: dict, where: str) -> dict:
    """`data` without `head_dims`, which every schema-1 spec and those of 2026-12-02 hold (features per query head:
    `--per-head`, then `student.dims = dof-head`, both measured flat and removed): empty, it is dropped; a student
    built with them is refused."""
    data = dict(data)
    if data.pop("head_dims", None):
        raise UserError(f"{where} gives every head its own feature count (per-head dims, an option that measured "
                        f"flat and left dofattn: docs/log/experiments.md); distill the student again")
    return data


def _from_schema_2(data: dict) -> dict:
    """A schema-2 dofattn.json (the attention keys flat in the spec) as schema 3."""
    data = dict(data)
    flat = {f.name: data.pop(f.name) for f in fields(Attention) if f.name in data}
    data["attention"] = {**{f.name: f.default for f in fields(Attention)}, "window": 0, "sink": 0, **flat}
    return data


# Options that measured worse or flat, in no recipe, and left (docs/log/experiments.md): their defaults. Schema 3's
# in its `attention` (2026-11-27), and since (2026-11-29) the delta rule, which any schema may hold.
REMOVED = {"gain": "head", "select_in": "softmax", "select_by": "prompt"}
LEFT = {"delta": False}


def _pop_left(attention: dict, left: dict, where: str) -> None:
    """Take the options that left out of `attention`, in place; a UserError for one that is not at its default."""
    for key, default in left.items():
        value = attention.pop(key, default)
        if value != default:
            raise UserError(f"{where} was built with student.{key} = {value!r}, an option that measured worse and "
                            f"left dofattn (docs/log/experiments.md); distill the student again")


def _from_schema_3(data: dict, where: str) -> dict:
    """A schema-3 dofattn.json (the kept layers' selection in `attention`) as schema 4; a UserError for a student
    built with an option that has left (a gain per query, selection in the linear layers, a streamed cache)."""
    data, attention = dict(data), dict(data.get("attention") or {})
    _pop_left(attention, REMOVED, where)
    selected = {k: attention.pop(k) for k in [f.name for f in fields(Kept)] if k in attention}
    if not selected.get("select"):
        selected = {}                # schema 3 saved the selection's settings whether or not it selected
    data["attention"], data["kept"], data["schema"] = attention, selected, SCHEMA
    return data
