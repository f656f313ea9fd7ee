"""The plan of a `dofattn distill` run, from the model's config and the recipe alone: `dofattn distill --dry-run`.

    plan = make_plan(recipe, world_size=8)          # reads config.json only: no weights, no text, no DoF
    print(plan.table())                             # or plan.to_json()

What it says: the layers and their feature dims (the DoF dims exist only after the DoF stage has read the model's
queries and keys, so for `dof`/`clip` the plan gives the budget), the softmax layers kept, the tokens each stage
reads, what the layerwise stage holds of the teacher, and the memory per device of the end-to-end phase.

How the numbers are made:
- The student is built as a run builds it, without memory: the model from its config on PyTorch's meta device, made
  the student by `student.build` (the layers `linear_layers` linearizes; the K softmax layers picked at run
  time taken as the last candidates; a dof/clip layer at the budget's mean, the head size: every student tensor and
  every per-token activation is linear in the dim, so the sum over layers is the same). Parameters, the student's
  tensors and their LoRA adapters are that model's, every family's biases, norms and tied embeddings included.
- The end-to-end phase under FSDP2 (`fully_shard`, one unit per decoder layer and the root): every tensor is split
  along its first dim over the world (each device holds ⌈rows / world⌉ rows; buffers stay whole); frozen weights in
  run.dtype, trained tensors, their gradients and Adam's two moments in their own dtype (float32). While a unit
  computes, its weights are gathered whole, each in its own dtype (`end_to_end.shard`): the root's (embeddings,
  final norm, head) for the whole step, and two decoder layers (the one running and the next, prefetched). The
  teacher is the same model with its linear parts off: no second copy. With one process nothing is sharded.
- Activations and the loss are measured, not modelled: the student's tensors become fake ones (FakeTensorMode:
  shapes, dtypes and storages, no memory, no arithmetic) and one step of the end-to-end loss (`end_to_end.loss`:
  teacher and student, the LM head on `loss_chunk` positions at a time, layers checkpointed if the recipe says so)
  and its backward pass run on `batch_size` blocks of `seq_len` tokens on the CPU, with `memory.LiveBytes` following
  every storage (`measure_step`). What the student's body leaves alive is the activations; the most alive beyond
  them while the loss runs forward and back is the loss, and while the backward pass goes through the layers (one
  layer again under checkpointing, and the gradients flowing back) the backward row. The token ids and the small
  tensors made of them alone (positions, masks) stay real (`memory.RealConstants`), so that code reading their
  values runs as in a real step. The kernels are the CPU's: the linear attention's PyTorch path, SDPA's (eager for
  soft-capped logits) for the softmax layers; on a GPU, where the linear op runs in Triton, it is unchecked.
`tests/test_plan.py` compares with one real end-to-end step of small students on the CPU, measured the same way, as
`benchmarks/plan_memory.py` does at a model's own widths.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field

import torch

from dofattn.distill.costs import fake_model, meta_model
from dofattn.dof import spans
from dofattn.errors import UserError
from dofattn.kept import kept
from dofattn.memory import available_memory
from dofattn.recipe import DOF_DIMS, Recipe

GIB = 1024 ** 3


@dataclass
class Step:
    """Bytes one end-to-end step adds beside the weights, the student's tensors and their gradients."""

    activations: int       # what the student's body leaves alive for the backward pass (its output included)
    loss: int              # the most beyond them while the loss runs forward and back (the teacher's states, logits)
    backward: int          # the most beyond them while the backward pass goes through the layers
    flops: int = 0         # of the step (FlopCounterMode: matrix products and attention)


