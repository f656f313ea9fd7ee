"""What the student is made of, chosen from the teacher: features per layer, and which layers keep softmax attention.

- dims: `dof` and `clip` estimate each layer's DoF on the training split (the paper's allocation: dims in proportion,
  mean = head size; clip caps them at the head size) and keep it as `dof.json` in the run folder; `fix`, `fix:C` or a
  dof.json path give them directly.
- softmax layers (among those that may be linearized: not a model's own sliding-window layers, unless
  student.local_layers = linearize): the K layers whose attention matrices have the largest DoF
  (`dof.attention_dofs`): sharp, position-bound attention counts high, a sink low. Kept as `attention_dof.json`.
  Or (keep_softmax_by = copy) the K layers whose best head copies most from far back (`copy_scores`, the copy
  probe below), kept as `copy_scores.json`.
Both are computed once, on rank 0, so a resumed run keeps the same dims and layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dofattn.model.capture import capture, run_forward
from dofattn.distill.world import barrier, world
from dofattn.dof import DofResult, allocate_dims, attention_dofs, sample_points
from dofattn.errors import UserError
from dofattn.model.hf import context_length
from dofattn.io import write_atomic
from dofattn.ops.softmax import attention_logits, expand_kv
from dofattn.recipe import DOF_BLOCKS, DOF_DIMS, DOF_POINTS, DOF_SEQ_LEN, Recipe, check_fixed_dims
from dofattn.spec import StudentSpec
from dofattn.model.student import attention_modules, build, global_layers, head_layout

# --- the student's shape from a recipe: its dims, its linear layers, or an untrained student -------------------

def resolve_dims(spec: str | list[int], model: nn.Module, model_name: str = "", what: str = "--dims") -> list[int]:
    """Feature dims per layer from `fix`, `fix:C`, a dof.json path, or a list; errors name option `what`."""
    num_layers = len(attention_modules(model))
    _, _, head_dim = head_layout(model)
    if isinstance(spec, str):
        check_fixed_dims(spec, what)                      # its form, on the text alone
    if isinstance(spec, list):
        dims = spec
    elif spec == "fix" or spec.startswith("fix:") or spec.isdigit():
        value = spec if spec.isdigit() else spec.partition(":")[2] or str(head_dim)
        dims = [int(value)] * num_layers
    else:                                                 # a dof.json that exists
        try:
            result = DofResult.from_json(Path(spec).read_text())
        except (json.JSONDecodeError, TypeError, KeyError) as err:
            raise UserError(f"{spec} is not a dofattn dof.json file ({err})") from None
        if model_name and result.model and result.model != model_name:
            raise UserError(f"dims file {spec} was computed for model {result.model!r}, not {model_name!r}; "
                            f"run `dofattn dof --model {model_name}`")
        dims = result.dims
    if len(dims) != num_layers:
        raise UserError(f"{what} gives {len(dims)} layers but the model has {num_layers}")
    if min(dims) < 1:
        raise UserError(f"--dims must be >= 1 in every layer, got {min(dims)}")
    return [int(d) for d in dims]


def linear_layers(recipe, model, chosen: list[int] | None = None) -> list[int]:
    """The layers a run of `recipe` linearizes in `model`: those that may be (every layer; with student.local_layers
    = keep all but the model's own sliding-window ones, `student.global_layers`) less the softmax layers `chosen`
    (`softmax_layers`). `chosen` [] gives the candidates themselves, None takes the last student.keep_softmax of
    them (the dry run's plan: the layers are chosen at run time). A UserError where keep_softmax leaves none."""

    s = recipe.student
    candidates = global_layers(model) if s.local_layers == "keep" else list(range(len(attention_modules(model))))
    bounded_alone = s.local_layers == "keep" and len(candidates) < len(attention_modules(model)) and s.kept.select > 0
    keep = kept_count(s.keep_softmax, len(candidates), every=bounded_alone)
    if keep >= len(candidates) and not bounded_alone:
        raise UserError(f"student.keep_softmax = {s.keep_softmax:g} leaves no layer to linearize: the model has "
                        f"{len(candidates)} layers that may be linearized (a share below 1, e.g. 0.4, keeps that "
                        f"share of them)")
    chosen = candidates[len(candidates) - min(keep, len(candidates)):] if chosen is None else chosen
    return [i for i in candidates if i not in chosen]


def untrained(recipe):
    """`recipe` as a run that linearizes nothing does it (`kept_count`'s `every`: a model's own sliding-window layers
    beside every other layer kept bounded): no DoF sample, no choice of layers, no layerwise stage, no end-to-end
    phase, only the evaluation. For the stages and their plan; the run folder keeps the recipe as given."""
    from dataclasses import replace

    return replace(recipe, student=replace(recipe.student, dims="fix", keep_softmax=0, exact_heads=0.0),
                   layerwise=replace(recipe.layerwise, steps=0), end_to_end=replace(recipe.end_to_end, steps=0))


def share_count(value: float, total: int) -> int:
    """What a recipe key that takes a count or a share keeps of `total`: a count (>= 1, or 0) as it is; a share
    below 1 of `total` rounded, at least one."""
    if value >= 1 or not value:
        return int(value)
    return max(1, round(value * total))


def kept_count(keep_softmax: float, candidates: int, every: bool = False) -> int:
    """Layers `student.keep_softmax` keeps as softmax attention of `candidates` that may be linearized
    (`share_count`; a share keeps all but one at most: long-context's 0.4 is 12 of SmolLM2's 30 layers). `every`
    (a model with its own sliding-window layers, the kept ones bounded): a share keeps every candidate, its global
    layers, and nothing is linearized. Measured on Gemma 3 270M: with its 3 global layers bounded RULER's needle is
    found as often as by the teacher (7 and 5 of 10 at 4 and 8 K); with one kept and two linear, never."""
    if every and 0 < keep_softmax < 1:
        return candidates
    count = share_count(keep_softmax, candidates)
    return min(count, max(candidates - 1, 0)) if 0 < keep_softmax < 1 else count


def check_untrained(recipe) -> None:
    """A UserError for a recipe whose student cannot be built untrained: its kept softmax layers a run chooses."""
    if recipe.student.keep_softmax or recipe.student.exact_heads:
        raise UserError(f"recipe {recipe.name!r} keeps softmax layers or heads that a run chooses (copy probe, DoF "
                        f"or far mass); distill it, then use the run folder")


def build_untrained(model: nn.Module, recipe, dims: list[int], stand_in: bool = False) -> StudentSpec:
    """Make `model` the untrained student of `recipe` (a `recipe.Recipe`: its [student] architecture whole) with
    `dims` features per layer, in place, for what does not depend on training (speed, memory, plumbing); its spec.
    A recipe whose kept softmax layers (or exact heads) a run chooses is a UserError (`check_untrained`), unless
    `stand_in`: then its last `keep_softmax` layers (and `stand_in_exact_heads`) stand in for them, as in the dry
    run's plan (the same count and shapes; for speed and memory, not quality)."""
    if not stand_in:
        check_untrained(recipe)
    layers = linear_layers(recipe, model) if stand_in else global_layers(model)
    exact = stand_in_exact_heads(recipe, model, layers) if stand_in else []
    spec = recipe.student_spec(dims, layers, exact_heads=exact)
    build(model, spec)
    return spec


ATTENTION_DOF_BLOCKS = 8      # training blocks on which the teacher's attention matrices are measured
ATTENTION_DOF_SEQ_LEN = 512   # tokens per block, at most (else eval.seq_len): each T x T matrix's SVD costs T³


# --- which layers recall: the copy probe ----------------------------------------------------------------------------

COPY_SPAN = 32        # tokens of the passage the probe writes twice
COPY_SEQ_LEN = 1024   # tokens per probe block (at most the model's context)
COPY_BLOCKS = 4       # training blocks the scores average over


def copy_probe(blocks: torch.Tensor, span: int = COPY_SPAN) -> tuple[torch.Tensor, int]:
    """Probe inputs from text blocks [N, T]: each block's `span` tokens from T/8 on are written again over its last
    `span` tokens, so that it ends by repeating a passage about 7/8 of the block back. -> (probe [N, T], where the
    first copy starts). UserError for blocks shorter than 8 spans."""
    N, T = blocks.shape
    if T < 8 * span:
        raise UserError(f"the copy probe needs blocks of at least {8 * span} tokens (8 × its span), got {T}")
    at = T // 8
    probe = blocks.clone()
    probe[:, T - span:] = blocks[:, at:at + span]
    return probe, at


def copy_mass(query: torch.Tensor, key: torch.Tensor, scaling: float, at: int, span: int) -> torch.Tensor:
    """query and key [B, T, H, D] (key on query heads) -> [B, H]: the causal softmax weight that the last `span`
    queries (the repeat) give the keys [at, at + span) (the first copy), summed over those keys, averaged over the
    queries. 1: a head that reads the first copy alone; about span/T: one that spreads its weight evenly."""
    logits = attention_logits(query[:, -span:], key, scaling)                            # [B, H, span, T]
    return logits.softmax(-1)[..., at:at + span].sum(-1).mean(-1)


def copy_scores(model, blocks: torch.Tensor, span: int = COPY_SPAN, progress: bool = True) -> list[list[float]]:
    """Per layer and head [L][H], how much the model's attention copies from far back: `copy_mass` on `copy_probe`
    of `blocks` [N, T], averaged over the blocks. Recall beyond a student's window needs the heads that score high
    (those that find the passage an answer repeats); a synthetic probe, so the recall tasks stay held out."""
    probe, at = copy_probe(blocks, span)
    return per_head(model, probe, lambda x: copy_mass(x.query, expand_kv(x.key, x.num_heads), x.scaling, at, span),
                    "copy probe", progress)


def per_head(model, blocks: torch.Tensor, score, desc: str, progress: bool = True) -> list[list[float]]:
    """Per layer and query head [L][H], `score` of each layer's attention inputs (a `capture.AttentionInputs` ->
    [B, H]) averaged over `blocks` [N, T], one forward of the model a block."""
    sums: dict[int, torch.Tensor] = {}

    def record(x) -> None:
        sums[x.layer] = sums.get(x.layer, 0) + score(x).sum(0).cpu()

    device = next(model.parameters()).device
    with capture(model, record), torch.no_grad():
        for block in tqdm(blocks, desc=desc, unit="block", disable=not progress):
            run_forward(model, block[None].to(device))
    return [(sums[i] / len(blocks)).tolist() for i in sorted(sums)]


def _once(path: Path, compute) -> str:
    """The text of `path`, written by rank 0 with `compute()` if it is not there yet."""
    if world()[0] == 0 and not path.is_file():
        write_atomic(path, compute())
    barrier()
    return path.read_text()


def dims(recipe: Recipe, model, tokenizer, out: Path) -> list[int]:
    """Features per layer for `student.dims`."""
    from dofattn.data import token_blocks

    rule, model_name = recipe.student.dims, recipe.run.model
    if rule not in DOF_DIMS:
        return resolve_dims(rule, model, model_name, "student.dims")

    def estimate() -> str:
        blocks = token_blocks(recipe.run.data, tokenizer, DOF_SEQ_LEN, DOF_BLOCKS, split="train",
                              seed=recipe.run.seed)
        sample = sample_points(model, blocks, samples=DOF_POINTS, seed=recipe.run.seed)
        result = allocate_dims(sample, recipe.dof.lam, head_layout(model)[2], clip=rule == "clip", progress=True,
                               model=model_name, data=recipe.run.data, num_blocks=DOF_BLOCKS, seq_len=DOF_SEQ_LEN)
        for warning in result.warnings():
            print(f"WARNING: {warning}", flush=True)
        return result.to_json()

    return resolve_dims(DofResult.from_json(_once(out / "dof.json", estimate)).dims, model, model_name)


def softmax_layers(recipe: Recipe, model, tokenizer, out: Path, candidates: list[int]) -> list[int]:
    """The `student.keep_softmax` layers of `candidates` (those that may be linearized) with the highest score of
    `student.keep_softmax_by` (ties: the earlier layer): the mean DoF of their attention matrices
    (`attention_dof.json`), or their best head's copy score (`copy_scores.json`)."""
    from dofattn.data import token_blocks

    K = kept_count(recipe.student.keep_softmax, len(candidates))
    if K == 0:
        return []

    def estimate_dof() -> str:
        blocks = token_blocks(recipe.run.data, tokenizer, min(recipe.eval.seq_len, ATTENTION_DOF_SEQ_LEN),
                              ATTENTION_DOF_BLOCKS, split="train", seed=recipe.run.seed)
        heads = attention_dofs(model, blocks, recipe.dof.lam, progress=True)
        return json.dumps({"lam": recipe.dof.lam, "blocks": len(blocks), "seq_len": blocks.shape[1],
                           "layers": [sum(h) / len(h) for h in heads], "heads": heads}, indent=2)

    if recipe.student.keep_softmax_by == "copy":
        score = json.loads(_once(out / "copy_scores.json", lambda: estimate_copy(recipe, model, tokenizer)))["layers"]
    else:
        score = json.loads(_once(out / "attention_dof.json", estimate_dof))["layers"]
    order = sorted(candidates, key=lambda i: (-score[i], i))
    return sorted(order[:K])


def estimate_copy(recipe: Recipe, model, tokenizer) -> str:
    """`copy_scores.json`: the copy probe's score of every layer (its best head's) and head, on training blocks."""
    from dofattn.data import token_blocks

    context = context_length(model.config)
    seq_len = min(COPY_SEQ_LEN, context) if context else COPY_SEQ_LEN
    blocks = token_blocks(recipe.run.data, tokenizer, seq_len, COPY_BLOCKS, split="train", seed=recipe.run.seed)
    heads = copy_scores(model, blocks, COPY_SPAN, progress=True)
    return json.dumps({"span": COPY_SPAN, "blocks": len(blocks), "seq_len": blocks.shape[1],
                       "layers": [max(h) for h in heads], "heads": heads}, indent=2)


# --- which heads stay exact inside linear layers --------------------------------------------------------------------

def exact_count(share: float, num_kv_heads: int, num_layers: int) -> int:
    """Key/value heads `student.exact_heads` keeps of all the model's (`share_count`)."""
    return share_count(share, num_kv_heads * num_layers)


def stand_in_exact_heads(recipe: Recipe, model, linear: list[int]) -> list[list[int]]:
    """Exact heads for what is built before a run chooses them (the dry run's plan, a stand-in student for speed
    and memory): as many as `student.exact_heads` keeps, key/value head 0 of the last `linear` layers first, then
    head 1, ... (the same count and shapes, not the same heads). [] where it keeps none."""
    _, kv_heads, _ = head_layout(model)
    num_layers = len(attention_modules(model))
    count = exact_count(recipe.student.exact_heads, kv_heads, num_layers)
    chosen = [[] for _ in range(num_layers)]
    for h in range(kv_heads - 1):
        for i in reversed(linear):
            if sum(map(len, chosen)) < count:
                chosen[i].append(h)
    return chosen if count else []


def exact_heads(recipe: Recipe, model, tokenizer, out: Path, linear: list[int]) -> list[list[int]]:
    """Per layer, the key/value heads `student.exact_heads` keeps exact: of the `linear` layers' heads, those that
    copy most on the copy probe (`copy_scores.json`; a key/value head scores as the best of its query heads; ties:
    the earlier layer, then head). A layer keeps at least one head linear; a head past that is passed over. [] where
    it keeps none. (The teacher's attention mass beyond the window chose worse heads: docs/log, issue 67.)"""
    s = recipe.student
    heads, kv_heads, _ = head_layout(model)
    num_layers = len(attention_modules(model))
    count = exact_count(s.exact_heads, kv_heads, num_layers)
    if not count:
        return []

    scores = json.loads(_once(out / "copy_scores.json", lambda: estimate_copy(recipe, model, tokenizer)))["heads"]
    group = heads // kv_heads
    score = {(i, h): max(scores[i][h * group:(h + 1) * group]) for i in linear for h in range(kv_heads)}
    chosen = [[] for _ in range(num_layers)]
    for i, h in sorted(score, key=lambda ih: (-score[ih], ih)):
        if sum(map(len, chosen)) == count:
            break
        if len(chosen[i]) + 1 < kv_heads:
            chosen[i].append(h)
    return [sorted(c) for c in chosen]


