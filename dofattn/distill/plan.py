"""The plan of a `dofattn distill` run, from the model's config and the recipe alone: `dofattn distill --dry-run`.

    plan = make_plan(recipe, world_size=8)          # reads config.json only: no weights, no text, no DoF
    print(plan.table())                             # or plan.to_json()

What it says: the layers and their feature dims (the DoF dims exist only after the DoF stage has read the model's
queries and keys, so for `dof`/`clip` the plan gives the budget), the softmax layers kept, the tokens each stage
reads, the size of the teacher cache on disk, and the memory per device of the end-to-end phase.

How the numbers are made:
- Parameters: the model is built from its config on PyTorch's meta device (shapes without memory), so every family's
  biases, norms and tied embeddings count as in the real model. The student's tensors come from building one
  `LinearAttention` of each layer's shape (a few MB on the CPU), LoRA adapters from the projections they adapt.
- The end-to-end phase under FSDP2 (`fully_shard`, one unit per decoder layer and the root): every tensor is split
  along its first dim over the world (each device holds ⌈rows / world⌉ rows; buffers stay whole); frozen weights in
  run.dtype, trained tensors, their gradients and Adam's two moments in float32. While a unit computes, its weights
  are gathered whole, each in its own dtype (`end_to_end.shard`): the root's (embeddings, final norm, head) for the
  whole step, and two decoder layers (the one running and the next, prefetched). The teacher is the same model
  with its linear parts off: no second copy. With one process nothing is sharded or gathered.
- Activations are what autograd keeps for the backward pass of one step: `batch_size` blocks of `seq_len` tokens.
  Per layer, from the family's code: each RMSNorm keeps a float32 copy of its input and the inverse norm (4h + 4
  bytes per token, whatever the dtype); a gated MLP its gate, activation and up projection (3 × intermediate); frozen
  projections keep nothing (their weight is all their backward needs); a kept softmax layer its q, k, v, output and
  log-sum-exp (SDPA; eager, for soft-capped logits, its [T, T] weights). The linear attention itself is measured,
  not modelled: one layer of the student's shape runs on random q/k/v of `PROBE_TOKENS` tokens with autograd, and
  what it keeps is counted per token (`attention_probe`). Layers before the first one with a trained tensor keep
  nothing. With activation checkpointing each layer keeps its input, and the backward pass holds one layer's
  activations at a time.
- The loss (`end_to_end.loss`): the LM head runs on `loss_chunk` positions at a time; at its peak, inside the KL
  term, the phase holds five float32 [batch, chunk, vocab] arrays (the student's and the teacher's
  log-probabilities, the teacher's probabilities, their difference and its product; three without the KL term:
  log-probabilities and two gradients) and the teacher's last hidden states.
`tests/test_plan.py` measures one end-to-end step of a small student on the CPU and compares, with `LiveBytes`
(every storage the step makes, followed while alive), as `benchmarks/plan_memory.py` does.
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dofattn.dof import spans
from dofattn.errors import UserError
from dofattn.recipe import Recipe

PROBE_TOKENS = 64         # tokens of the attention probe, at least two windows (fewer when the blocks are shorter)
GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
RMS_NORMS = {"llama": 2, "mistral": 2, "qwen2": 2, "qwen3": 2, "phi3": 2, "olmo2": 2, "gemma2": 4, "gemma3_text": 4}
QK_NORMS = ("qwen3", "olmo2", "gemma3_text")            # an RMSNorm on q and k of every head (OLMo-2: of the whole q)
POST_NORM_ONLY = ("olmo2",)                              # no norm before the attention: its norms follow each block
FUSED_QKV = ("phi3", "gpt2", "gpt_neox")               # q, k, v one projection: a kept v keeps q's and k's rows too
GATED_MLP = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma2", "gemma3_text")


# --- the model, from its config --------------------------------------------------------------------------------------

def model_config(spec: str):
    """The config of the model `spec` names (alias, folder, .gguf file or hub id), read as `hf.load_model` reads it
    and refused the same way, without its weights."""
    from transformers import AutoConfig

    from dofattn import hf

    if spec in hf.BUILTIN:
        folder = hf.cache_dir() / "models" / spec
        if (folder / "config.json").is_file():
            config = AutoConfig.from_pretrained(folder)
        else:                                          # not converted yet: the GGUF file's header holds the config
            gguf = hf.wheel_member(hf.BUILTIN[spec].wheel, hf.BUILTIN[spec].member)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        path = Path(spec).expanduser()
        if spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or path.exists():
            if not path.exists():
                raise UserError(f"model path {spec} does not exist; give a folder with config.json, a .gguf file, "
                                f"a hub id, or one of: {', '.join(hf.BUILTIN)}")
            if path.is_file():
                if path.suffix != ".gguf":
                    raise UserError(f"model file {spec} is not a .gguf file; give a .gguf file or a model folder")
                config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            elif not (path / "config.json").is_file():
                raise UserError(f"model folder {spec} has no config.json; give a Hugging Face model folder")
            else:
                config = hf._load_config(path, spec)
        else:
            config = hf._load_config(spec, spec)
    hf.check_supported(config, spec)
    return config


def meta_model(config, dtype: torch.dtype = torch.float32):
    """The model of `config` on the meta device: every parameter's shape, no memory, no weights read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# --- pieces of the plan ----------------------------------------------------------------------------------------------