def measure_step(recipe: Recipe, model, reference_flops: bool = False) -> Step:
    """One step of the end-to-end loss and its backward pass on `model` (the student on the meta device, its
    tensors made fake here: it is spent after), at the recipe's batch, length, loss chunk and checkpointing: its
    memory and its FLOPs (`memory.Flops`). `reference_flops`: the FLOPs by torch's FlopCounterMode instead (the
    test's reference; it follows the modules and holds what their backward hooks hold, so the memory is not the
    step's then)."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    from torch.utils.flop_counter import FlopCounterMode

    from dofattn.distill.end_to_end import layers_checkpointed, loss
    from dofattn.memory import Flops, LiveBytes, RealConstants
    from dofattn.model.student import is_student_tensor, linear_parts

    e2e = recipe.end_to_end
    mode = FakeTensorMode()
    fake_model(model, mode)
    for name, p in model.named_parameters():             # as run.py: only the student's tensors train
        p.requires_grad_(is_student_tensor(name))
    for linear in linear_parts(model).values():          # and end_to_end.train: its linear layers in training mode
        linear.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    ids = torch.zeros(e2e.batch_size, e2e.seq_len, dtype=torch.long)
    with mode:
        for p in trained:                                 # the gradients are counted apart: made before
            p.grad = torch.zeros_like(p)
    live = LiveBytes([*model.parameters(), *model.buffers(), *(p.grad for p in trained), ids])
    marks = {}

    def body_grad(grad):                                   # the loss's backward pass is through
        marks["loss"] = live.reset_peak()

    def before(module, args, kwargs):
        if torch.is_grad_enabled():                        # the student's body (the teacher's runs without autograd)
            marks["start"] = live.now

    def after(module, args, kwargs, output):
        if torch.is_grad_enabled():
            marks["end"] = live.now
            if output.last_hidden_state.requires_grad:
                output.last_hidden_state.register_hook(body_grad)

    body = model.base_model
    hooks = [body.register_forward_pre_hook(before, with_kwargs=True),
             body.register_forward_hook(after, with_kwargs=True)]
    counter = FlopCounterMode(display=False) if reference_flops else Flops()
    try:
        with (mode, RealConstants(mode, live), layers_checkpointed(model) if e2e.activation_checkpointing else
              contextlib.nullcontext(), live, counter):
            value = loss(model, ids, e2e.kd_weight, e2e.loss_chunk)
            if value.requires_grad:          # nothing to train (a Performer student): the run skips the phase
                value.backward()
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        raise UserError(f"the plan cannot measure an end-to-end step of {e2e.batch_size} x {e2e.seq_len} tokens: "
                        f"{err.func} needs the values of a tensor too large to make for real on the CPU (over "
                        f"{RealConstants.LIMIT >> 20} MiB); plan a shorter end_to_end.seq_len") from None
    finally:
        for hook in hooks:
            hook.remove()
    activations = marks["end"] - marks["start"]
    return Step(activations=activations, loss=marks.get("loss", live.peak) - activations,
                backward=max(0, live.peak - activations) if "loss" in marks else 0,
                flops=counter.get_total_flops() if reference_flops else counter.total)


# --- pieces of the plan -----------------------------------------------------------------------------------------------

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
    activations: int                  # the body's, kept for the backward pass (checkpointing: each layer's input)
    recompute: int                    # the backward pass through the layers beyond them (checkpointing: one layer
                                      # again), measured
    loss: int                         # the loss's beyond them: a chunk's logits, their gradients, the teacher's states
    whole_model: int                  # the model in run.dtype, as every process holds it before the phase

    @property
    def total(self) -> int:
        """The peak: what stays, and the larger of the loss's arrays and the layers' backward pass (never at once:
        the backward pass is through the loss before it reaches the layers)."""
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
    layerwise: int                    # bytes the teacher's stream holds in the layerwise stage (0: none)
    memory: Memory
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # figures absurd for the data or the machine (`warn`)
    end_to_end_flops: int = 0                        # of one end-to-end step (FlopCounterMode)
    stages: list = field(default_factory=list)       # `costs.StageCost` per stage on this machine (with a calibration)
    calibration: object = None                       # `costs.Calibration`: how this machine was measured

    @property
    def peak(self) -> int:
        """The run's peak resident memory (the largest stage's process peak), 0 without stages."""
        return max((s.peak for s in self.stages), default=0)

    @property
    def disk(self) -> int:
        return sum(s.disk for s in self.stages)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    def to_json(self) -> dict:
        out = asdict(self)
        out["memory"]["total"] = self.memory.total
        if self.stages:
            out["peak"], out["disk"], out["seconds"] = self.peak, self.disk, self.seconds
        return out

    def table(self) -> str:
        return format_plan(self)


def _shard(shape: tuple[int, ...], world: int) -> int:
    """Elements of one device's shard of a tensor FSDP2 splits along dim 0 over `world` devices (padded)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def plan_dims(recipe: Recipe, model, head_dim: int, linear: list[int]) -> tuple[list[int] | None, float]:
    """(dims per layer when the recipe fixes them, else None; their mean over the linearized layers)."""
    from dofattn.distill.choose import resolve_dims

    rule = recipe.student.dims
    if rule in DOF_DIMS:      # mean = head size over all layers (Algorithm 1's budget); clip only lowers it
        return None, float(head_dim)
    dims = resolve_dims(rule, model, recipe.run.model, "student.dims")
    return dims, sum(dims[i] for i in linear) / len(linear) if linear else float(head_dim)


