"""Distil a linear-attention student from its softmax teacher, as a recipe says.

A recipe (a TOML file) holds everything the run does: student, layerwise stage, end-to-end phase, evaluation.
Pick one by name, change any key with --set (`dofattn recipes --keys` explains them), or pass a run folder's
recipe.toml to run it again. The run folder (--out) ends up a loadable student; the same command resumes an
interrupted run, or goes on when end_to_end.steps grew. It prints teacher's, student's and a Performer's perplexity.

    dofattn distill                                          # the default recipe, long-context
    dofattn distill --recipe paper --set student.dims=fix --out runs/paper-fix
    dofattn distill --recipe runs/paper-fix/recipe.toml --seed 1 --out runs/paper-fix-s1
    dofattn distill --model Qwen/Qwen2.5-1.5B --dry-run --world-size 8   # the plan, memory per GPU: no run
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dofattn.commands import add_verb, config
from dofattn.errors import UserError
from dofattn.options import DATA_HELP, Device, option


@dataclass
class DistillArgs(Device):
    """What a run is given beside its recipe: the recipe and its [run] keys, and where and how long it runs."""

    recipe: str | None = option(None, "a recipe name (below) or a .toml file; default: long-context, or with "
                                      "--continue-from that run's recipe")
    set: list[str] | None = option(None, "change one recipe key, e.g. --set student.window=32 (repeatable)",
                                   action="append", metavar="KEY=VALUE")
    model: str | None = option(None, "teacher (run.model): smollm2-135m, hub id, dir, .gguf")
    data: str | None = option(None, "training text (run.data): " + DATA_HELP)
    eval_data: str | None = option(None, "the text scored, its validation split (run.eval_data)", metavar="TEXT",
                                   none="--data")
    seed: int | None = option(None, "seed of features, data order, DoF sample (run.seed)")
    dtype: str | None = option(None, "the frozen model's dtype (run.dtype): float32 or bfloat16")
    out: str | None = option(None, "run folder: created, or resumed when it holds a run of the same recipe",
                             none="runs/RECIPE")
    time_limit: float = option(0.0, "end-to-end minutes (0: no limit)",
                               metavar="MIN")
    continue_from: str | None = option(None, "go on from a copy of this run's student (more steps, other text) in "
                                             "--out", metavar="RUN")
    dry_run: bool = option(False, "print the plan from the model's config only, and stop")
    world_size: int | None = option(None, "processes the plan is for (default: WORLD_SIZE or 1)", metavar="N")
    json: bool = option(False, "with --dry-run: the plan as JSON")
    recalibrate: bool = option(False, "with --dry-run: time the machine again")
    force: bool = option(False, "start even if the plan exceeds free memory or disk")


RUN_FLAGS = ("model", "data", "eval_data", "seed", "dtype")    # flags that set the recipe's [run] keys


def options() -> list[type]:
    return [DistillArgs]


def add_parser(verbs):
    from dofattn.commands.recipes import recipe_lines

    return add_verb(verbs, "distill", __doc__, options(),
                    epilog="recipes (what each reaches and costs: dofattn recipes):\n" + recipe_lines(brief=True))


def run(ns) -> int:
    """The `distill` verb."""
    from dofattn import recipe as recipes

    args = config(DistillArgs, ns)
    if args.time_limit < 0:
        raise UserError(f"--time-limit must be >= 0 minutes (0: none), got {args.time_limit:g}")
    name = args.recipe
    if name is None:
        name = str(Path(args.continue_from) / "recipe.toml") if args.continue_from else recipes.DEFAULT
        if args.continue_from and not Path(name).is_file():
            raise UserError(f"--continue-from {args.continue_from} is not a dofattn distill run folder: it has no "
                            f"recipe.toml")
    if args.out and Path(args.out).expanduser().exists() and not Path(args.out).expanduser().is_dir():
        raise UserError(f"--out {args.out} is a file: give a folder for the run (a new one, or a run to resume)")
    overrides = {f"run.{k}": getattr(args, k) for k in RUN_FLAGS if getattr(args, k) is not None}
    recipe = recipes.load(name, args.set or [], overrides)
    if args.dry_run:
        return dry_run(recipe, args)
    if args.world_size is not None or args.json or args.recalibrate:
        raise UserError("--world-size, --json and --recalibrate go with --dry-run (a run's processes are "
                        "torchrun's; a run measures itself)")
    if recipe.student.lora_rank:                  # before hours of layerwise training, not after
        from dofattn.model.lora import require_peft
        require_peft()
    from dofattn.distill.run import DistillConfig, run as distill
    from dofattn.model.hf import resolve_device, use_threads

    use_threads(args.threads)
    job = DistillConfig(recipe, args.out, resolve_device(args.device), args.time_limit, args.continue_from,
                        world_size(args), args.force)
    log = distill(job, progress=print)
    if log.get("evaluation"):
        print(format_evaluation(recipe, log))
        print(f"student saved in {job.folder} (dofattn generate --model {job.folder})")
    return 0


def world_size(args: DistillArgs) -> int:
    """The processes a plan is for: --world-size, else WORLD_SIZE (torchrun's), else 1."""
    import os

    world = args.world_size
    if world is None:
        text = os.environ.get("WORLD_SIZE", "1")
        if not text.isdigit():
            raise UserError(f"WORLD_SIZE={text!r} is not a number of processes; unset it or give --world-size N")
        world = int(text)
    if world < 1:
        raise UserError(f"--world-size {world}: give >= 1 processes")
    return world


def dry_run(recipe, args: DistillArgs) -> int:
    """`distill --dry-run`: the plan (`distill.plan`), from the model's config alone; nothing is written. The data,
    the model folder's tokenizer and the run folder are checked as the run would, before it reads them."""
    from dofattn.distill.plan import make_plan, no_room
    from dofattn.distill.run import check_inputs
    from dofattn.model.hf import resolve_device

    check_inputs(recipe, weights=False)
    folder = Path(args.out or f"runs/{recipe.name}")
    if not args.continue_from:                     # the folder the run would write, refused as the run refuses it
        from dofattn.distill.run_folder import refuse
        from dofattn.recipe import resolve_dtype

        refuse(folder, resolve_dtype(recipe, resolve_device(args.device)))
    plan = make_plan(recipe, world_size(args), device=resolve_device(args.device), recalibrate=args.recalibrate)
    plan.warnings += no_room(plan, folder)             # what the run would refuse without --force
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())
    return 0