@dataclass
class Layers:
    count: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    linear: list[int]                 # linearized, if the K chosen softmax layers are the last candidates
    local: list[int]                  # the model's own sliding-window layers kept exact
    keep_softmax: int                 # K layers kept by keep_softmax_by, chosen at run time
    keep_softmax_by: str
    dims_rule: str
    dims: list[int] | None            # per layer when known before the run (fix, fix:C, a dof.json)
    mean_dim: float                   # of the linearized layers (the budget's mean for dof / clip)


@dataclass
class Tokens:
    dof_sample: int
    softmax_choice: int
    layerwise_teacher: int
    layerwise_training: int           # per linearized layer
    end_to_end: int
    end_to_end_data: int
    eval: int


@dataclass
class Memory:
    """Bytes per device in the end-to-end phase."""

    world_size: int
    dtype: str
    batch_size: int                   # blocks per step in each process
    seq_len: int
    loss_chunk: int
    checkpointing: bool
    weights: int                      # frozen base weights, this device's shard
    student: int                      # the student's tensors (trained and not), float32
    gradients: int
    adam: int
    gathered: int                     # weights gathered whole while their unit computes (FSDP2, world > 1)
    activations: int                  # kept by autograd for the backward pass (checkpointing: each layer's input)
    recompute: int                    # checkpointing: one layer's activations, made again in the backward pass
    loss: int                         # the LM head's logits of one chunk and their gradients, the teacher's states
    whole_model: int                  # the model in run.dtype, as every process holds it before the phase

    @property
    def total(self) -> int:
        """The peak: what stays, and the larger of the loss's arrays and a layer run again (never at once: the
        backward pass is through the loss before it reaches the layers)."""
        return (self.weights + self.student + self.gradients + self.adam + self.gathered + self.activations
                + max(self.loss, self.recompute))


@dataclass
class Plan:
    recipe: str
    model: str
    model_type: str
    parameters: int                   # of the base model
    student_parameters: int           # trained
    layers: Layers
    tokens: Tokens
    teacher_cache: int                # bytes on disk (0: no layerwise stage)
    memory: Memory
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        out["memory"]["total"] = self.memory.total
        return out

    def table(self) -> str:
        return format_plan(self)