def plan_tokens(recipe: Recipe, config, world: int) -> Tokens:
    from dofattn.distill.choose import ATTENTION_DOF_BLOCKS, ATTENTION_DOF_SEQ_LEN, COPY_BLOCKS, COPY_SEQ_LEN
    from dofattn.recipe import DOF_BLOCKS, DOF_SEQ_LEN
    from dofattn.model.hf import context_length

    s, lw, e2e = recipe.student, recipe.layerwise, recipe.end_to_end
    dof = DOF_BLOCKS * DOF_SEQ_LEN if s.dims in DOF_DIMS else 0
    choice = 0
    context = context_length(config)                      # as choose sizes the copy probe
    if s.keep_softmax_by == "copy" and s.keep_softmax or s.exact_heads:
        choice = COPY_BLOCKS * (min(COPY_SEQ_LEN, context) if context else COPY_SEQ_LEN)
    elif s.keep_softmax:
        choice = ATTENTION_DOF_BLOCKS * min(recipe.eval.seq_len, ATTENTION_DOF_SEQ_LEN)
    return Tokens(dof_sample=dof, softmax_choice=choice,
                  layerwise_teacher=lw.blocks * lw.seq_len if lw.steps else 0,
                  layerwise_training=lw.steps * lw.batch_size * lw.seq_len,
                  end_to_end=e2e.steps * e2e.batch_size * world * e2e.seq_len,
                  end_to_end_data=recipe.end_to_end_blocks * e2e.seq_len if e2e.steps else 0,
                  eval=recipe.eval.blocks * recipe.eval.seq_len)