def format_evaluation(recipe, log: dict) -> str:
    """The perplexity table `dofattn distill` ends with, from the run's log."""
    ev = log["evaluation"]
    rows = [("teacher", ev["teacher_ppl"], None)]
    linear = set(range(len(log["dims"]))) - set(log.get("softmax_layers") or [])
    if "layerwise_student_ppl" in ev and linear:
        rows.append(("student after the layerwise stage", ev["layerwise_student_ppl"], ev["layerwise_vs_teacher"]))
    rows.append((f"student (recipe {recipe.name})", ev["student_ppl"], ev["student_vs_teacher"]))
    rows.append((f"untrained performer ({ev['performer_dim']})", ev["performer_ppl"], ev["performer_vs_teacher"]))
    lines = [f"\nvalidation perplexity ({ev['tokens']} tokens, blocks of {ev['seq_len']}):"]
    for label, ppl, ratio in rows:
        lines.append(f"  {label:<40}{ppl:10.2f}" + (f"  ({ratio:.2f}x teacher)" if ratio else ""))
    if linear:
        lines.append(f"  dims per layer ({recipe.student.dims}): {' '.join(map(str, log['dims']))}")
    else:
        lines.append("  nothing linearized: the model's own sliding-window layers as they are, every other layer exact "
                     "and bounded after the prompt (student.select), as the teacher on a block read as one prompt")
    if log.get("softmax_layers"):
        lines.append(f"  softmax layers: {' '.join(map(str, log['softmax_layers']))}")
    peaks = log.get("peak_rss", {})
    lines.append("  wall time (peak memory): " + ", ".join(
        f"{k} {v:.0f} s" + (f" ({peaks[k] / 2 ** 30:.2f} GiB)" if k in peaks else "") for k, v in log["seconds"].items()))
    if peaks:          # each stage starts its peak afresh (clear_refs), which resets what `time -v` reports too
        lines.append(f"  the run's peak: {max(peaks.values()) / 2 ** 30:.2f} GiB resident, in {max(peaks, key=peaks.get)} "
                     f"(/usr/bin/time's maximum resident set misses the stages before the last: each resets the kernel's peak)")
    return "\n".join(lines)