def _shard(shape: tuple[int, ...], world: int) -> int:
    """Elements of one device's shard of a tensor FSDP2 splits along dim 0 over `world` devices (padded)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def layer_roles(recipe: Recipe, model) -> tuple[list[int], list[int]]:
    """(linearized layers, the model's own sliding-window layers kept exact), as `distill.run` chooses them; the K
    softmax layers picked at run time are taken as the last of those that may be linearized."""
    from dofattn.hf import local_layers
    from dofattn.student import attention_modules, global_layers

    s = recipe.student
    keep_local = s.local_layers == "keep"
    candidates = global_layers(model) if keep_local else list(range(len(attention_modules(model))))
    if s.keep_softmax >= len(candidates):
        raise UserError(f"student.keep_softmax = {s.keep_softmax} leaves no layer to linearize: the model has "
                        f"{len(candidates)} layers that may be linearized")
    return candidates[:len(candidates) - s.keep_softmax], local_layers(model.config) if keep_local else []


def plan_dims(recipe: Recipe, model, head_dim: int, linear: list[int]) -> tuple[list[int] | None, float]:
    """(dims per layer when the recipe fixes them, else None; their mean over the linearized layers)."""
    from dofattn.student import resolve_dims

    rule = recipe.student.dims
    if rule in ("dof", "clip"):      # mean = head size over all layers (Algorithm 1's budget); clip only lowers it
        return None, float(head_dim)
    dims = resolve_dims(rule, model, recipe.run.model)
    return dims, sum(dims[i] for i in linear) / len(linear)


def plan_tokens(recipe: Recipe, config, world: int) -> Tokens:
    from dofattn.distill.choose import (ATTENTION_DOF_BLOCKS, ATTENTION_DOF_SEQ_LEN, DOF_BLOCKS, DOF_SEQ_LEN)
    from dofattn.hf import context_length
    from dofattn.recall import COPY_BLOCKS, COPY_SEQ_LEN

    s, lw, e2e = recipe.student, recipe.layerwise, recipe.end_to_end
    dof = DOF_BLOCKS * DOF_SEQ_LEN if s.dims in ("dof", "clip") else 0
    choice = 0
    if s.keep_softmax and s.keep_softmax_by == "copy":
        context = context_length(config)                  # as choose.softmax_layers sizes the copy probe
        choice = COPY_BLOCKS * (min(COPY_SEQ_LEN, context) if context else COPY_SEQ_LEN)
    elif s.keep_softmax:
        choice = ATTENTION_DOF_BLOCKS * min(recipe.eval.seq_len, ATTENTION_DOF_SEQ_LEN)
    return Tokens(dof_sample=dof, softmax_choice=choice,
                  layerwise_teacher=lw.blocks * lw.seq_len if lw.steps else 0,
                  layerwise_training=lw.steps * lw.batch_size * lw.seq_len,
                  end_to_end=e2e.steps * e2e.batch_size * world * e2e.seq_len,
                  end_to_end_data=recipe.end_to_end_blocks * e2e.seq_len if e2e.steps else 0,
                  eval=recipe.eval.blocks * recipe.eval.seq_len)


def teacher_cache_bytes(recipe: Recipe, count: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """`distill.teacher.TeacherCache` on disk: per layer (every one) a float32 [blocks, seq_len, H + 2·Hkv, D]."""
    lw = recipe.layerwise
    return count * lw.blocks * lw.seq_len * (heads + 2 * kv_heads) * head_dim * 4 if lw.steps else 0


def linear_layer(recipe: Recipe, heads: int, kv_heads: int, head_dim: int, dim: int) -> torch.nn.Module:
    """One `LinearAttention` of the student's shape (CPU, float32, as `student.linearize` makes it)."""
    from dofattn.attention import LinearAttention
    from dofattn.features import make_feature_map

    s = recipe.student
    fmap = make_feature_map(s.feature, heads, head_dim, dim, head_dim ** -0.5, seed=0)
    return LinearAttention(fmap, heads, kv_heads, s.window, s.decay == "head", s.sink, s.decay == "gate", head_dim,
                           s.conv, s.delta)


def lora_shapes(recipe: Recipe, model) -> list[tuple[int, ...]]:
    """The shapes of the LoRA adapters `lora.add_lora` gives `model` (A [r, in] and B [out, r] per projection)."""
    from dofattn import lora

    s = recipe.student
    if not s.lora_rank:
        return []
    patterns = [lora.TARGETS[model.config.model_type]]
    if s.lora_targets == "all":
        patterns.append(lora.MLP_TARGETS[model.config.model_type])
    shapes = []
    for name, module in model.named_modules():
        if any(re.fullmatch(p, name) for p in patterns):
            w = module.weight                          # nn.Linear [out, in]; GPT-2's Conv1D [in, out]
            fan_in, fan_out = (w.shape[1], w.shape[0]) if isinstance(module, torch.nn.Linear) else tuple(w.shape)
            shapes += [(s.lora_rank, fan_in), (fan_out, s.lora_rank)]
    return shapes


def attention_probe(layer: torch.nn.Module, batch: int, tokens: int, dtype: torch.dtype,
                    inputs_need_grad: bool) -> int:
    """Bytes autograd keeps for the backward pass of `layer` (a `LinearAttention`, training mode) on random q, k, v
    [batch, tokens, heads, D] in `dtype`: every tensor saved for backward that is still alive after the forward,
    each storage once, the layer's own parameters and buffers not counted."""
    heads, kv_heads = layer.num_heads, layer.num_kv_heads
    D = layer.feature_map.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, tokens, h, D, generator=gen).to(dtype).requires_grad_(inputs_need_grad)
               for h in (heads, kv_heads, kv_heads))
    layer.train()
    with saved_tensors() as saved:
        out = layer(q, k, v)
        kept = saved.bytes(exclude=[*layer.parameters(), *layer.buffers()])
    del out
    return kept


