"""The `dofattn distill` job: recipe in, a trained and evaluated student in the run folder out."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dofattn.distill import choose, end_to_end, run_folder
from dofattn.distill.layerwise import layerwise
from dofattn.distill.teacher import TeacherStream
from dofattn.distill.world import barrier, join, world
from dofattn.evaluate import compare, perplexity
from dofattn.recipe import DOF_DIMS, Recipe
from dofattn.spec import Attention
from dofattn.distill.choose import linear_layers, resolve_dims


@dataclass
class DistillConfig:
    """One run: the recipe (resolved, whole: `recipe.load`), the run folder, the device and how long it trains.
    `dofattn distill` builds it from its options."""

    recipe: Recipe
    out: str | Path | None = None    # the run folder; None: runs/<recipe name>, so that no recipe overwrites another's
    device: str = "cpu"
    time_limit: float = 0.0          # minutes of end-to-end training, then save and evaluate (0: no limit)
    continue_from: str | Path | None = None   # go on from a copy of this run folder's student
    world_size: int = 1              # the processes the room check plans for (torchrun's)
    force: bool = False              # start even where the plan exceeds free memory or disk (`plan.check_room`)

    @property
    def folder(self) -> Path:
        """The run folder: `out`, or runs/<recipe name>."""
        return Path(self.out or f"runs/{self.recipe.name}")


class Stages:
    """Each stage's wall time and peak resident memory, into the run log (`seconds`, `peak_rss`, bytes): a stage
    begun again (setup, after the DoF stage and the softmax choice) adds its time and keeps its larger peak."""

    def __init__(self, log: run_folder.RunLog):
        self.log, self.name, self.start = log, None, 0.0

    def begin(self, name: str) -> None:
        from dofattn.memory import reset_resident_peak

        self.end()
        self.name, self.start = name, time.perf_counter()
        reset_resident_peak()

    def end(self, before: float = 0.0) -> None:
        """Close the current stage; `before`: its seconds in an earlier call of the same run (end-to-end resumed)."""
        from dofattn.memory import resident_peak

        if self.name is None:
            return
        seconds, peak = time.perf_counter() - self.start + before, resident_peak()
        self.log.seconds[self.name] = round(self.log.seconds.get(self.name, 0) + seconds, 1)
        if peak is not None:
            self.log.peak_rss[self.name] = max(self.log.peak_rss.get(self.name, 0), peak)
        self.name = None

    def keep(self, finished: dict, names: tuple[str, ...]) -> None:
        """A finished run's figures for the stages this call does not run again."""
        for name in names:
            if name in finished.get("seconds", {}):
                self.log.seconds[name] = finished["seconds"][name]
            if name in finished.get("peak_rss", {}):
                self.log.peak_rss[name] = finished["peak_rss"][name]


def check_inputs(recipe: Recipe, weights: bool = True) -> None:
    """What a run reads before it trains, checked before anything loads (also by `distill --dry-run`, which plans
    from a config alone: `weights` False): its text sources, and a local model folder's weights and tokenizer."""
    from dofattn.data import check_source
    from dofattn.model.hf import check_tokenizer, refuse_config_only

    if weights:
        refuse_config_only(recipe.run.model, "distill (without --dry-run)")
    for source in filter(None, (recipe.run.data, recipe.run.eval_data)):
        check_source(source)
    check_tokenizer(recipe.run.model)


