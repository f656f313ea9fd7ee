"""The student's architecture: one frozen `Attention` config for how a linearized layer attends, and the
`StudentSpec` of a whole student (base model, layers, dims, that config, LoRA), validated here and nowhere else.

    attention = Attention(window=64, sink=4)                       # the default student's layers
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

import torch

from dofattn import __version__
from dofattn.errors import UserError
from dofattn.features import FEATURES
from dofattn.options import option

SCHEMA = 3                        # of dofattn.json; 2: the attention keys flat in the spec; 1: decay/gate flags
DECAYS = ("none", "head", "gate")  # no decay; a learned decay per head; a decay per token read off its value
LORA_TARGETS = ("attention", "all")
GAINS = ("head", "query")          # the linear part's weight beside a window: per head; per head and query
SELECT_IN = ("softmax", "all")     # the kept softmax layers; those and the linear layers
SELECT_BY = ("prompt", "stream")   # chosen once by the prompt's last queries; scored as they arrive (trained)
STREAM_MIN_WINDOW = 8              # a streaming score reads 8 tokens, which the window holds (`attention.scorer`)


@dataclass(frozen=True)
class Attention:
    """How every linearized layer attends: its feature map, the exact keys beside the linear branch (a window of the
    last W tokens, a sink of the first S), and the linear branch's mechanisms (a decay or a gate, a short
    convolution, the delta rule). `LinearAttention` composes one part per mechanism from it."""

    feature: str = option("prf", "feature map: learned positive random features (prf), fixed ones (performer), "
                                 "Hedgehog's learned softmax map, or DiJiang's", choices=FEATURES)
    window: int = option(64, "exact softmax attention over the last W tokens beside the linear part (0: pure linear)")
    sink: int = option(4, "the first S tokens stay exact for every query beside the window (0: none)")
    gain: str = option("head", "the linear part's weight against the window's exact keys: head (a learned number per "
                               "head) or query (also one read off each query: how much it reads beyond the window)",
                       choices=GAINS)
    decay: str = option("none", "decay of the linear state: none, head (a learned rate per head, beside a window "
                                "counted from its edge) or gate (per token, read off its value; pure linear attention "
                                "only)", choices=DECAYS)
    select: int = option(0, "after the prompt, keep exact the C keys per kv head that its last queries attend to "
                            "most (SnapKV-style), beside the window: recall of a fact asked for at the end, in fixed "
                            "memory (0: none)")
    select_in: str = option("softmax", "the layers that keep selected keys: softmax (the layers kept exact, whose "
                                       "cache after the prompt becomes the sink, the window and the selected keys) "
                                       "or all (the linear layers too, beside their window)", choices=SELECT_IN)
    select_by: str = option("prompt", "how the kept layers choose their selected keys: prompt (after the prompt, the "
                                      "keys its last queries attend to; the prompt itself is read in full) or stream "
                                      "(a trained scorer rates each key as it arrives; every query, the prompt's too, "
                                      "sees the best C that have left its window: bounded from the first token)",
                            choices=SELECT_BY)
    select_observe: int = option(8, "the prompt's last queries whose attention chooses the selected keys (its "
                                    "question)")
    select_pool: int = option(15, "a selected key brings its neighbours: scores max-pooled over this many keys (odd)")
    conv: int = option(0, "a short causal convolution of this width on q, k and v (0: none)")
    delta: bool = option(False, "write the linear state by the delta rule (pure linear attention only)")

    def __post_init__(self):
        """Every rule on how the parts combine; a UserError names the recipe key (student.KEY)."""
        if self.feature not in FEATURES:
            raise UserError(f"student.feature = {self.feature!r} is not a feature map; use one of "
                            f"{', '.join(FEATURES)}")
        for name, kind in (("window", int), ("sink", int), ("select", int), ("select_observe", int),
                           ("select_pool", int), ("conv", int), ("delta", bool)):
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise UserError(f"student.{name} = {value!r} is not {'an integer' if kind is int else 'true or false'}")
        if self.gain not in GAINS:
            raise UserError(f"student.gain = {self.gain!r}; use head (a learned gain per head) or query (per query too)")
        if self.gain == "query" and not self.window:
            raise UserError("student.gain = 'query' weighs the linear part against a window: set student.window >= 1, "
                            "or gain = 'head'")
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
        if self.select < 0:
            raise UserError(f"student.select = {self.select}: give >= 0 keys per kv head (0: none)")
        if self.select and not self.window:
            raise UserError(f"student.select = {self.select} keys are read exactly with a softmax window: set "
                            f"student.window >= 1, or select = 0")
        if self.select and self.select_in == "all" and self.decay != "none":
            raise UserError("student.select_in = 'all' (selected keys in the linear layers) beside a decay is not "
                            "built: set student.decay = 'none', or select_in = 'softmax'")
        if self.select_in not in SELECT_IN:
            raise UserError(f"student.select_in = {self.select_in!r}; use softmax (the layers kept exact) or all")
        if self.select_by not in SELECT_BY:
            raise UserError(f"student.select_by = {self.select_by!r}; use prompt (the prompt's last queries choose) "
                            f"or stream (a trained scorer, as keys arrive)")
        if self.select and self.select_by == "stream" and self.select_in != "softmax":
            raise UserError("student.select_by = 'stream' is built for the kept softmax layers: set "
                            "student.select_in = 'softmax', or select_by = 'prompt'")
        if self.select and self.select_by == "stream" and self.window < STREAM_MIN_WINDOW:
            raise UserError(f"student.select_by = 'stream' scores a key from the {STREAM_MIN_WINDOW} tokens up to it, "
                            f"which its window holds: set student.window >= {STREAM_MIN_WINDOW}")
        if self.select_observe < 1 or self.select_pool < 1 or self.select_pool % 2 == 0:
            raise UserError(f"student.select_observe = {self.select_observe} must be >= 1 and student.select_pool "
                            f"= {self.select_pool} odd and >= 1")
        if self.decay == "gate" and self.window:
            raise UserError("student.decay = 'gate' is for pure linear attention: set student.window = 0 (and sink "
                            "= 0), or decay = 'head'")
        if self.delta and self.window:
            raise UserError("student.delta is for pure linear attention: set student.window = 0 (and sink = 0)")
        if self.conv < 0 or self.conv == 1:
            raise UserError(f"student.conv = {self.conv}: a filter is at least 2 tokens wide (0: none)")

    @property
    def decays(self) -> bool:
        """Whether the linear state decays (a decay per head, or a gate per token)."""
        return self.decay != "none"

    def linear_pairs(self, length: int, device=None) -> torch.Tensor:
        """[T, T] bool: the causal pairs (query t, key s) that the linear branch holds, the rest of the causal
        triangle being exact: all of them in pure linear attention; beside a window, s <= t - W and s >= S (the
        sink's keys stay exact). For a sequence that starts at position 0 without padding."""
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        if not self.window:
            return causal
        return causal.tril(-self.window) & (torch.arange(length, device=device) >= self.sink)

    def describe(self) -> str:
        """`window=64, sink=4, decay=head`: what differs from pure linear attention, for a layer's repr."""
        parts = [f"window={self.window}"] if self.window else []
        parts += [f"sink={self.sink}"] if self.sink else []
        parts += [f"select={self.select}" + ("" if self.select_in == "softmax" else " (all layers)")
                  + (", streamed" if self.select_by == "stream" else "")] if self.select else []
        parts += ["gain per query"] if self.gain == "query" else []
        parts += [f"decay={self.decay}"] if self.decays else []
        parts += [f"conv={self.conv}"] if self.conv else []
        parts += ["delta"] if self.delta else []
        return ", ".join(parts)


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
    """A student: which base model, which layers are linear with how many features, and how they attend."""

    base_model: str
    dims: tuple[int, ...]             # features per layer, one entry for every layer of the base model
    layers: tuple[int, ...]           # the linearized layers; the rest keep softmax attention
    attention: Attention = field(default_factory=Attention)
    seed: int = 0                     # of the untrained features
    base: dict = field(default_factory=dict, hash=False)   # the base model's fingerprint (`student.fingerprint`)
    lora_rank: int = 0
    lora_alpha: float = 0.0           # 0: the rank
    lora_targets: str = "attention"
    schema: int = SCHEMA
    dofattn_version: str = __version__

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(self, "layers", tuple(sorted(int(i) for i in self.layers)))
        if isinstance(self.attention, dict):
            object.__setattr__(self, "attention", Attention(**self.attention))
        check_lora(lora_rank=self.lora_rank, lora_targets=self.lora_targets)
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
        if schema in (1, 2):
            data = _from_schema_2(data)
        elif schema != SCHEMA:
            raise UserError(f"{where} has schema {schema}; this dofattn ({__version__}) reads schemas 1 to {SCHEMA}: "
                            f"upgrade dofattn")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        attention = data.get("attention")
        if isinstance(attention, dict):
            unknown += sorted(f"attention.{k}" for k in set(attention) - {f.name for f in fields(Attention)})
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
    return data


def _from_schema_2(data: dict) -> dict:
    """A schema-2 dofattn.json (the attention keys flat in the spec) as schema 3."""
    data = dict(data)
    flat = {f.name: data.pop(f.name) for f in fields(Attention) if f.name in data}
    data["attention"] = {**{f.name: f.default for f in fields(Attention)}, "window": 0, "sink": 0, **flat}
    data["schema"] = SCHEMA
    return data
