"""The student's architecture: one frozen spec, validated here and nowhere else, and what a student folder stores.

    spec = StudentSpec(base_model="smollm2-135m", feature="prf", dims=(64,) * 30, layers=tuple(range(30)),
                       window=64, sink=4)
    spec.to_json()                  # dofattn.json of a student folder
    StudentSpec.from_json(text)     # older folders (schema 1) are read too

`check_architecture` holds every rule on which switches combine (`check_attention` those of one linear layer, which
`LinearAttention` calls too); the recipe's [student] table and the spec call it, so a bad combination fails with the
same one-line message before a model loads, when a folder is read, or when a layer is built.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from dofattn import __version__
from dofattn.errors import UserError
from dofattn.features import FEATURES

SCHEMA = 2                        # of dofattn.json; 1: the flat StudentConfig with decay/gate flags
DECAYS = ("none", "head", "gate")  # no decay; a learned decay per head; a decay per token read off its value
LORA_TARGETS = ("attention", "all")


def check_attention(*, window: int, sink: int, decay: str, conv: int, delta: bool) -> None:
    """The rules on how a linear layer attends (also `LinearAttention`'s); a UserError names the key (student.KEY)."""
    if decay not in DECAYS:
        raise UserError(f"student.decay = {decay!r}; use none, head (a learned decay per head) or gate (per token)")
    if window < 0:
        raise UserError(f"student.window = {window}: give >= 0 tokens (0: pure linear attention)")
    if sink < 0:
        raise UserError(f"student.sink = {sink}: give >= 0 tokens (0: none)")
    if sink and not window:
        raise UserError(f"student.sink = {sink} sits beside a softmax window: set student.window >= 1, or sink = 0")
    if sink and decay != "none":
        raise UserError(f"student.sink = {sink} and student.decay = {decay!r} do not combine: set one to 0 / none")
    if decay == "gate" and window:
        raise UserError("student.decay = 'gate' is for pure linear attention: set student.window = 0 (and sink = "
                        "0), or decay = 'head'")
    if delta and window:
        raise UserError("student.delta is for pure linear attention: set student.window = 0 (and sink = 0)")
    if conv < 0 or conv == 1:
        raise UserError(f"student.conv = {conv}: a filter is at least 2 tokens wide (0: none)")


def check_architecture(*, feature: str, window: int, sink: int, decay: str, conv: int, delta: bool,
                       lora_rank: int, lora_targets: str) -> None:
    """Every rule on the student's switches; a UserError names the recipe key (student.KEY) and what is allowed."""
    if feature not in FEATURES:
        raise UserError(f"student.feature = {feature!r} is not a feature map; use one of {', '.join(FEATURES)}")
    check_attention(window=window, sink=sink, decay=decay, conv=conv, delta=delta)
    if lora_targets not in LORA_TARGETS:
        raise UserError(f"student.lora_targets = {lora_targets!r}; use attention or all")
    if lora_rank < 0:
        raise UserError(f"student.lora_rank = {lora_rank}: give >= 0 (0: no LoRA)")
    if lora_targets != "attention" and not lora_rank:
        raise UserError(f"student.lora_targets = {lora_targets!r} needs adapters: set student.lora_rank >= 1")


@dataclass(frozen=True)
class StudentSpec:
    """A student: which base model, which layers are linear with how many features, and how they attend."""

    base_model: str
    feature: str
    dims: tuple[int, ...]             # features per layer, one entry for every layer of the base model
    layers: tuple[int, ...]           # the linearized layers; the rest keep softmax attention
    seed: int = 0                     # of the untrained features
    base: dict = field(default_factory=dict, hash=False)   # the base model's fingerprint (`student.fingerprint`)
    window: int = 0
    sink: int = 0
    decay: str = "none"
    conv: int = 0
    delta: bool = False
    lora_rank: int = 0
    lora_alpha: float = 0.0           # 0: the rank
    lora_targets: str = "attention"
    schema: int = SCHEMA
    dofattn_version: str = __version__

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(self, "layers", tuple(sorted(int(i) for i in self.layers)))
        check_architecture(feature=self.feature, window=self.window, sink=self.sink, decay=self.decay,
                           conv=self.conv, delta=self.delta, lora_rank=self.lora_rank,
                           lora_targets=self.lora_targets)
        if not self.dims or min(self.dims) < 1:
            raise UserError(f"a student needs >= 1 feature in every layer, got dims {list(self.dims)}")
        if any(i < 0 or i >= len(self.dims) for i in self.layers):
            raise UserError(f"linearized layers {list(self.layers)} out of range for {len(self.dims)} layers")

    @property
    def softmax_layers(self) -> list[int]:
        return [i for i in range(len(self.dims)) if i not in self.layers]

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
        elif schema != SCHEMA:
            raise UserError(f"{where} has schema {schema}; this dofattn ({__version__}) reads schemas 1 and {SCHEMA}: "
                            f"upgrade dofattn")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"{where} has unknown fields {unknown}: it was written by another dofattn version")
        try:
            return cls(**data)
        except TypeError as err:
            raise UserError(f"{where} is not a dofattn student spec ({err})") from None


def _from_schema_1(data: dict, where: str) -> dict:
    """A schema-1 dofattn.json (decay and gate as flags, head_dims) as schema 2."""
    data = dict(data)
    if data.pop("head_dims", None) is not None:
        raise UserError(f"{where} gives every head its own feature count (the removed --per-head); this dofattn "
                        f"cannot load it: distill the student again")
    gate, decay = data.pop("gate", False), data.pop("decay", False)
    data["decay"] = "gate" if gate else "head" if decay else "none"
    data["schema"] = SCHEMA
    return data
