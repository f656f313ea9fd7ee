"""What each stage of a `dofattn distill` run costs, before it runs: its peak resident memory, what it leaves on
disk, and its time on this machine. `distill --dry-run` prints it beside the plan; `distill` refuses to start
where the memory or the disk is not there (`plan.check_room`).

    stages = stage_costs(recipe, plan, config, calibrate(recipe, plan, config, device))

Memory (the process's resident set): what this process holds before any model (Python, torch, transformers:
measured here), the model's weights, and each stage's own arrays, counted as the plan counts the end-to-end step
(FakeTensorMode and `memory.LiveBytes`: no memory, no arithmetic) or from their shapes: the DoF sample's forward
and points, the copy probe's forward, the teacher stream and one layerwise step, the end-to-end step (`plan.Memory`),
the evaluation's chunks of logits. The kernels' own scratch memory and the heap's slack (the `dofattn` command
keeps freed memory in the heap: `cli.keep_freed_memory`) are not tensors: they add `SLACK` of the arrays, a figure
measured on the CPU (stored, named as such). Freed memory stays with the process, so each stage's peak is at
least the one before it: the table shows the process's peak after each stage.

Time: the stages that run the model run at the rate this machine runs one of the model's own decoder layers at
the stage's length, in the run's dtype (`calibrate`: one layer with random weights timed when the plan is made,
a few seconds), times `EFFICIENCY` of that rate for the stage (stored figures, measured on the CPU: a backward
pass, a probe's extra work beside a forward); their FLOPs are counted on the model built from its config
(FlopCounterMode over fake tensors). The evaluations' scoring is timed apart, at the model's vocabulary: the LM head
with its log-softmax over one chunk of positions, and the student-vs-teacher tally (`scoring_seconds`; a head of
262,144 rows runs at its own rate, not a decoder layer's). The layerwise steps, which are not matrix products, are
timed: a few real steps at the recipe's shapes on random q/k/v.

`tests/test_costs.py` checks the counts; docs/RESULTS.md holds the plan beside the measured run.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, replace

import torch

from dofattn.kept import kept
from dofattn.memory import resident_now

# Stored figures, fitted to the default job on a 2-core AMD EPYC (avx512_bf16, torch 2.13) in float32 and bfloat16
# and checked on `window` (docs/log/experiments.md, 2026-11-28 and 29): a stage's arrays cost 1 + SLACK times their
# bytes in resident memory (the layerwise step is counted at the mean dim, the largest layer's is larger); each
# stage runs at EFFICIENCY x the measured rate of one decoder layer's forward at the stage's length. The
# evaluations' bodies are plain forwards, as the DoF sample's (their scoring is timed apart; refitted on SmolLM2's
# and Gemma 3's jobs, 2026-12-04).
SLACK = {"setup": 0.5, "layerwise": 1.3, "end_to_end": 0.6, "layerwise_eval": 0.5, "evaluate": 0.5, "other": 1.0}
EFFICIENCY = {"dof": 1.05, "softmax_choice": 1.05, "teacher": 1.05, "end_to_end": 0.83, "evaluate": 1.05,
              "layerwise_eval": 1.05}
DOF_HEAD_SECONDS = 0.06        # the DoF sample's points and eigen-decompositions, per head (1024 points), on the CPU


# --- the model, from its config --------------------------------------------------------------------------------------

def meta_model(config, dtype: torch.dtype = torch.float32):
    """The model of `config` on the meta device, with the softmax attention a run loads it with, in eval mode:
    every parameter's shape, no memory, no weights read."""
    import copy

    from transformers import AutoModelForCausalLM

    from dofattn.model.hf import softmax_implementation

    config = copy.deepcopy(config)                   # from_config sets its dtype: the caller's keeps the stored one
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=softmax_implementation(config))
    return model.eval()                              # as `hf.load_model` leaves it: no dropout