class LiveBytes(TorchDispatchMode):
    """While active: bytes of the storages made by operators since it began and still alive (`now`), and their most
    (`peak`). Storages that exist before (`existing`: weights, inputs) never count, even through views."""

    def __init__(self, existing):
        super().__init__()
        self.now = self.peak = 0
        self.seen = {t.untyped_storage().data_ptr() for t in existing}

    def _free(self, key, size):
        self.seen.discard(key)
        self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


class saved_tensors:
    """While active, records every tensor autograd saves for the backward pass; `bytes()` is what is still kept:
    each storage once, those of `exclude` (parameters, say) left out. Tensors of a graph already freed don't count."""

    def __enter__(self):
        self.packed = []

        def pack(t):
            s = t.untyped_storage()
            self.packed.append((weakref.ref(t), s.data_ptr(), s.nbytes()))
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def bytes(self, exclude=()) -> int:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        alive = {ptr: n for ref, ptr, n in self.packed if ref() is not None and ptr not in skip}
        return sum(alive.values())


def activation_bytes(recipe: Recipe, layers: Layers, config, linear_probe: tuple[int, int], tokens: int,
                     e: int, lora: bool) -> tuple[int, int]:
    """(bytes autograd keeps over one step's forward pass but the loss's own, bytes of the layer run again in the
    backward pass under activation checkpointing (else 0)): see the module docstring.
    `linear_probe`: bytes per position of the batch's blocks, of a linear layer whose q/k/v need gradients and of
    one whose don't."""
    kind, h, I = config.model_type, layers.hidden, layers.intermediate
    H, Hkv, D = layers.heads, layers.kv_heads, layers.head_dim
    norm = 4 * h + 4 if kind in RMS_NORMS else e * h + 8        # RMSNorm: float32 copy + 1/rms; LayerNorm: x, μ, σ
    norms = RMS_NORMS.get(kind, 2)
    qk_norm = 0
    if kind in QK_NORMS:                                         # float32 copies and 1/rms, per head or per row
        qk_norm = 4 * (H + Hkv) * D + (8 if kind == "olmo2" else 4 * (H + Hkv))
    if kind in GATED_MLP:
        mlp = 3 * I * e                                          # gate, act(gate), up
    elif getattr(config, "activation_function", "") == "gelu_new":
        mlp = 4 * I * e                                          # GPT-2's tanh GELU, written out in PyTorch ops
    else:
        mlp = I * e                                              # one activation function: its input
    T, eager = tokens, bool(getattr(config, "attn_logit_softcapping", None))
    if eager:                                                    # eager: q, k and v on every head, the capped
        sliding = global_ = 3 * H * D * e + H * T * (e + 4 + (e if e != 4 else 0))   # logits, the float32 softmax
    else:                                                        # SDPA: q, k, v, out, log-sum-exp; a mask (sliding
        global_ = (2 * H * D + 2 * Hkv * D) * e + 4 * H          # window) makes HF repeat k and v for every head
        sliding = 4 * H * D * e + 4 * H
    local = set(layers.local)
    fused = (H + Hkv) * D * e if kind in FUSED_QKV else 0        # the fused projection's q and k rows beside v
    adapters = 0
    if lora:                       # each adapter keeps its float32 input (a copy unless the model is float32) and A·x
        r = recipe.student.lora_rank
        shared = 4 * h if e == 4 else 3 * 4 * h                  # q, k, v read the same normed input
        adapters = shared + 4 * H * D + 4 * r * 4
        if recipe.student.lora_targets == "all":
            adapters += (4 * h if e == 4 else 2 * 4 * h) + 4 * I + 3 * 4 * r
    first = 0 if lora else min(layers.linear)
    linear, batch = set(layers.linear), recipe.end_to_end.batch_size
    per_layer = []                                               # bytes per position of the batch's blocks
    for i in range(layers.count):
        if i < first:
            per_layer.append(0)                                  # nothing before it needs a gradient
            continue
        later = i > first                                        # its input needs a gradient
        qkv = later or lora                                      # its q, k, v do (LoRA: in every layer)
        if i in linear:
            attention = linear_probe[0] + batch * fused if qkv else linear_probe[1]
        else:
            attention = batch * (sliding if i in local else global_) if qkv else 0
        before = 0 if kind in POST_NORM_ONLY else 1              # norms whose input needs no gradient in the first
        own = norm * (norms - (0 if later else before)) + qk_norm * qkv + mlp + adapters
        per_layer.append(batch * own + attention)
    rope = 2 * D * e if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None) else 0
    if kind == "gemma3_text":
        rope *= 2                                                # its local and global layers rotate differently
    masks = T * e if local and not eager else 0                  # SDPA's [B, 1, T, T] sliding-window mask, once
    top = batch * (norm + masks) + rope                          # the final norm; a mask and cos, sin once
    if recipe.end_to_end.activation_checkpointing:               # each layer's input; one layer again in backward
        return round(T * (batch * (layers.count - first) * h * e + top)), round(T * max(per_layer))
    return round(T * (sum(per_layer) + top)), 0


