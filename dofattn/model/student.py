"""The linearized student: turning a loaded HF model into linear attention, and saving / loading it.

    model, tok = load_model("smollm2-135m")
    linearize(model, [64] * 30, Attention(window=64, sink=4))        # dims per layer: `distill.choose`
    save_student(model, "run/", spec)                  # spec: a `dofattn.spec.StudentSpec`
    student, tok, spec = load_student("run/")          # the base model again, linearized, trained features loaded

A student folder holds `dofattn.json` (the `StudentSpec`: base model and its fingerprint, dims, linear layers, the
`Attention` config, LoRA, schema version) and `features.safetensors` (only the student's
parameters and buffers; the base model's weights are loaded from `base_model`). No pickle anywhere.
"""

from __future__ import annotations

import json
from numbers import Integral
from pathlib import Path

import torch
from torch import nn

from dofattn import __version__
from dofattn.attention import LinearAttention
from dofattn.model.install import install
from dofattn.model.attach import LINEAR, attach, bounded_of, linear_of
from dofattn.model.bounded import BoundedSoftmax, HeadSplit
from dofattn.errors import UserError
from dofattn.features import make_feature_map
from dofattn.model.hf import attention_modules
from dofattn.io import read_safetensors, save_tensors, write_atomic
from dofattn.spec import CONFIG_FILE, WEIGHTS_FILE, Attention, Kept, StudentSpec, check_exact_heads, check_kept


def linear_parts(model: nn.Module) -> dict[int, nn.Module]:
    """The linear attention (`LinearAttention`) of each linearized layer of `model`, by layer index, in order: the
    one place a layer's linear part is looked up (kept softmax layers and a teacher have none)."""
    return {i: linear for i, m in enumerate(attention_modules(model)) if (linear := linear_of(m)) is not None}


def head_layout(model: nn.Module) -> tuple[int, int, int]:
    """(query heads, kv heads, head size) of a supported model."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, kv_heads, head_dim


def global_layers(model: nn.Module) -> list[int]:
    """The layers linearized by default: all but the model's own local ones (`hf.local_layers`: sliding-window
    attention, bounded in memory already, stays exact). A UserError if every layer is local."""
    from dofattn.model.hf import local_layers

    count = len(attention_modules(model))
    local = set(local_layers(model.config))
    layers = [i for i in range(count) if i not in local]
    if not layers:
        window = getattr(model.config.get_text_config(decoder=True), "sliding_window", None)
        raise UserError(f"every attention layer of this {model.config.model_type} model is sliding-window attention "
                        f"over {window} tokens, bounded in memory already: nothing to linearize by default; set "
                        f"student.local_layers = \"linearize\" to replace them anyway")
    return layers


def fingerprint(model: nn.Module) -> dict:
    """What identifies a base model: its shape and the norm of its token embedding (dtype independent)."""
    heads, kv_heads, head_dim = head_layout(model)
    embedding = model.get_input_embeddings().weight
    return {"model_type": model.config.model_type, "num_layers": len(attention_modules(model)), "num_heads": heads,
            "num_kv_heads": kv_heads, "head_dim": head_dim, "vocab_size": embedding.shape[0],
            "embedding_norm": round(float(embedding.detach().float().norm()), 3)}


def linear_layer(attention: Attention, heads: int, kv_heads: int, head_dim: int, dim: int, scaling: float,
                 seed: int, exact=()) -> LinearAttention:
    """One layer's `LinearAttention` (float32, on the default device): its feature map of `dim` features a head,
    drawn from `seed`, and the parts
    `attention` names. `exact`: the key/value heads the layer keeps exact (`bounded.HeadSplit`); the module covers
    the others and their query heads. `linearize` builds each layer so; so does the vLLM plugin before it loads an
    export's tensors."""
    group = heads // kv_heads
    fmap = make_feature_map(attention.feature, heads - group * len(exact), head_dim, dim, scaling, seed=seed)
    return LinearAttention(attention, fmap, num_kv_heads=kv_heads - len(exact))


def bounded_layers(config, num_layers: int, layers: list[int], kept: Kept) -> list[int]:
    """The layers a student bounds after the prompt (`BoundedSoftmax`): with `kept.select`, every layer it keeps as
    softmax attention (not in `layers`) but the model's own local ones (`hf.local_layers`: bounded already)."""
    if not kept.select:
        return []
    from dofattn.model.hf import local_layers

    return sorted(set(range(num_layers)) - set(layers) - set(local_layers(config)))