def fake_model(model, mode) -> None:
    """`model`'s meta tensors (parameters, buffers, tensors modules hold) as `mode`'s fake CPU tensors, in place;
    a tensor two modules share (tied embeddings) stays shared. A parameter or buffer a module made on the CPU in
    spite of the meta device (a small constant) becomes a fake tensor too."""
    made = {}

    def fake(t):
        if id(t) not in made:
            made[id(t)] = (mode.fake_tensor_converter.from_meta_and_device(mode, t, torch.device("cpu"))
                           if t.device.type == "meta" else mode.from_tensor(t))
            if isinstance(t, torch.nn.Parameter):
                made[id(t)] = torch.nn.Parameter(made[id(t)], requires_grad=t.requires_grad)
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fake(t)
        for name, t in list(vars(module).items()):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                object.__setattr__(module, name, fake(t))


@dataclass
class Calibration:
    """What this machine does, measured when the plan is made."""

    device: str
    base: int                 # resident bytes of this process before any model: Python, torch, transformers
    rates: dict               # tokens per sequence -> FLOP/s of one decoder layer's forward at that length
    scoring: dict             # seconds per scored position: "head" (LM head + log-softmax), "tally" (KL, agreement)
    layerwise_step: float     # seconds of one layerwise step at the recipe's shapes (0: no layerwise stage)
    note: str                 # how it was measured


@dataclass
class StageCost:
    name: str
    arrays: int               # bytes of the stage's own arrays (beyond the base and the weights)
    peak: int                 # the process's resident peak by the end of the stage
    disk: int                 # bytes the stage leaves in the run folder
    seconds: float            # estimated
    how: str                  # what the time is made of


def layerwise_step_seconds(recipe, plan, device: str) -> float:
    """Seconds of one layerwise step of a layer at the budget's mean dim, on random q/k/v of the recipe's shapes:
    `layerwise.train_layer` with 1 step and with 5, the difference over 4 (its set-up and final loss cancel), after
    a call that warms up."""
    from dofattn.attention import LinearAttention
    from dofattn.distill.layerwise import train_layer
    from dofattn.features import make_feature_map

    lw, L = recipe.layerwise, plan.layers
    scaling = L.head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)
    shape = (lw.batch_size, lw.seq_len)
    acts = (torch.randn(*shape, L.heads, L.head_dim, generator=gen) * 2,
            torch.randn(*shape, L.kv_heads, L.head_dim, generator=gen) * 2,
            torch.randn(*shape, L.kv_heads, L.head_dim, generator=gen))
    seconds = []
    for steps in (1, 1, 5):
        fmap = make_feature_map(recipe.student.attention.feature, L.heads, L.head_dim, round(L.mean_dim), scaling,
                                seed=0)
        linear = LinearAttention(recipe.student.attention, fmap, num_kv_heads=L.kv_heads).to(device)
        start = time.perf_counter()
        train_layer(linear, acts, scaling, replace(lw, steps=steps), seed=0, progress=False)
        seconds.append(time.perf_counter() - start)
    one, five = seconds[1:]
    return (five - one) / 4 if five > one else five / 5           # (noise, at tiny shapes)


def stage_lengths(recipe, config) -> dict[str, int]:
    """The tokens per sequence of each stage that runs the model: what its rate is measured at."""
    from dofattn.distill.choose import ATTENTION_DOF_SEQ_LEN, COPY_SEQ_LEN
    from dofattn.recipe import DOF_SEQ_LEN
    from dofattn.model.hf import context_length

    r = recipe
    if r.student.keep_softmax_by == "copy":
        context = context_length(config)
        choice = min(COPY_SEQ_LEN, context) if context else COPY_SEQ_LEN
    else:
        choice = min(r.eval.seq_len, ATTENTION_DOF_SEQ_LEN)
    return {"dof": DOF_SEQ_LEN, "softmax_choice": choice, "teacher": r.layerwise.seq_len,
            "end_to_end": r.end_to_end.seq_len, "layerwise_eval": r.eval.seq_len, "evaluate": r.eval.seq_len}


def one_layer(config):
    """`config` with one decoder layer (a full-attention one where the family mixes kinds), for timing a layer."""
    import copy

    one = copy.deepcopy(config)
    text = one.get_text_config(decoder=True) if hasattr(one, "get_text_config") else one
    types = getattr(text, "layer_types", None)
    text.num_hidden_layers = 1
    if types:
        text.layer_types = ["full_attention" if "full_attention" in types else types[0]]
    return one