def loss_bytes(recipe: Recipe, layers: Layers, e: int) -> int:
    """The loss's peak beyond the body's activations (module docstring): float32 [B, chunk, V] arrays and, with the
    KL term, the teacher's last hidden states."""
    e2e = recipe.end_to_end
    positions = e2e.seq_len - 1
    chunk = min(e2e.loss_chunk or positions, positions)
    arrays = 5 if e2e.kd_weight > 0 else 3      # KL: log p, log q, exp(log q), their difference, its product
    teacher = e2e.batch_size * positions * layers.hidden * e if e2e.kd_weight > 0 else 0
    return arrays * e2e.batch_size * chunk * layers.vocab * 4 + teacher + e2e.batch_size * positions * 8


def make_plan(recipe: Recipe, world_size: int = 1, config=None) -> Plan:
    """The plan of `recipe` at `world_size` processes; `config` (a transformers config) instead of reading
    run.model's."""
    from dofattn.student import attention_modules, head_layout

    if world_size < 1:
        raise UserError(f"world size {world_size}: give >= 1 processes")
    config = config if config is not None else model_config(recipe.run.model)
    run_dtype = recipe.run.dtype
    e, dtype = DTYPE_BYTES[run_dtype], getattr(torch, run_dtype)
    model = meta_model(config, dtype)
    count = len(attention_modules(model))
    heads, kv_heads, head_dim = head_layout(model)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hidden = model.get_input_embeddings().weight.shape[1]
    vocab = model.get_input_embeddings().weight.shape[0]
    intermediate = (getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden)
    linear, local = layer_roles(recipe, model)
    dims, mean_dim = plan_dims(recipe, model, head_dim, linear)
    s, e2e = recipe.student, recipe.end_to_end
    layers = Layers(count=count, heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
                    intermediate=intermediate, vocab=vocab, linear=linear, local=local, keep_softmax=s.keep_softmax,
                    keep_softmax_by=s.keep_softmax_by, dims_rule=s.dims, dims=dims, mean_dim=mean_dim)

    # the student's tensors, per linearized layer (a dof/clip layer at the budget's mean: every tensor and every
    # per-token activation is linear in the dim, so the sum over layers is the same)
    builds = {}
    trained, fixed = [], []          # shapes
    for i in linear:
        dim = dims[i] if dims else round(mean_dim)
        if dim not in builds:
            builds[dim] = linear_layer(recipe, heads, kv_heads, head_dim, dim)
        module = builds[dim]
        trained += [tuple(p.shape) for p in module.parameters() if p.requires_grad]
        fixed += [tuple(b.shape) for n, b in module.named_buffers() if n in module.state_dict()]
    trained += lora_shapes(recipe, model)
    W = world_size
    weights = sum(_shard(tuple(p.shape), W) for p in model.parameters()) * e
    trained_elements = sum(_shard(shape, W) for shape in trained)
    student = (trained_elements + sum(math.prod(shape) for shape in fixed)) * 4     # FSDP leaves buffers whole
    gathered = 0
    if W > 1:                        # the root unit for the whole step, two decoder layers at a time
        from dofattn.distill.end_to_end import decoder_layers

        body = decoder_layers(model)
        in_layers = {id(p) for m in body for p in m.parameters()}
        root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
        largest = max(sum(p.numel() for p in m.parameters()) for m in body)
        student_layer = sum(math.prod(shape) for shape in trained) // len(linear)
        gathered = (root + 2 * largest) * e + 2 * student_layer * 4

    tokens_per_block = e2e.seq_len
    probe_len = min(max(PROBE_TOKENS, 2 * s.window), tokens_per_block)
    probe = (0, 0)
    if e2e.steps:                    # at the mean dim: what a layer keeps is linear in it
        one = builds.get(round(mean_dim)) or linear_layer(recipe, heads, kv_heads, head_dim, round(mean_dim))
        probe = []                   # per position: a part per sequence of the batch, and a part they share
        for grad in (True, False):
            single, double = (attention_probe(one, b, probe_len, dtype, grad) / probe_len for b in (1, 2))
            probe.append((double - single) * e2e.batch_size + (2 * single - double))
    activations, recompute = (activation_bytes(recipe, layers, config, probe, tokens_per_block, e, bool(s.lora_rank))
                              if e2e.steps else (0, 0))
    phase = int(e2e.steps > 0)        # no end-to-end phase: nothing trains at once, nothing is sharded
    memory = Memory(world_size=W, dtype=run_dtype, batch_size=e2e.batch_size, seq_len=e2e.seq_len,
                    loss_chunk=min(e2e.loss_chunk or e2e.seq_len - 1, e2e.seq_len - 1),
                    checkpointing=e2e.activation_checkpointing, weights=weights, student=student,
                    gradients=trained_elements * 4 * phase, adam=(trained_elements * 8 + len(trained) * 4) * phase,
                    gathered=gathered * phase, activations=activations, recompute=recompute,
                    loss=loss_bytes(recipe, layers, e) * phase,
                    whole_model=sum(p.numel() for p in model.parameters()) * e)
    notes = []
    if s.dims in ("dof", "clip"):
        notes.append("feature dims come from the DoF stage at run time; the student's size is at the budget's mean"
                     + (" (clip can only lower it)" if s.dims == "clip" else ""))
    if s.keep_softmax:
        notes.append(f"the {s.keep_softmax} softmax layers are chosen at run time (by {s.keep_softmax_by}); the "
                     f"plan takes them as the last layers")
    return Plan(recipe=recipe.name, model=recipe.run.model, model_type=config.model_type,
                parameters=sum(p.numel() for p in model.parameters()),
                student_parameters=sum(math.prod(shape) for shape in trained), layers=layers,
                tokens=plan_tokens(recipe, config, W),
                teacher_cache=teacher_cache_bytes(recipe, count, heads, kv_heads, head_dim), memory=memory,
                notes=notes)