def linearize(model: nn.Module, dims: list[int], attention: Attention = Attention(), *, kept: Kept = Kept(),
              layers: list[int] | None = None, seed: int = 0, exact_heads=()) -> nn.Module:
    """Replace softmax attention by linear attention in `layers`, in place; returns `model`.

    `layers` None: every layer but the model's own sliding-window ones (`global_layers`). `dims[i]` is the feature
    dimension of layer i (entries of layers not linearized are ignored). `attention` (a `spec.Attention`) is how
    every linear layer attends, passed whole to each `LinearAttention`: `Attention(window=0, sink=0)` is pure
    linear attention, the default a 64-token window and a 4-token sink beside it. `kept` (a `spec.Kept`) is how the
    layers kept as softmax attention (not a model's own local ones) hold their cache: every key, or bounded after
    the prompt (`model.bounded.BoundedSoftmax`). `exact_heads` (per layer, or () for none): the key/value heads of
    a linear layer kept exact, with their query heads, bounded as the kept layers are (`bounded.HeadSplit`); the
    layer's `LinearAttention` has the other heads. A model of the
    class dofattn makes one with (`hf.causal_lm_class`, as `hf.load_model` loads it) then reads long prompts in
    chunks (`model.prompt`); one of transformers' own class reads each call in one piece, with the same outputs.
    """
    modules, layers, dims = _check_linearize(model, dims, attention, kept, layers, seed)
    heads, kv_heads, head_dim = head_layout(model)
    exact_heads = tuple(tuple(h) for h in exact_heads)
    if exact_heads:
        check_exact_heads(exact_heads, tuple(layers), len(modules), kv_heads)
    bounded = bounded_layers(model.config, len(modules), layers, kept)   # with kept.select: the kept softmax layers
    check_kept(attention, kept, len(bounded), sum(map(len, exact_heads)))
    param = next(model.parameters())
    parts = {}                # every module built before any is attached: on an error the model is as it was
    for i in layers:
        exact = exact_heads[i] if exact_heads else ()
        linear = linear_layer(attention, heads, kv_heads, head_dim, dims[i], modules[i].scaling, seed * 1000 + i,
                              exact=exact)
        linear = linear.to(param.device).train(modules[i].training)
        parts[i] = {"linear": linear}
        if exact:
            parts[i]["bounded"] = BoundedSoftmax(kept, attention, modules[i].scaling,
                                                 heads=HeadSplit(exact, kv_heads, heads))
    for i in bounded:         # not a model's own local ones: bounded after the prompt
        parts[i] = {"bounded": BoundedSoftmax(kept, attention, modules[i].scaling)}
    for i, part in parts.items():
        attach(modules[i], **part)
    install(model)
    return model


def _check_linearize(model, dims, attention, kept, layers, seed) -> tuple[list, list[int], list[int]]:
    """`linearize`'s arguments, checked before the model changes: (attention modules, layers sorted, dims)."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise UserError(f"linearize takes a loaded Hugging Face model (dofattn.load_model), got {type(model).__name__}")
    if not isinstance(attention, Attention):
        raise UserError(f"linearize takes a dofattn.spec.Attention as its attention, got {type(attention).__name__}")
    if not isinstance(kept, Kept):
        raise UserError(f"linearize takes a dofattn.spec.Kept as kept=, got {type(kept).__name__}")
    modules = attention_modules(model)
    if any(linear_of(m) is not None or bounded_of(m) is not None for m in modules):
        raise UserError("the model is a student already (some layers hold dofattn's modules): linearize a freshly "
                        "loaded model, or load a trained student with dofattn.load")
    if isinstance(dims, (str, bytes)) or not hasattr(dims, "__len__"):
        raise UserError(f"dims must be a list of feature dimensions, one per layer ({len(modules)}), "
                        f"got {type(dims).__name__}: e.g. [64] * {len(modules)}")
    dims = list(dims)
    if len(dims) != len(modules):
        raise UserError(f"dims has {len(dims)} entries for a model with {len(modules)} layers: give one per layer")
    if not isinstance(seed, Integral) or isinstance(seed, bool):
        raise UserError(f"seed must be a whole number, got {seed!r}")
    layers = global_layers(model) if layers is None else layers
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise UserError(f"layers must be a list of layer indices, got {type(layers).__name__}")
    layers = list(layers)
    if any(not isinstance(i, Integral) or isinstance(i, bool) for i in layers) or len(set(layers)) != len(layers):
        raise UserError(f"layers must be distinct whole layer indices, got {layers}")
    if any(i < 0 or i >= len(modules) for i in layers):
        raise UserError(f"layers {sorted(layers)} out of range for a model with {len(modules)} layers")
    for i in layers:
        d = dims[i]
        if not isinstance(d, Integral) or isinstance(d, bool) or d < 1:
            raise UserError(f"dims[{i}] must be a whole number of features of at least 1, got {d!r}")
    return modules, sorted(int(i) for i in layers), [int(d) if isinstance(d, Integral) else d for d in dims]


def build(model: nn.Module, spec: StudentSpec) -> nn.Module:
    """Make `model` the (untrained) student `spec` describes, in place: its layers linearized, LoRA adapters added."""
    linearize(model, list(spec.dims), spec.attention, kept=spec.kept, layers=list(spec.layers), seed=spec.seed,
              exact_heads=spec.exact_heads)
    if spec.lora_rank:
        from dofattn.model.lora import add_lora

        add_lora(model, spec.lora_rank, spec.lora_alpha or None, seed=spec.seed, targets=spec.lora_targets)
    return model


# The student's own modules, by their names' parts: a layer's linear attention (its feature map and parts) and LoRA's
# adapters (`lora_A`, `lora_B`). Its tensors are theirs (`is_student_tensor`); an export keeps them in float32.
STUDENT_MODULES = (LINEAR, "lora_")


def is_student_tensor(name: str) -> bool:
    """Whether a parameter/buffer name belongs to the student (`STUDENT_MODULES`: feature maps, parts, LoRA)."""
    parts = name.split(".")
    return LINEAR in parts[:-1] or any(part.startswith("lora_") for part in parts[1:])


def student_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The student's parameters and persistent buffers (and LoRA adapters), by their names in `model`."""
    return {name: t.detach().contiguous() for name, t in model.state_dict().items() if is_student_tensor(name)}