def run(cfg: DistillConfig, progress=None) -> dict:
    """The whole job; returns the run log (also out/log.json). After `time_limit` minutes of end-to-end training
    the student is saved and evaluated as it is (the same call later goes on). `progress(text)` gets the lines of
    process 0 (print, say), and with it the stages show their bars; None: quiet."""
    from dofattn.recipe import resolve_dtype

    r, out, device, time_limit, continue_from = cfg.recipe, cfg.folder, cfg.device, cfg.time_limit, cfg.continue_from
    r = resolve_dtype(r, device)                   # auto: what this device computes fast, recorded in the folder
    from dofattn.model.hf import load_model, parse_dtype
    from dofattn.model.student import attention_modules, build, fingerprint, is_student_tensor, save_student

    check_inputs(r)
    if continue_from:                              # before the model loads: a refused copy costs nothing
        run_folder.check_continue(Path(continue_from), out, r)
    else:
        run_folder.refuse(out, r)
    from dofattn.distill.plan import check_room, make_plan

    plan = make_plan(r, cfg.world_size, device=device, timed=False)     # memory and disk, before anything loads
    if not cfg.force:
        check_room(plan, out)
    device = join(device)
    rank = world()[0]
    say = progress if progress is not None and rank == 0 else (lambda text: None)
    for line in plan.warnings:
        say(f"warning: {line}")
    bars = progress is not None and rank == 0
    torch.manual_seed(r.run.seed)
    log = run_folder.RunLog(recipe={"name": r.name, **r.keys()})
    stage = Stages(log)
    stage.begin("setup")

    model, tokenizer = load_model(r.run.model, dtype=parse_dtype(r.run.dtype), device=device)
    num_layers = len(attention_modules(model))
    if r.student.dims not in DOF_DIMS:      # a bad fix:C or another model's dof.json leaves no run folder
        resolve_dims(r.student.dims, model, r.run.model, "student.dims")
    candidates = linear_layers(r, model, [])   # all, or (local_layers = keep) all but sliding-window ones
    # the text is read before the run folder exists too: asking for more than the data holds leaves none behind
    nothing = not linear_layers(r, model)      # every layer that may be linearized kept bounded: none trains
    train, e2e_train, valid = read_blocks(choose.untrained(r) if nothing else r, tokenizer)
    finished, done_steps = open_folder(r, out, continue_from, rank, say)
    if finished and done_steps is None:
        return finished

    if not nothing:
        stage.begin("dof")
        dims = choose.dims(r, model, tokenizer, out)
        stage.begin("softmax_choice")
        chosen = choose.softmax_layers(r, model, tokenizer, out, candidates)
    else:              # a model's own sliding-window layers beside every other kept bounded: no DoF, no choice
        from dofattn.model.student import head_layout

        dims, chosen = [head_layout(model)[2]] * num_layers, candidates      # read by no layer
    linear = linear_layers(r, model, chosen)
    exact = choose.exact_heads(r, model, tokenizer, out, linear)
    stage.begin("setup")                           # the student built: setup goes on
    kept = [i for i in range(num_layers) if i not in candidates or i in chosen]
    spec = r.student_spec(dims, linear, base=fingerprint(model), exact_heads=exact)
    build(model, spec)
    if nothing:                                    # the recipe as given is in the folder; its stages are these
        r = choose.untrained(r)
    for name, p in model.named_parameters():       # only the student's tensors ever train
        p.requires_grad_(is_student_tensor(name))
    log.dims, log.softmax_layers = dims, kept
    stage.end()

    layerwise_stage(r, model, out, train, valid, log, stage, finished, done_steps, bars)
    e2e = r.end_to_end
    if e2e.steps:
        stage.begin("end_to_end")
        log.end_to_end = end_to_end.train(model, e2e_train, out, e2e, r.run.seed, valid, time_limit=60 * time_limit,
                                          progress=bars)
        skipped = log.end_to_end.get("skipped_steps", [])
        if skipped and rank == 0:
            print(f"WARNING: {len(skipped)} of {e2e.steps} end-to-end steps skipped, their gradients not finite (steps "
                  f"{', '.join(str(i + 1) for i in skipped[:8])}{' ...' if len(skipped) > 8 else ''}): the student "
                  f"trained on the rest; a layer whose keys get no feature (the layerwise warning) is the usual cause",
                  flush=True)
        if world()[1] > 1 and log.end_to_end["steps"]:   # FSDP left the weights sharded: rank 0 builds them whole
            del model
            if rank == 0:
                model, _ = load_model(r.run.model, dtype=parse_dtype(r.run.dtype), device=device)
                build(model, spec)
                end_to_end.load_trained(model, out)
        stage.end(before=finished["seconds"].get("end_to_end", 0) if finished else 0)
    if rank == 0:
        save_student(model, out, spec)
        stage.begin("evaluate")
        log.evaluation.update(evaluate(r, model, valid, dims))
        if "layerwise_student_ppl" in log.evaluation:
            log.evaluation["layerwise_vs_teacher"] = (log.evaluation["layerwise_student_ppl"]
                                                      / log.evaluation["teacher_ppl"])
        stage.end()
        run_folder.write_log(out, asdict(log))
    barrier()
    return asdict(log)