# --- printing --------------------------------------------------------------------------------------------------------

def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def format_plan(plan: Plan) -> str:
    L, t, m, r = plan.layers, plan.tokens, plan.memory, plan.recipe
    rows = [f"plan of recipe {r} on {plan.model} ({plan.model_type}, {_count(plan.parameters)} parameters); "
            f"nothing loaded, nothing written", ""]
    rows.append(f"layers          {L.count}: {L.heads} query heads, {L.kv_heads} key/value heads of {L.head_dim}; "
                f"hidden {L.hidden}, MLP {L.intermediate}, vocabulary {L.vocab}")
    rows.append(f"  linearized    {len(L.linear)}: {spans(L.linear) or 'none'}")
    if L.dims is not None:
        shown = sorted(set(L.dims[i] for i in L.linear))
        dims = (f"{shown[0]} in every layer" if len(shown) == 1 else
                "per layer " + " ".join(str(L.dims[i]) for i in L.linear)) + f" ({L.dims_rule})"
    else:
        dims = (f"from the DoF stage at run time ({L.dims_rule}): budget {round(L.mean_dim) * L.count} features, "
                f"mean {L.mean_dim:g} per layer (the head size)")
    rows.append(f"  feature dims  {dims}")
    kept = []
    if L.local:
        kept.append(f"{len(L.local)} sliding-window layers of the model ({spans(L.local)})")
    if L.keep_softmax:
        kept.append(f"{L.keep_softmax} chosen at run time by {L.keep_softmax_by} (student.keep_softmax)")
    rows.append(f"  softmax kept  {'; '.join(kept) or 'none'}")
    rows.append(f"  student       {_count(plan.student_parameters)} trained parameters")
    rows.append("")
    rows.append("tokens")
    if t.dof_sample:
        rows.append(f"  DoF sample    {t.dof_sample:,} (queries and keys of the teacher)")
    if t.softmax_choice:
        rows.append(f"  softmax pick  {t.softmax_choice:,}")
    if t.layerwise_teacher:
        rows.append(f"  layerwise     {t.layerwise_teacher:,} through the teacher; {t.layerwise_training:,} per layer "
                    f"in training")
    if t.end_to_end:
        rows.append(f"  end-to-end    {t.end_to_end:,} in training ({m.world_size} "
                    f"process{'es' if m.world_size > 1 else ''}), drawn from "
                    f"{t.end_to_end_data:,}")
    rows.append(f"  evaluation    {t.eval:,}")
    rows.append("")
    rows.append(f"teacher cache   {_size(plan.teacher_cache) if plan.teacher_cache else 'none'} on disk "
                f"(float32 q/k/v of every layer; deleted at the end)")
    rows.append("")
    if not t.end_to_end:
        rows.append(f"memory per device: no end-to-end phase; each process holds the whole model, "
                    f"{_size(m.whole_model)} ({m.dtype})")
        rows += [f"note: {note}" for note in plan.notes]
        return "\n".join(rows)
    how = (f"FSDP2 over {m.world_size} devices" if m.world_size > 1 else "1 process, nothing sharded")
    rows.append(f"memory per device, end-to-end: {how}, {m.dtype}")
    chunks = (f"logits in chunks of {m.loss_chunk} positions" if m.loss_chunk < m.seq_len - 1 else
              "logits of a whole block at once")
    rows.append(f"  ({m.batch_size} x {m.seq_len} tokens a step, {chunks}"
                f"{', layers checkpointed' if m.checkpointing else ''})")
    for label, value in (("frozen weights", m.weights), ("student tensors", m.student), ("gradients", m.gradients),
                         ("Adam moments", m.adam), ("gathered weights", m.gathered), ("activations", m.activations),
                         ("one layer again", m.recompute), ("loss (logits)", m.loss)):
        if value or label in ("frozen weights", "activations"):
            rows.append(f"  {label:<16}{_size(value):>12}")
    rows.append(f"  {'total':<16}{_size(m.total):>12}" + ("   (the larger of the loss and the layer run again: "
                                                          "never at once)" if m.recompute else ""))
    rows.append(f"  (before it, every process holds the whole model: {_size(m.whole_model)})")
    for note in plan.notes:
        rows.append(f"note: {note}")
    return "\n".join(rows)