def layerwise_bytes(recipe: Recipe, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """What `distill.teacher.TeacherStream` holds while a layer trains: the blocks' hidden states [blocks, seq_len,
    hidden] in run.dtype, and that layer's q/k/v [blocks, seq_len, H + 2·Hkv, D] in float32. Nothing on disk."""
    lw = recipe.layerwise
    if not lw.steps:
        return 0
    tokens = lw.blocks * lw.seq_len
    return tokens * hidden * getattr(torch, recipe.run.dtype).itemsize + tokens * (heads + 2 * kv_heads) * head_dim * 4


def make_plan(recipe: Recipe, world_size: int = 1, config=None, device: str | None = None,
              timed: bool = True, recalibrate: bool = False) -> Plan:
    """The plan of `recipe` at `world_size` processes; `config` (a transformers config) instead of reading
    run.model's. With a `device`, each stage's peak memory, disk and time there (`costs`: this machine measured for
    a second or two, and the layerwise step timed); `timed` False: memory and disk alone (no time is measured).
    What it counts and times is kept (`dofattn.kept`): a second plan of the same recipe and model reads it;
    `recalibrate` times the machine again."""
    from dofattn.distill.end_to_end import loss_positions
    from dofattn.model.hf import decoder_layers
    from dofattn.model.hf import local_layers, model_config
    from dofattn.memory import resident_now
    from dofattn.recipe import resolve_dtype
    from dofattn.distill.choose import linear_layers, stand_in_exact_heads
    from dofattn.model.student import attention_modules, build, head_layout, is_student_tensor

    before = resident_now()                     # this process before any model: Python, torch, transformers
    recipe = resolve_dtype(recipe, device or "cpu")
    if world_size < 1:
        raise UserError(f"world size {world_size}: give >= 1 processes")
    config = config if config is not None else model_config(recipe.run.model)
    run_dtype = recipe.run.dtype
    model = meta_model(config, getattr(torch, run_dtype))
    base = list(model.parameters())
    count = len(attention_modules(model))
    heads, kv_heads, head_dim = head_layout(model)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hidden = model.get_input_embeddings().weight.shape[1]
    vocab = model.get_input_embeddings().weight.shape[0]
    intermediate = (getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden)
    s, e2e = recipe.student, recipe.end_to_end
    linear = linear_layers(recipe, model)
    local = local_layers(model.config) if s.local_layers == "keep" else []
    given = s
    if not linear:             # every layer that may be linearized kept bounded: nothing estimated, chosen, trained
        from dofattn.distill.choose import untrained

        recipe = untrained(recipe)
        s, e2e = recipe.student, recipe.end_to_end
    dims, mean_dim = plan_dims(recipe, model, head_dim, linear)
    exact = stand_in_exact_heads(recipe, model, linear)
    layers = Layers(count=count, heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
                    intermediate=intermediate, vocab=vocab, linear=linear, local=local,
                    keep_softmax=count - len(linear) - len(local),
                    keep_softmax_by=s.keep_softmax_by, dims_rule=s.dims, dims=dims, mean_dim=mean_dim)

    with torch.device("meta"):                  # the student's tensors too: no random features drawn
        build(model, recipe.student_spec(dims or [round(mean_dim)] * count, linear, exact_heads=exact))
    persistent = model.state_dict().keys()
    trained = [p for n, p in model.named_parameters() if is_student_tensor(n)]
    fixed = [b for n, b in model.named_buffers() if is_student_tensor(n) and n in persistent]
    W = world_size
    weights = sum(_shard(tuple(p.shape), W) * p.element_size() for p in base)
    trained_bytes = sum(_shard(tuple(p.shape), W) * p.element_size() for p in trained)
    student = trained_bytes + sum(b.nbytes for b in fixed)                  # FSDP leaves buffers whole
    gathered = 0
    if W > 1:                        # the root unit for the whole step, two decoder layers at a time
        body = decoder_layers(model)
        in_layers = {id(p) for m in body for p in m.parameters()}
        root = sum(p.nbytes for p in model.parameters() if id(p) not in in_layers)
        gathered = root + 2 * max(sum(p.nbytes for p in m.parameters()) for m in body)
    shape = {"recipe": recipe, "config": config, "dims": dims, "linear": linear, "exact": exact}   # what a step is of
    step = Step(**kept("step", shape, lambda: asdict(measure_step(recipe, model)))) if e2e.steps else Step(0, 0, 0)
    phase = int(e2e.steps > 0)        # no end-to-end phase: nothing trains at once, nothing is sharded
    memory = Memory(world_size=W, dtype=run_dtype, batch_size=e2e.batch_size, seq_len=e2e.seq_len,
                    loss_chunk=loss_positions(e2e.loss_chunk, e2e.seq_len - 1, vocab, e2e.batch_size),
                    checkpointing=e2e.activation_checkpointing, weights=weights, student=student,
                    gradients=trained_bytes * phase, adam=(2 * trained_bytes + len(trained) * 4) * phase,
                    gathered=gathered * phase, activations=step.activations, recompute=step.backward,
                    loss=step.loss, whole_model=sum(p.nbytes for p in base))
    notes = []
    if not linear:
        notes.append(f"nothing is linearized: student.keep_softmax = {given.keep_softmax:g} is a share, and on a model "
                     f"with its own sliding-window layers a share keeps every other layer exact, bounded after the "
                     f"prompt (student.select = {given.kept.select}), as measured best on Gemma 3 (RULER's needle as "
                     f"the teacher's; a linear global layer lost it); nothing trains. A count (e.g. "
                     f"--set student.keep_softmax=1) linearizes the rest")
    if s.dims in DOF_DIMS:
        notes.append("feature dims come from the DoF stage at run time; the student's size is at the budget's mean"
                     + (" (clip can only lower it)" if s.dims == "clip" else ""))
    if s.keep_softmax:
        softmax = layers.keep_softmax
        of = (f" ({s.keep_softmax:g} of the {softmax + len(linear)} layers that may be linearized)"
              if 0 < s.keep_softmax < 1 else "")
        many = softmax != 1
        notes.append(f"the {softmax} softmax layer{'s' * many}{of} {'are' if many else 'is'} chosen at run time (by "
                     f"{s.keep_softmax_by}); the plan takes {'them' if many else 'it'} as the last")
    if exact:
        notes.append(f"the {sum(map(len, exact))} exact key/value heads are chosen at run time (by the copy "
                     f"probe); the plan takes the first heads of the last linear layers")
    plan = Plan(recipe=recipe.name, model=recipe.run.model, model_type=config.model_type,
                parameters=sum(p.numel() for p in base), student_parameters=sum(p.numel() for p in trained),
                layers=layers, tokens=plan_tokens(recipe, config, W),
                layerwise=layerwise_bytes(recipe, hidden, heads, kv_heads, head_dim), memory=memory,
                notes=notes)
    if device is not None:
        from dofattn.distill.costs import calibrate, stage_costs

        plan.end_to_end_flops = step.flops
        plan.calibration = calibrate(recipe, plan, config, device, before, timed, recalibrate)
        plan.stages = stage_costs(recipe, plan, config, plan.calibration)
    plan.warnings = warn(plan)
    return plan


MAX_PASSES = 20     # end-to-end training that reads its data more often than this learns the sample, not the text
MAX_DAYS = 30       # a plan longer than this on the machine it was timed on is not one to start by mistake


def warn(plan: Plan) -> list[str]:
    """What is absurd in a plan for its data or its machine: more passes over the end-to-end data than
    `MAX_PASSES`, more time than `MAX_DAYS`. The plan is still made; the dry run and the run print these."""
    t, found = plan.tokens, []
    if t.end_to_end and t.end_to_end_data and t.end_to_end / t.end_to_end_data > MAX_PASSES:
        found.append(f"end-to-end training reads {t.end_to_end:,} tokens drawn from {t.end_to_end_data:,}: its data "
                     f"{t.end_to_end / t.end_to_end_data:,.0f} times over (more than {MAX_PASSES}); give more text "
                     f"(--data), fewer end_to_end.steps or fewer processes")
    if plan.stages and plan.seconds > MAX_DAYS * 86400:
        found.append(f"the plan takes {plan.seconds / 86400:,.0f} days on {plan.calibration.device} (more than "
                     f"{MAX_DAYS}): shorten the stages, or plan for more devices (--world-size)")
    return found


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
    if not L.linear:
        dims = "none (nothing is linearized)"
    elif L.dims is not None:
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
    if L.keep_softmax and not L.linear:
        kept.append(f"every other layer ({L.keep_softmax}), bounded after the prompt (the notes say why)")
    elif L.keep_softmax:
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
    if plan.layerwise:
        rows.append(f"layerwise       {_size(plan.layerwise)} in memory: the teacher's hidden states of its blocks "
                    f"({plan.memory.dtype}) and one layer's q/k/v (float32); nothing on disk")
    rows.append("")
    if not t.end_to_end:
        rows.append(f"memory per device: no end-to-end phase; each process holds the whole model, "
                    f"{_size(m.whole_model)} ({m.dtype})")
        rows += [f"note: {note}" for note in plan.notes]
        return "\n".join(rows + format_stages(plan) + [f"warning: {line}" for line in plan.warnings])
    how = (f"FSDP2 over {m.world_size} devices" if m.world_size > 1 else "1 process, nothing sharded")
    rows.append(f"memory per device, end-to-end: {how}, {m.dtype}")
    chunks = (f"logits in chunks of {m.loss_chunk} positions" if m.loss_chunk < m.seq_len - 1 else
              "logits of a whole block at once")
    rows.append(f"  ({m.batch_size} x {m.seq_len} tokens a step, {chunks}"
                f"{', layers checkpointed' if m.checkpointing else ''})")
    backward = "one layer again" if m.checkpointing else "layers' backward"     # the backward pass's extra
    for label, value in (("frozen weights", m.weights), ("student tensors", m.student), ("gradients", m.gradients),
                         ("Adam moments", m.adam), ("gathered weights", m.gathered), ("activations", m.activations),
                         (backward, m.recompute), ("loss (logits)", m.loss)):
        if value or label in ("frozen weights", "activations"):
            rows.append(f"  {label:<16}{_size(value):>12}")
    rows.append(f"  {'total':<16}{_size(m.total):>12}" + (f"   (the larger of the loss and the {backward}: never "
                                                          f"at once)" if m.recompute else ""))
    rows.append(f"  (before it, every process holds the whole model: {_size(m.whole_model)})")
    for note in plan.notes:
        rows.append(f"note: {note}")
    rows += format_stages(plan)
    return "\n".join(rows + [f"warning: {line}" for line in plan.warnings])


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def format_stages(plan: Plan) -> list[str]:
    """The stage table: the process's peak memory by the end of each stage, its disk, its estimated time."""
    if not plan.stages:
        return []
    c = plan.calibration
    rows = ["", f"stages on {c.device} (times estimated from a calibration {c.note}; memory resident, the process's "
                f"peak by the end of each stage, from {_size(c.base)} before the model)",
            f"  {'stage':<16}{'peak memory':>12}{'disk':>11}{'time':>10}   what"]
    for s in plan.stages:
        rows.append(f"  {s.name:<16}{_size(s.peak):>12}{_size(s.disk) if s.disk else '-':>11}"
                    f"{_duration(s.seconds):>10}   {s.how}")
    rows.append(f"  {'whole run':<16}{_size(plan.peak):>12}{_size(plan.disk):>11}{_duration(plan.seconds):>10}")
    return rows


def check_room(plan, folder) -> None:
    """A one-line UserError when the plan's peak resident memory (on the CPU) or its disk is more than this machine
    has free (`no_room`); `distill --force` starts anyway."""
    short = no_room(plan, folder)
    if short:
        raise UserError(f"{short[0]}; --force starts anyway")


def no_room(plan, folder) -> list[str]:
    """What this machine lacks for the plan: its peak resident memory (on the CPU) beyond the free memory, its disk
    beyond the free disk where `folder` would be. On a GPU the weights and arrays live in its memory, which the
    plan's end-to-end table gives per device: only the disk is checked there."""
    import shutil
    from pathlib import Path

    if not plan.stages:
        return []
    short = []
    have = available_memory()
    if plan.calibration.device == "cpu" and have is not None and plan.peak > have:
        worst = next(s for s in plan.stages if s.peak == plan.peak)
        short.append(f"the plan needs {_size(plan.peak)} of memory at its peak ({worst.name}) and this machine has "
                     f"{_size(have)} free: shorten layerwise.seq_len or layerwise.blocks, or end_to_end.seq_len, "
                     f"or use run.dtype=bfloat16 (`distill --dry-run` shows each stage)")
    where = Path(folder).expanduser().absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if plan.disk > free:
        short.append(f"the plan writes {_size(plan.disk)} to {folder} and {where} has {_size(free)} free: free some "
                     f"disk or give another --out")
    return short