def forward_rates(config, dtype: torch.dtype, device: str, lengths) -> dict[int, float]:
    """FLOP/s of the model's own forward at each of `lengths` tokens on `device`: one decoder layer of `config` with
    random weights (made once), timed on [1, length] tokens after a short warm-up, its FLOPs counted as
    `forward_counts` counts them (the body of one layer: its matrix products and attention, at the rate its other
    operations leave them)."""
    from dofattn.model.hf import random_model

    one = one_layer(config)
    body = random_model(one, dtype, device).base_model
    clock = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rates = {}
    for length in sorted(set(lengths)):
        _, flops = forward_counts(one, dtype, 1, length, logits=False)
        ids = torch.zeros(1, length, dtype=torch.long, device=device)
        with torch.no_grad():
            body(input_ids=ids[:, :min(length, 64)], use_cache=False)
            seconds = []
            for _ in range(2):
                clock()
                start = time.perf_counter()
                body(input_ids=ids, use_cache=False)
                clock()
                seconds.append(time.perf_counter() - start)
        rates[length] = flops / min(seconds)
    return rates


def scoring_seconds(config, dtype: torch.dtype, device: str, hidden: int, vocab: int) -> dict[str, float]:
    """Seconds per scored position of the evaluations' work beyond the model's body, on one chunk of
    `evaluate.score_chunk` positions at `vocab` and `hidden`: "head", `evaluate.head` (the LM head in `dtype`, the
    config's soft-capping) with its float32 log-softmax, as `perplexity` and `compare` score a chunk; "tally",
    `compare`'s tally of two such chunks (KL, agreement, both NLLs). Random weights, the best of two after a warm-up."""
    from dofattn.evaluate import SCORE_VALUES, _Tally, head

    class Shim(torch.nn.Module):                     # what `head` reads of a model: its output embeddings, its config
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
            torch.nn.init.normal_(self.lm_head.weight, std=hidden ** -0.5)
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            self.config = type("Config", (), {"final_logit_softcapping":
                                              getattr(text, "final_logit_softcapping", None)})()

        def get_output_embeddings(self):
            return self.lm_head

    rows = max(1, SCORE_VALUES // vocab)
    shim, gen = Shim(), torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, rows, hidden, generator=gen, device=device, dtype=dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    clock = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def best(work) -> float:
        work()
        seconds = []
        for _ in range(2):
            clock()
            start = time.perf_counter()
            work()
            clock()
            seconds.append(time.perf_counter() - start)
        return min(seconds) / rows

    with torch.no_grad():
        scored = lambda: torch.log_softmax(head(shim, x).float(), -1).flatten(0, 1)      # noqa: E731
        log_s, log_t = scored(), scored().roll(1, -1)
        return {"head": best(scored), "tally": best(lambda: _Tally().add(log_s, log_t, targets, rows))}


def calibrate(recipe, plan, config, device: str = "cpu", base: int | None = None, timed: bool = True,
              recalibrate: bool = False) -> Calibration:
    """Measure this machine (a second or two, more for a large model; the layerwise steps take what five of them
    take); `base`: this process's resident bytes before any model (default: now). `timed` False: only the base
    (memory and disk are planned, no time: `distill`'s check before it starts). What was measured with the cores
    idle is kept for this machine, model shape and recipe (`dofattn.kept`) and read by the next plan;
    `recalibrate` measures again."""
    base = resident_now() if base is None else base
    if not timed:
        return Calibration(device=device, base=base, rates={}, scoring={"head": math.nan, "tally": math.nan},
                           layerwise_step=math.nan, note="not timed")
    from dofattn.kept import kept_with_date, machine

    idle = _idle(device)                             # read before measuring: the measurement loads the cores itself
    dtype = getattr(torch, recipe.run.dtype)
    lengths = sorted(set(stage_lengths(recipe, config).values()))
    where = machine(device)
    pairs, rates_date = kept_with_date(
        "rates", {"machine": where, "config": config, "dtype": recipe.run.dtype, "lengths": lengths},
        lambda: sorted(forward_rates(config, dtype, device, lengths).items()), keep=idle, fresh=recalibrate)
    rates = {int(n): rate for n, rate in pairs}
    L = plan.layers
    scoring, scoring_date = kept_with_date(
        "scoring", {"machine": where, "config": config, "dtype": recipe.run.dtype, "hidden": L.hidden,
                    "vocab": L.vocab}, lambda: scoring_seconds(config, dtype, device, L.hidden, L.vocab),
        keep=idle, fresh=recalibrate)
    step, step_date = 0.0, None
    if recipe.layerwise.steps and plan.layers.linear:
        key = {"machine": where, "layerwise": recipe.layerwise, "attention": recipe.student.attention,
               "layers": plan.layers}
        step, step_date = kept_with_date("layerwise_step", key, lambda: layerwise_step_seconds(recipe, plan, device),
                                         keep=idle, fresh=recalibrate)
    dates = sorted({d for d in (rates_date, scoring_date, step_date) if d})
    when = (f"measured on {device} on {', '.join(dates)} and kept (--recalibrate measures again)" if dates else
            f"measured now on {device}" + ("" if idle else " with other work on the cores (not kept)"))
    shown = ", ".join(f"{n:,} tokens {rate / 1e9:.0f}" for n, rate in rates.items())
    return Calibration(device=device, base=base, rates=rates, scoring=scoring, layerwise_step=step,
                       note=f"{when}: one decoder layer's forward in {recipe.run.dtype} at "
                            f"{shown} GFLOP/s; the LM head and log-softmax {scoring['head'] * 1e3:.2f} ms, the "
                            f"tally {scoring['tally'] * 1e3:.2f} ms a position"
                            + (f"; a layerwise step in {step:.3f} s" if step else ""))


def _idle(device: str) -> bool:
    """Whether the cores are free of other work (the 1-minute load average below `options.BUSY_LOAD`): a timing made
    beside other work is not kept. On a GPU the host's load does not matter."""
    from dofattn.options import BUSY_LOAD

    if str(device).startswith("cuda"):
        return True
    try:
        return os.getloadavg()[0] < BUSY_LOAD
    except OSError:
        return False


# --- counting, on the model built from its config ------------------------------------------------------------------

def _count_cpu_flash_attention() -> None:
    """Teach FlopCounterMode the CPU's flash attention, which it does not count (SDPA on the CPU, the teacher's
    softmax layers): as the GPU's, halved where causal (the kernel skips the blocks above the diagonal)."""
    from torch.utils.flop_counter import (flop_registry, register_flop_formula, sdpa_backward_flop_count,
                                          sdpa_flop_count)

    ops = torch.ops.aten
    forward, backward = ops._scaled_dot_product_flash_attention_for_cpu, \
        ops._scaled_dot_product_flash_attention_for_cpu_backward
    if forward in flop_registry:                  # a torch that counts it already
        return

    @register_flop_formula(forward)
    def _forward(q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(q, k, v) // (2 if is_causal else 1)

    @register_flop_formula(backward)
    def _backward(grad_out, q, k, v, out, logsumexp, dropout_p=0.0, is_causal=False, *args, out_shape=None,
                  **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, q, k, v) // (2 if is_causal else 1)


_count_cpu_flash_attention()


@contextlib.contextmanager
def _fake(module, existing=(), grad: bool = False):
    """`module` (on the meta device) as fake CPU tensors while active, with a LiveBytes (`existing` real tensors not
    counted) and a FlopCounterMode; without autograd unless `grad`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from dofattn.memory import LiveBytes, RealConstants

    mode = FakeTensorMode()
    fake_model(module, mode)
    live = LiveBytes([*module.parameters(), *module.buffers(), *existing])
    flops = FlopCounterMode(display=False)
    with mode, RealConstants(mode, live), live, flops, torch.enable_grad() if grad else torch.no_grad():
        yield live, flops


def forward_counts(config, dtype: torch.dtype, batch: int, length: int, logits: bool = True) -> tuple[int, int]:
    """(live bytes at the peak, FLOPs) of the teacher's forward on [batch, length] tokens (with its logits, as
    `capture.run_forward` makes them, or the body alone); kept (`dofattn.kept`)."""
    key = {"config": config, "dtype": str(dtype), "batch": batch, "length": length, "logits": logits}
    return tuple(kept("forward", key, lambda: _forward_counts(config, dtype, batch, length, logits)))


def _forward_counts(config, dtype: torch.dtype, batch: int, length: int, logits: bool) -> tuple[int, int]:
    model = meta_model(config, dtype)
    ids = torch.zeros(batch, length, dtype=torch.long)
    with _fake(model) as (live, flops):
        (model if logits else model.base_model)(input_ids=ids, use_cache=False)
    return live.peak, flops.get_total_flops()


def layerwise_step_counts(recipe, plan) -> tuple[int, int]:
    """(live bytes at the peak, FLOPs) of one layerwise step (loss, backward) at the recipe's shapes and the mean
    dim, q/k/v included; kept (`dofattn.kept`)."""
    key = {"layerwise": recipe.layerwise, "attention": recipe.student.attention, "layers": plan.layers}
    return tuple(kept("layerwise_counts", key, lambda: _layerwise_step_counts(recipe, plan)))


def _layerwise_step_counts(recipe, plan) -> tuple[int, int]:
    from dofattn.attention import LinearAttention
    from dofattn.distill.losses import LOSSES, sample_rows
    from dofattn.features import make_feature_map
    from dofattn.ops.softmax import expand_kv

    lw, L = recipe.layerwise, plan.layers
    with torch.device("meta"):
        fmap = make_feature_map(recipe.student.attention.feature, L.heads, L.head_dim, round(L.mean_dim),
                                L.head_dim ** -0.5, seed=0)
        linear = LinearAttention(recipe.student.attention, fmap, num_kv_heads=L.kv_heads).train()
    rows = {}
    if 0 < lw.rows < lw.seq_len:
        rows["at"] = sample_rows(lw.seq_len, lw.rows, torch.Generator().manual_seed(0),
                                 exact=recipe.student.attention.window)
    shape = (lw.batch_size, lw.seq_len)
    with _fake(linear, existing=rows.values(), grad=True) as (live, flops):
        q = torch.empty(*shape, L.heads, L.head_dim)
        k, v = (expand_kv(torch.empty(*shape, L.kv_heads, L.head_dim), L.heads) for _ in range(2))
        value = LOSSES[lw.loss](linear, q, k, v, L.head_dim ** -0.5, **rows)
        if value.requires_grad:              # a feature map with nothing to learn (performer) has no backward
            value.backward()
    return live.peak, flops.get_total_flops()


# --- the stages --------------------------------------------------------------------------------------------------

def stage_costs(recipe, plan, config, calibration: Calibration) -> list[StageCost]:
    """Each stage's arrays, the process's peak after it, its disk and its time (module docstring)."""
    from dofattn.distill.choose import ATTENTION_DOF_BLOCKS, COPY_BLOCKS
    from dofattn.recipe import DOF_BLOCKS, DOF_POINTS, DOF_SEQ_LEN
    from dofattn.evaluate import SCORE_VALUES

    r, L, m, t = recipe, plan.layers, plan.memory, plan.tokens
    dtype = getattr(torch, r.run.dtype)
    lengths = stage_lengths(r, config)
    weights, student = m.whole_model, m.student
    base = calibration.base + weights
    rows: list[tuple[str, int, int, float, str]] = []      # name, arrays, disk, seconds, how

    def model_time(flops: float, stage: str) -> float:
        """At the measured forward rate at the stage's length (NaN where nothing was timed), times EFFICIENCY."""
        rate = calibration.rates.get(lengths[stage], math.nan)
        return flops / (rate * EFFICIENCY[stage])

    # weights stored in another dtype are read whole and converted as they load: the file's bytes pass through
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    converted = plan.parameters * stored.itemsize if isinstance(stored, torch.dtype) and stored != dtype else 0
    rows.append(("setup", converted, 0, 0.0, "loading the model and the text"
                 + (f" (its {str(stored).removeprefix('torch.')} weights converted to {r.run.dtype})"
                    if converted else "")))
    if t.dof_sample:
        live, flops = forward_counts(config, dtype, 4, DOF_SEQ_LEN, logits=False)     # a capture: no logits
        points = L.count * L.heads * DOF_POINTS * L.head_dim * 4
        heads = L.count * L.heads
        seconds = model_time(flops * DOF_BLOCKS / 4, "dof") + heads * DOF_HEAD_SECONDS
        rows.append(("dof", live + points, 16 << 10, seconds,
                     f"{t.dof_sample:,} tokens through the teacher, {heads} heads' DoF"))
    if t.softmax_choice:
        length = lengths["softmax_choice"]
        live, flops = forward_counts(config, dtype, 1, length, logits=False)
        if r.student.keep_softmax_by == "copy":
            blocks = COPY_BLOCKS
            live += 3 * L.heads * length * length * 4                  # a layer's attention of the probe
        else:
            blocks = ATTENTION_DOF_BLOCKS
            live += 4 * L.heads * length * length * 8                  # a layer's attention matrices, float64
        rows.append(("softmax_choice", live, 8 << 10, model_time(flops * blocks, "softmax_choice"),
                     f"{blocks} blocks of {length} through the teacher"))
    if t.layerwise_teacher:
        lw = r.layerwise
        body_live, body_flops = forward_counts(config, dtype, lw.batch_size, lw.seq_len, logits=False)
        step = layerwise_step_counts(r, plan)[0]
        # the stream runs the teacher up to the last linear layer: with layers kept by a choice made at run time,
        # any of them may be last
        last = L.count if L.keep_softmax else max(L.linear) + 1 if L.linear else 0
        teacher = model_time(body_flops / L.count * last * lw.blocks / lw.batch_size, "teacher")
        training = len(L.linear) * lw.steps * calibration.layerwise_step
        rows.append(("layerwise", plan.layerwise + max(body_live // L.count, step), student, teacher + training,
                     f"the teacher's {last} layers on {lw.blocks} blocks ({teacher:.0f} s), then {len(L.linear)} "
                     f"layers x {lw.steps} steps at {calibration.layerwise_step:.3f} s ({training:.0f} s)"))
    if t.end_to_end:
        e2e = r.end_to_end
        arrays = m.total - m.weights          # the student's tensors, gradients, Adam, the step's activations
        seconds = model_time(plan.end_to_end_flops * e2e.steps, "end_to_end")
        rows.append(("end_to_end", arrays, 3 * student, seconds,
                     f"{e2e.steps} steps of {e2e.batch_size} x {e2e.seq_len} tokens, teacher and student"))
    # the evaluation: the teacher, the student and the Performer over the validation blocks (and after the
    # layerwise stage, when an end-to-end phase follows, the student as it is then); the hidden states of two models
    # and a chunk of their logits at a time. The bodies at the layer's rate; each scored position's LM head and
    # log-softmax (three: teacher, student, Performer) and compare's tally at their own (`scoring_seconds`)
    blocks, length = r.eval.blocks, r.eval.seq_len
    live, flops = forward_counts(config, dtype, 4, length, logits=False)
    chunk = max(1, SCORE_VALUES // L.vocab) * L.vocab * 4     # a chunk's logits (perplexity: 3 such, compare: 8)
    hidden = 4 * length * L.hidden * 4
    body, positions = flops * blocks / 4, blocks * (length - 1)
    score = calibration.scoring
    if t.end_to_end and t.layerwise_teacher:
        rows.insert(-1, ("layerwise_eval", live + hidden + 3 * chunk, 0,
                         model_time(body, "layerwise_eval") + positions * score["head"],
                         f"the layerwise student over {blocks} blocks of {length}"))
    rows.append(("evaluate", live + 2 * hidden + 8 * chunk, student,
                 model_time(3 * body, "evaluate") + positions * (3 * score["head"] + score["tally"]),
                 f"teacher, student and Performer over {blocks} blocks of {length}"))
    return peaks(rows, base)


def peaks(rows: list[tuple[str, int, int, float, str]], base: int) -> list[StageCost]:
    """The stages' costs from their rows (name, arrays, disk, seconds, how): each stage's arrays with their slack
    on top of `base`, and the process's peak after it (the largest so far)."""
    costs, peak = [], base
    for name, arrays, disk, seconds, how in rows:
        own = base + int(arrays * (1 + SLACK.get(name, SLACK["other"])))
        if name == "setup":           # a conversion's file pages go back to the system: later stages start lower
            costs.append(StageCost(name, arrays, own, disk, seconds, how))
            continue
        peak = max(peak, own)
        costs.append(StageCost(name, arrays, peak, disk, seconds, how))
    return costs