def save_student(model: nn.Module, folder: str | Path, spec: StudentSpec) -> Path:
    """Write `dofattn.json` and `features.safetensors` into `folder` (created if needed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors(student_state(model), folder / WEIGHTS_FILE, metadata={"dofattn_version": __version__})
    write_atomic(folder / CONFIG_FILE, spec.to_json())
    return folder


def read_spec(folder: str | Path) -> StudentSpec:
    """The spec of the student in `folder` (older schemas are converted, or refused with what to do)."""
    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise UserError(f"{folder} is not a complete dofattn student: {name} is missing")
    try:
        return StudentSpec.from_json((folder / CONFIG_FILE).read_text(), where=str(folder / CONFIG_FILE))
    except json.JSONDecodeError as err:
        raise UserError(f"{folder / CONFIG_FILE} is not a dofattn student spec ({err})") from None


def attach_student(model: nn.Module, folder: str | Path, spec: StudentSpec | None = None) -> nn.Module:
    """Make an already loaded base `model` the student in `folder`: linearized as its spec says, features loaded."""
    spec = spec or read_spec(folder)
    found = fingerprint(model)
    expected = spec.base
    mismatch = [k for k in expected if k != "embedding_norm" and expected[k] != found.get(k)]
    norm = expected.get("embedding_norm")
    if norm is not None and abs(found["embedding_norm"] - norm) > 1e-3 * max(abs(norm), 1.0):
        mismatch.append("embedding_norm")
    if mismatch:
        raise UserError(f"{folder} was trained on base model {spec.base_model!r} and does not fit this model "
                        f"(differs in {', '.join(mismatch)}); load it with its own base model")
    build(model, spec)
    load_student_tensors(model, folder)
    return model


def load_student_tensors(model: nn.Module, folder: str | Path) -> None:
    """The student tensors saved in `folder` into `model`, already linearized (and with LoRA) as they were saved;
    a UserError if the names or shapes differ."""
    state, _ = read_safetensors(Path(folder) / WEIGHTS_FILE, device=str(next(model.parameters()).device))
    own = student_state(model)
    state = {_part_name(name, own): tensor for name, tensor in state.items()}
    if set(state) != set(own):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise UserError(f"{folder}/{WEIGHTS_FILE} does not match its config (missing {missing[:3]}, "
                        f"unexpected {extra[:3]})")
    for name, tensor in own.items():
        if tensor.shape != state[name].shape:
            raise UserError(f"{folder}/{WEIGHTS_FILE}: {name} has shape {tuple(state[name].shape)}, "
                            f"expected {tuple(tensor.shape)}")
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name in state:
                tensor.copy_(state[name])
        for name, tensor in model.named_buffers():
            if name in state:
                tensor.copy_(state[name])


def _part_name(name: str, own: dict) -> str:
    """`name` as the layer's parts name it: a layer's own tensor before it moved into its part (folders of schema
    2 and older: `…dofattn.log_gain`) is the one part tensor of that name the model has (`….window.log_gain`)."""
    head, sep, leaf = name.rpartition(".dofattn.")
    if not sep or name in own or "." in leaf:
        return name
    depth = name.count(".") + 1                                          # one name deeper: the part's
    moved = [n for n in own if n.startswith(head + sep) and n.endswith("." + leaf) and n.count(".") == depth]
    return moved[0] if len(moved) == 1 else name


def load_student(folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 merge_lora: bool = False):
    """(model, tokenizer, spec) of the student saved in `folder`; `merge_lora` folds LoRA adapters into the
    weights (faster inference, but the base model, i.e. the teacher, is gone). An export: `exported.load_any`."""
    from dofattn.model.hf import load_model

    spec = read_spec(folder)
    model, tokenizer = load_model(spec.base_model, dtype=dtype, device=device)
    attach_student(model, folder, spec)
    if merge_lora and spec.lora_rank:
        from dofattn.model.lora import merge_lora as merge

        merge(model)
    return model, tokenizer, spec