def read_blocks(r: Recipe, tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layerwise blocks, end-to-end blocks, validation blocks) of the recipe's text: under torchrun each process
    tokenizes a share of the documents, and all get the same blocks."""
    from dofattn.data import token_blocks

    lw, e2e, share = r.layerwise, r.end_to_end, world()
    if lw.steps or e2e.steps:
        train = token_blocks(r.run.data, tokenizer, lw.seq_len, lw.blocks, split="train", seed=r.run.seed, share=share)
    else:                                          # nothing trains (`choose.untrained`): no training text
        train = torch.zeros(0, lw.seq_len, dtype=torch.long)
    e2e_train = train
    if e2e.steps and (r.end_to_end_blocks, e2e.seq_len) != tuple(train.shape):
        e2e_train = token_blocks(r.run.data, tokenizer, e2e.seq_len, r.end_to_end_blocks,
                                 split="train", seed=r.run.seed, share=share)
    valid = token_blocks(r.run.eval_data or r.run.data, tokenizer, r.eval.seq_len, r.eval.blocks,
                         split="validation", seed=0, share=share)
    return train, e2e_train, valid


def open_folder(r: Recipe, out: Path, continue_from: str | None, rank: int, say) -> tuple[dict | None, int | None]:
    """The run folder made or checked (a copy of `continue_from` first), after the model loaded (a typo in the model
    leaves no folder): (its finished log or None, the end-to-end steps done; None: the run is complete, nothing
    to do)."""
    copied = False
    if rank == 0:
        if continue_from:
            copied = run_folder.copy_run(Path(continue_from), out, r)
        run_folder.check(out, r)
    barrier()
    finished = run_folder.RunFolder(out).log
    done = finished.get("end_to_end", {}) if finished else {}
    done_steps, stopped = done.get("steps", 0), bool(done.get("stopped"))
    if finished and not stopped and done_steps >= r.end_to_end.steps:
        say(f"{out} holds a finished run with this recipe; its results:")
        return finished, None
    if finished:
        why = (f"a copy of {continue_from}; its end-to-end phase goes on" if copied else
               "the end-to-end phase stopped at its time limit; going on" if stopped else
               "the end-to-end phase is asked for more steps; going on")
        say(f"{out}: {why} from step {done_steps} to {r.end_to_end.steps}")
    return finished, done_steps


def layerwise_stage(r: Recipe, model, out: Path, train: torch.Tensor, valid: torch.Tensor, log, stage,
                    finished: dict | None, done_steps: int, bars: bool) -> None:
    """The layerwise stage, or (going on with an end-to-end phase) what the finished one left: its per-layer log and
    times, and the student it saved if no end-to-end step was."""
    from dofattn.model.student import load_student_tensors

    lw, rank = r.layerwise, world()[0]
    if finished:            # going on with the end-to-end phase: the layerwise stage is done
        log.layers = finished.get("layers", {})
        stage.keep(finished, ("layerwise", "layerwise_eval"))
        before = finished.get("evaluation", {})
        if "layerwise_student_ppl" in before:
            log.evaluation["layerwise_student_ppl"] = before["layerwise_student_ppl"]
        elif not done_steps and lw.steps and "student_ppl" in before:      # it had no end-to-end phase
            log.evaluation["layerwise_student_ppl"] = before["student_ppl"]
        if not done_steps:  # its student was saved without end-to-end checkpoints
            load_student_tensors(model, out)
    elif lw.steps:
        stage.begin("layerwise")
        stream = TeacherStream(model, train, lw.batch_size, progress=bars)
        log.layers = layerwise(model, stream, out, lw, r.run.seed, progress=bars)
        stage.end()
        if r.end_to_end.steps and rank == 0:       # what the layerwise stage alone reached
            stage.begin("layerwise_eval")
            log.evaluation["layerwise_student_ppl"] = perplexity(model, valid, desc="layerwise student ppl")
            stage.end()


def evaluate(recipe: Recipe, model, blocks: torch.Tensor, dims: list[int]) -> dict:
    """On validation `blocks`: perplexity of the teacher, the student and an untrained Performer with the same
    budget, and the student's KL to the teacher, top-1 agreement and those by context length (`by_position`).

    The Performer is `model` itself once the student is scored: the student's parts removed, its LoRA adapters
    off, every layer linearized anew, so that no second copy of the model is loaded. `model` is spent after."""
    from dofattn.model.attach import detach
    from dofattn.model.lora import set_lora_enabled
    from dofattn.model.student import attention_modules, linearize

    against = compare(model, blocks)
    teacher, student = against["teacher_ppl"], against["ppl"]
    for module in attention_modules(model):             # the base model again
        detach(module)
    set_lora_enabled(model, False)
    budget = round(sum(dims) / len(dims))
    linearize(model, [budget] * len(dims), Attention(feature="performer", window=0, sink=0), seed=recipe.run.seed)
    performer = perplexity(model, blocks, desc="performer ppl")
    return {"tokens": blocks.numel(), "seq_len": recipe.eval.seq_len, "teacher_ppl": teacher, "student_ppl": student,
            "performer_ppl": performer, "performer_dim": budget, "student_vs_teacher": student / teacher,
            "performer_vs_teacher": performer / teacher, "kl": against["kl"],
            "top1_agreement": against["top1_agreement"], "by_position": against["by_position"]}
