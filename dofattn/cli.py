"""The `dofattn` command line: one verb per stage, each verb's options a dataclass whose field help is `--help`.

    dofattn dof                                   # DoF per layer of SmolLM2-135M on the Wikipedia sample
    dofattn dof --model gpt2 --lam 0.0625 --out gpt2-dof.json --plot gpt2-dof.png

Errors in what was asked for print one line (`dofattn: error: ...`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dofattn import __version__
from dofattn.errors import UserError
from dofattn.io import write_atomic


DATA_HELP = ("wiki-sample, a .txt/.jsonl/.parquet file or folder, hf:NAME[:CONFIG[:SPLIT]], or several of these "
             "joined by + (pooled)")


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class DofArgs:
    """Estimate the degrees of freedom of every attention head's softmax kernel and allocate feature dims.

    Runs the model over a data sample, keeps J query/key points per head, and computes
    DoF(λ) = tr G(G+λI)⁻¹ of the kernel exp(qᵀk/√d) on them. Each layer's DoF is the max over its heads; layers
    get feature dimensions proportional to their DoF, with mean --budget. Writes a JSON file (input to
    `--dims` of later stages) and optionally a plot, and prints a per-layer table.
    """

    model: str = _opt("smollm2-135m", "built-in alias (smollm2-135m), hub id, model folder, or .gguf file")
    data: str = _opt("wiki-sample", DATA_HELP)
    split: str = _opt("train", "data split to sample from: train, validation or all")
    samples: int = _opt(1024, "J: query/key points sampled per head (cost grows as J^3)")
    repeats: int = _opt(1, "pool R estimates on R disjoint sets of J points each (R·J points are sampled): the "
                           "allocation uses the mean DoF and the table shows its spread")
    lam: float = _opt(2.0 ** -8, "λ; with --lam-scale trace it is relative to the Gram matrix's trace")
    lam_auto: bool = _opt(False, "choose λ (trace-relative, 2^-2 ... 2^-14) whose dims give the least kernel error "
                                 "of random features at the budget, on 512 held-out points per head (uniform "
                                 "dims are shown for comparison); --lam is then ignored")
    lam_scale: str = _opt("trace", "trace: λ relative to tr G (scale-free, default); raw: the paper's absolute λ",
                          choices=("trace", "raw"))
    budget: int | None = _opt(None, "mean feature dimension per layer; the total budget x layers is kept exactly "
                                    "(default: the head size)")
    clip: bool = _opt(False, "cap every layer's dimension at the head size (the paper's DoF+clip)")
    attention: bool = _opt(False, "also the DoF of each layer's attention matrices (mean over heads and blocks, at "
                                  "--lam relative to their trace), which --keep-by attn-dof follows: shown beside "
                                  "the kernel's, with its top layers, and kept in the JSON. Costs a T³ SVD per head "
                                  "and block")
    num_blocks: int = _opt(32, "number of token blocks to run through the model")
    seq_len: int = _opt(256, "tokens per block")
    batch_size: int = _opt(4, "blocks per forward pass")
    seed: int = _opt(0, "seed for the data order and the point sample")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "model dtype: float32 or bfloat16 (DoF is always computed in float64)")
    out: str = _opt("dof.json", "where to write the JSON result")
    plot: str | None = _opt(None, "also write a figure of DoF and dims per layer (.png, .pdf or .svg)")


@dataclass
class GenerateArgs:
    """Generate text with a linearized student (or any supported model) and its constant-size state.

    --model takes a student folder written by `dofattn distill` (or `dofattn.student.save_student`), a folder
    written by `dofattn export`, or a base model (alias, hub id, folder, .gguf). With a base model, --dims
    linearizes it on the fly with untrained features (useful to check plumbing and speed, not quality); without
    --dims the base model generates as it is.
    """

    model: str = _opt("smollm2-135m", "student folder, dofattn export, or a base model: alias, hub id, folder or "
                                      ".gguf file")
    prompt: str = _opt("The history of mathematics", "text to continue")
    max_new_tokens: int = _opt(40, "number of tokens to generate")
    dims: str | None = _opt(None, "linearize a base model first: fix, fix:C or a dof.json file")
    feature: str = _opt("prf", "feature map when linearizing with --dims: prf, performer, hedgehog or dijiang")
    temperature: float = _opt(0.0, "0 for greedy decoding, > 0 to sample")
    static: bool = _opt(False, "greedy decoding on static buffers (dofattn.engine): a CUDA graph per token on CUDA; "
                               "needs every layer linear and --temperature 0")
    compile: bool = _opt(False, "with --static: compile the decode step with torch.compile (for the CPU; its first "
                                "step compiles, minutes on a small CPU, so it pays off for long generations)")
    seed: int = _opt(0, "seed for sampling and for untrained features")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "model dtype: float32 or bfloat16")


def run_generate(args: GenerateArgs) -> int:
    """The `generate` verb."""
    import torch

    from dofattn.export import is_export, load_export
    from dofattn.hf import load_model, parse_dtype
    from dofattn.student import is_student, linearize, load_student, resolve_dims

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature:g}")
    if args.static and args.temperature > 0:
        raise UserError("--static decodes greedily; drop --temperature or --static")
    if args.compile and not args.static:
        raise UserError("--compile compiles the static decoder's step; add --static")
    device, dtype = _resolve_device(args.device), parse_dtype(args.dtype)
    if is_student(args.model) or is_export(args.model):
        if args.dims:
            raise UserError(f"{args.model} is already a student; drop --dims")
        load = load_export if is_export(args.model) else load_student
        model, tokenizer, config = load(args.model, dtype=dtype, device=device, merge_lora=True)
        what = f"student of {config.base_model} ({config.feature}, dims {min(config.dims)}-{max(config.dims)})"
    else:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
        what = args.model
        if args.dims:
            dims = resolve_dims(args.dims, model, args.model)
            linearize(model, dims, args.feature, seed=args.seed)
            what += f" linearized with untrained {args.feature} features, dims {min(dims)}-{max(dims)}"
    torch.manual_seed(args.seed)
    inputs = tokenizer(args.prompt, return_tensors="pt").to(device)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    start = time.perf_counter()
    if args.static:
        from dofattn.engine import StaticDecoder

        decoder = StaticDecoder(model, compile=args.compile)
        out = decoder.generate(inputs["input_ids"], args.max_new_tokens, tokenizer.eos_token_id)
        what += ", static decoding" + (" with a CUDA graph" if decoder.graph else "")
        if "compile_s" in decoder.timings:
            what += f", compiled in {decoder.timings['compile_s']:.0f} s"
    else:
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 **sampling)
    elapsed = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1]:]
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
    print(f"[{what}: {len(new)} tokens in {elapsed:.2f} s, {len(new) / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


@dataclass
class DistillArgs:
    """Distil a linear-attention student from its softmax teacher, as a recipe says.

    A recipe (a TOML file) holds everything the run does: the student, the layerwise stage, the end-to-end phase,
    the evaluation. Pick one by name, change any key with --set (`dofattn recipes --keys` explains them), or pass a
    run folder's recipe.toml to make that run again. The run folder (--out) ends up a loadable student with log.json
    and recipe.toml; the same command resumes an interrupted run, or goes on when end_to_end.steps grew. It ends with
    the perplexity of the teacher, the student and an untrained Performer of the same feature budget.

        dofattn distill                                          # the default recipe
        dofattn distill --recipe paper --set student.dims=fix --out runs/paper-fix
        dofattn distill --recipe runs/paper-fix/recipe.toml --seed 1 --out runs/paper-fix-s1
        dofattn distill --model Qwen/Qwen2.5-1.5B --dry-run --world-size 8   # the plan, memory per GPU: no run
    """

    recipe: str | None = _opt(None, "a recipe name (below) or a .toml file; default: default, or with "
                                    "--continue-from that run's recipe")
    set: list[str] | None = _opt(None, "change one recipe key, e.g. --set student.window=32 (repeatable)",
                                 action="append", metavar="KEY=VALUE")
    model: str | None = _opt(None, "the teacher (run.model): built-in alias smollm2-135m, hub id, folder or .gguf")
    data: str | None = _opt(None, "training text (run.data): " + DATA_HELP)
    eval_data: str | None = _opt(None, "the text scored, its validation split (run.eval_data); default: --data",
                                 metavar="TEXT")
    seed: int | None = _opt(None, "seed of the features, the data order and the DoF sample (run.seed)")
    dtype: str | None = _opt(None, "the frozen model's dtype (run.dtype): float32 or bfloat16")
    out: str = _opt("runs/distill", "run folder: created, or resumed when it holds a run of the same recipe")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    time_limit: float = _opt(0.0, "minutes of end-to-end training, then save and evaluate; the same command goes "
                                  "on later (0: no limit)", metavar="MIN")
    continue_from: str | None = _opt(None, "go on from a copy of this run folder's student with more end-to-end "
                                           "steps or other text (--out is the new folder)", metavar="RUN")
    dry_run: bool = _opt(False, "print the plan from the model's config only, and stop")
    world_size: int | None = _opt(None, "processes the plan is for (default: WORLD_SIZE or 1)", metavar="N")
    json: bool = _opt(False, "with --dry-run: the plan as JSON")


RUN_FLAGS = ("model", "data", "eval_data", "seed", "dtype")    # flags that set the recipe's [run] keys


def run_distill(args: DistillArgs) -> int:
    """The `distill` verb."""
    from dofattn import recipe as recipes

    if args.time_limit < 0:
        raise UserError(f"--time-limit must be >= 0 minutes (0: none), got {args.time_limit:g}")
    name = args.recipe
    if name is None:
        name = str(Path(args.continue_from) / "recipe.toml") if args.continue_from else "default"
        if args.continue_from and not Path(name).is_file():
            raise UserError(f"--continue-from {args.continue_from} is not a dofattn distill run folder: it has no "
                            f"recipe.toml")
    overrides = {f"run.{k}": getattr(args, k) for k in RUN_FLAGS if getattr(args, k) is not None}
    recipe = recipes.load(name, args.set or [], overrides)
    if args.dry_run:
        return _dry_run(recipe, args)
    if args.world_size is not None or args.json:
        raise UserError("--world-size and --json go with --dry-run (a run's processes are torchrun's)")
    if recipe.student.lora_rank:                  # before hours of layerwise training, not after
        from dofattn.lora import require_peft
        require_peft()
    from dofattn.distill.run import run

    log = run(recipe, args.out, _resolve_device(args.device), args.time_limit, args.continue_from)
    if log.get("evaluation"):
        print(format_evaluation(recipe, log))
        print(f"student saved in {args.out} (dofattn generate --model {args.out})")
    return 0


def _dry_run(recipe, args: DistillArgs) -> int:
    """`distill --dry-run`: the plan (`distill.plan`), from the model's config alone; nothing is written."""
    import os

    from dofattn.distill.plan import make_plan

    world = args.world_size
    if world is None:
        text = os.environ.get("WORLD_SIZE", "1")
        if not text.isdigit():
            raise UserError(f"WORLD_SIZE={text!r} is not a number of processes; unset it or give --world-size N")
        world = int(text)
    if world < 1:
        raise UserError(f"--world-size {world}: give >= 1 processes")
    plan = make_plan(recipe, world)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())
    return 0


def format_evaluation(recipe, log: dict) -> str:
    """The perplexity table `dofattn distill` ends with."""
    ev = log["evaluation"]
    rows = [("teacher", ev["teacher_ppl"], None)]
    if "layerwise_student_ppl" in ev:
        rows.append(("student after the layerwise stage", ev["layerwise_student_ppl"], ev["layerwise_vs_teacher"]))
    rows.append((f"student (recipe {recipe.name})", ev["student_ppl"], ev["student_vs_teacher"]))
    rows.append((f"untrained performer ({ev['performer_dim']})", ev["performer_ppl"], ev["performer_vs_teacher"]))
    lines = [f"\nvalidation perplexity ({ev['tokens']} tokens, blocks of {ev['seq_len']}):"]
    for label, ppl, ratio in rows:
        lines.append(f"  {label:<40}{ppl:10.2f}" + (f"  ({ratio:.2f}x teacher)" if ratio else ""))
    lines.append(f"  dims per layer ({recipe.student.dims}): {' '.join(map(str, log['dims']))}")
    if log.get("softmax_layers"):
        lines.append(f"  softmax layers: {' '.join(map(str, log['softmax_layers']))}")
    lines.append("  wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in log["seconds"].items()))
    return "\n".join(lines)


@dataclass
class RecipesArgs:
    """The recipes `dofattn distill --recipe` takes, one recipe resolved, or every recipe key explained.

        dofattn recipes                       # the packaged recipes, one line each
        dofattn recipes long                  # every key of one recipe, resolved, as TOML (a file --recipe takes)
        dofattn recipes --keys                # every key: type, default, meaning
    """

    name: str | None = _opt(None, "a recipe name or .toml file to print resolved", positional=True)
    keys: bool = _opt(False, "every recipe key with its type, default and meaning")


def run_recipes(args: RecipesArgs) -> int:
    """The `recipes` verb."""
    from dofattn import recipe as recipes

    if args.keys:
        print(recipes.describe_keys())
    elif args.name:
        print(recipes.load(args.name).to_toml(), end="")
    else:
        print(recipe_lines())
    return 0


def recipe_lines() -> str:
    from dofattn import recipe as recipes

    return "\n".join(f"  {name:<14}{line}" for name, line in recipes.packaged().items())


@dataclass
class EvalArgs:
    """Evaluate a linearized student against its teacher on held-out text.

    Reports perplexity of both, the mean per-token KL(teacher || student), top-1 agreement of their next-token
    predictions, and per layer (on the teacher's own queries, keys and values) the relative error of the linear
    attention output against softmax attention and the L2 kernel error of PRF features. Also by context length:
    the predictions that see 1, 2-3, 4-7, ... tokens, each bucket's perplexities and KL, which tell a student that
    falls behind at long range (a gap growing with the context) from one that is off everywhere. Writes
    everything to --out and, with --plot / --plot-positions, figures of the per-layer errors and of the buckets.
    Without --teacher the teacher is the student's own base model.

    Long context: --seq-len 8192 --num-blocks 4 --batch-size 1 scores the validation articles joined into blocks of
    8 K tokens, by position. --recall passkey,multikey asks both models for a fact hidden at --depths depths of
    prompts of --lengths tokens: a five-digit pass key in repeated filler, and one of four magic numbers in the
    data's text (RULER's multi-key needle). A prompt counts when the model's greedy answer is exactly right; chance
    is about 0. --plot-recall draws the accuracy per length and depth; each prompt also records the cache the model
    holds per sequence there. --num-blocks 0 skips the perplexity; --teacher-answers reuses an earlier run's
    teacher answers (the teacher's half of the time).
    """

    model: str = _opt("runs/distill", "student folder (from dofattn distill), dofattn export, or any supported "
                                      "model")
    teacher: str | None = _opt(None, "another model to compare against (same tokenizer); default: the base model")
    data: str = _opt("wiki-sample", DATA_HELP)
    split: str | None = _opt(None, "train, validation or all (default: validation where --data has wiki-sample "
                                   "or hf: in it, all for files alone)")
    seq_len: int = _opt(512, "tokens per block")
    num_blocks: int = _opt(8, "blocks to evaluate (0: no perplexity, e.g. with --recall alone)")
    layer_blocks: int = _opt(2, "blocks used for the per-layer errors")
    batch_size: int = _opt(2, "blocks per forward pass")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "model dtype: float32 or bfloat16")
    tasks: str | None = _opt(None, "also run zero-shot lm-eval tasks, comma-separated (piqa,arc_easy,arc_challenge,"
                                   "winogrande,logiqa,wsc273,mmlu need the hub; local ones via --task-path)")
    task_path: str | None = _opt(None, "folder of local lm-eval task YAMLs")
    limit: int | None = _opt(None, "evaluate at most this many examples per lm-eval task")
    out: str = _opt("eval.json", "where to write the JSON result")
    plot: str | None = _opt(None, "also write a figure of the per-layer errors (.png, .pdf or .svg)")
    plot_positions: str | None = _opt(None, "also write a figure of perplexity and KL by context length (.png, .pdf "
                                            "or .svg)")
    recall: str | None = _opt(None, "long-context recall tasks, comma-separated: passkey, multikey")
    lengths: str = _opt("auto", "comma-separated prompt lengths in tokens (answer included) of the recall tasks; "
                                "auto: 1024, 2048, ... up to the model's context")
    depths: int = _opt(5, "depths of the hidden fact per length, evenly spaced from 0 (the filler's start) to 1 "
                          "(just before the question)")
    samples: int = _opt(1, "recall prompts per task, length and depth, each with its own fact, keys and filler")
    plot_recall: str | None = _opt(None, "also write a figure of recall accuracy by length and depth (.png, .pdf "
                                         "or .svg)")
    teacher_answers: str | None = _opt(None, "the teacher's recall answers from an earlier eval JSON of the same "
                                             "prompts (same --data, --lengths, --depths, --samples), instead of "
                                             "running the teacher again")


def run_eval(args: EvalArgs) -> int:
    """The `eval` verb."""
    import json

    from dofattn.data import WIKI_SAMPLE, check_source, sources, token_blocks
    from dofattn.evaluate import compare, layer_errors
    from dofattn.export import is_export, load_export, lora_merged
    from dofattn.hf import load_model, parse_dtype
    from dofattn.student import is_student, load_student

    out = _check_output(args.out, "--out", (".json",))
    figures = {name: _check_output(path, "--" + name.replace("_", "-"), (".png", ".pdf", ".svg"))
               for name in ("plot", "plot_positions", "plot_recall") if (path := getattr(args, name))}
    check_source(args.data)
    if args.task_path and not Path(args.task_path).is_dir():
        raise UserError(f"--task-path {args.task_path} is not a folder of lm-eval task YAMLs")
    if args.num_blocks < 0 or args.layer_blocks < 0 or args.batch_size < 1:
        raise UserError("--batch-size must be >= 1, --num-blocks and --layer-blocks >= 0")
    if args.teacher_answers and not args.recall:
        raise UserError("--teacher-answers gives the teacher's recall answers: use it with --recall")
    if args.num_blocks == 0 and not (args.recall or args.tasks):
        raise UserError("--num-blocks 0 leaves nothing to evaluate; add --recall or --tasks, or score some blocks")
    recall_tasks = _recall_tasks(args.recall) if args.recall else []
    if args.teacher_answers and not Path(args.teacher_answers).is_file():
        raise UserError(f"--teacher-answers {args.teacher_answers} does not exist; give an eval JSON with recall")
    if recall_tasks:
        from dofattn.recall import check_grid

        check_grid(args.depths, args.samples)
    held_out = any(part == WIKI_SAMPLE or part.startswith("hf:") for part in sources(args.data))
    split = args.split or ("validation" if held_out else "all")
    device, dtype = _resolve_device(args.device), parse_dtype(args.dtype)
    teacher_name = args.teacher
    if is_export(args.model):
        model, tokenizer, spec = load_export(args.model, dtype=dtype, device=device)
        if lora_merged(args.model) and not teacher_name:   # its own base weights carry the merged adapters
            teacher_name = spec.base_model
    elif is_student(args.model):
        model, tokenizer, _ = load_student(args.model, dtype=dtype, device=device)
    else:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    lengths = _recall_lengths(args.lengths, model.config) if recall_tasks else []
    teacher = load_model(teacher_name, dtype=dtype, device=device)[0] if teacher_name else None
    result = {"model": args.model, "teacher": teacher_name or "base model", "data": args.data, "split": split}
    errors = {}
    if args.num_blocks:
        blocks = token_blocks(args.data, tokenizer, args.seq_len, args.num_blocks, split=split, seed=0)
        result.update(seq_len=args.seq_len, **compare(model, blocks, teacher, args.batch_size))
        errors = layer_errors(model, blocks[:args.layer_blocks]) if args.layer_blocks else {}
        result.update(errors)
        print(f"{'':>22}{'student':>12}{'teacher':>12}")
        ratio = result["ppl"] / result["teacher_ppl"]
        print(f"{'perplexity':>22}{result['ppl']:12.2f}{result['teacher_ppl']:12.2f}   ({ratio:.2f}x)")
        print(f"{'KL(teacher||student)':>22}{result['kl']:12.4f}")
        print(f"{'top-1 agreement':>22}{result['top1_agreement']:12.3f}")
        print(format_positions(result["by_position"]))
    if errors:
        print(f"\n{'layer':>5}  {'output error':>12}  {'kernel error':>12}")
        for i, (o, k) in enumerate(zip(errors["output_error"], errors["kernel_error"])):
            print(f"{i:>5}  {'softmax' if o is None else f'{o:.4f}':>12}  {'-' if k is None else f'{k:.3g}':>12}")
    if recall_tasks:
        result["recall"] = _run_recall(args, model, teacher, tokenizer, split, recall_tasks, lengths)
        print(format_recall(result["recall"]))
    if args.tasks:
        from dofattn.evaluate import lm_eval_tasks

        result["tasks"] = lm_eval_tasks(model, tokenizer, [t.strip() for t in args.tasks.split(",") if t.strip()],
                                        args.task_path, args.limit, args.batch_size)
        print()
        for task, metrics in result["tasks"].items():
            print(f"{task:>22}  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    write_atomic(out, json.dumps(result, indent=2))
    print(f"wrote {out}")
    if "plot" in figures and errors:
        from dofattn.plots import plot_layer_errors

        plot_layer_errors(errors, figures["plot"], title=f"{args.model} vs {result['teacher']}")
        print(f"wrote {figures['plot']}")
    if "plot_positions" in figures and args.num_blocks:
        from dofattn.plots import plot_by_position

        plot_by_position({args.model: result["by_position"]}, figures["plot_positions"],
                         title=f"{args.data} ({split}), blocks of {args.seq_len} tokens")
        print(f"wrote {figures['plot_positions']}")
    if "plot_recall" in figures and recall_tasks:
        from dofattn.plots import plot_recall

        plot_recall(result["recall"], figures["plot_recall"], title=f"{args.model}: recall against the teacher")
        print(f"wrote {figures['plot_recall']}")
    return 0


def _recall_tasks(spec: str) -> list[str]:
    from dofattn.recall import TASKS

    names = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise UserError(f"--recall {spec!r}: unknown task {', '.join(unknown) or '(none)'}; use "
                        f"{', '.join(TASKS)}, comma-separated")
    return names


def _recall_lengths(spec: str, config) -> list[int]:
    """--lengths: 'auto' (1024, 2048, ... up to the model's context) or comma-separated token counts."""
    from dofattn.hf import context_length

    context = context_length(config)
    if spec == "auto":
        if not context:
            raise UserError("the model names no context length; pass --lengths, e.g. --lengths 1024,2048,4096")
        lengths = [1024]
        while lengths[-1] * 2 <= context:
            lengths.append(lengths[-1] * 2)
        return lengths if lengths[-1] <= context else [context]
    from dofattn.bench import parse_ints

    lengths = parse_ints(spec, "--lengths (or auto)")
    if context and max(lengths) > context:
        raise UserError(f"--lengths {spec!r}: {max(lengths)} tokens is beyond the model's context of {context}")
    return lengths


def _run_recall(args: EvalArgs, model, teacher, tokenizer, split: str, names: list[str], lengths: list[int]) -> dict:
    import contextlib

    from dofattn.data import load_texts
    from dofattn.evaluate import teacher_mode
    from dofattn.recall import RecallTasks, describe, evaluate_recall, make_prompts, record_key

    @contextlib.contextmanager
    def own_teacher():
        with teacher_mode(model):
            yield model

    documents = load_texts(args.data, split) if "multikey" in names else []
    tasks = RecallTasks(tokenizer, documents, seed=0)
    prompts = make_prompts(tasks, names, lengths, args.depths, args.samples)
    models, given = {"student": lambda: contextlib.nullcontext(model)}, {}
    if args.teacher_answers:        # checked before the student runs: the same prompts, every one answered
        given["teacher"] = _teacher_answers(args.teacher_answers)
        missing = next((p for p in prompts if record_key(describe(p, tokenizer)) not in given["teacher"]), None)
        if missing is not None:
            raise UserError(f"--teacher-answers {args.teacher_answers} has no teacher answer for {missing.task} at "
                            f"{missing.length} tokens, depth {missing.depth:g}, sample {missing.sample}; run the "
                            f"same --recall, --lengths, --depths, --samples and --data, or drop it")
    else:
        models["teacher"] = (lambda: contextlib.nullcontext(teacher)) if teacher is not None else own_teacher
    result = evaluate_recall(models, tasks, prompts, given)
    if given:
        result["teacher_answers"] = args.teacher_answers
    return {"lengths": lengths, "depths": args.depths, "samples": args.samples, **result}


def _teacher_answers(path: str) -> dict:
    """{`recall.record_key`: the teacher's answer} from an eval JSON with recall."""
    import json

    from dofattn.recall import record_key

    try:
        return {record_key(r): r["teacher"] for r in json.loads(Path(path).read_text())["recall"]["records"]}
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--teacher-answers {path} is not an eval JSON with recall answers") from None


def format_recall(recall: dict) -> str:
    """Accuracy per task and length, student against teacher, and the cache each holds per sequence there."""
    from dofattn.recall import accuracy, cache_at

    tasks = list(dict.fromkeys(r["task"] for r in recall["records"]))
    lines = [f"\n{'length':>8}" + "".join(f"{task + ' ' + who:>18}" for task in tasks for who in ("student", "teacher"))
             + f"{'cache MiB student':>18}{'teacher':>9}"]
    for length in recall["lengths"]:
        lines.append(f"{length:>8}" + "".join(f"{accuracy(recall, who, task, length):18.2f}" for task in tasks
                                              for who in ("student", "teacher"))
                     + "".join(f"{'-' if size is None else f'{size / 2 ** 20:.1f}':>{width}}" for size, width in
                               ((cache_at(recall, "student", length), 18), (cache_at(recall, "teacher", length), 9))))
    n = len(recall["records"]) // (len(tasks) * len(recall["lengths"]))
    lines.append(f"({n} prompts per task and length; accuracy is the share answered exactly)")
    return "\n".join(lines)


def format_positions(rows: dict) -> str:
    """The `by_position` buckets as a table: context length, predictions, both perplexities, their ratio, KL."""
    lines = [f"\n{'context':>11}{'tokens':>8}{'student':>10}{'teacher':>10}{'ratio':>8}{'KL':>8}"]
    for a, b, n, s, t, r, kl in zip(*(rows[k] for k in ("context_from", "context_to", "tokens", "ppl",
                                                          "teacher_ppl", "ratio", "kl"))):
        span = f"{a}" if a == b else f"{a}-{b}"
        lines.append(f"{span:>11}{n:>8}{s:10.2f}{t:10.2f}{r:8.3f}{kl:8.3f}")
    return "\n".join(lines)


def _add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if meta.pop("positional", False):
            parser.add_argument(f.name, nargs="?", default=f.default, help=help_text)
            continue
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        shown = f"{f.default:g}" if isinstance(f.default, float) else f.default
        suffix = f" (default: {shown})" if f.default is not None else ""
        parser.add_argument(flag, type=kind, default=f.default, help=help_text + suffix, **meta)


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} was asked for but no CUDA device is available; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto")
    return name


def _check_output(path: str, what: str, suffixes: tuple[str, ...]) -> Path:
    out = Path(path)
    if out.suffix.lower() not in suffixes:
        raise UserError(f"{what} {path} should end in {' or '.join(suffixes)}")
    if out.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file name")
    if not out.parent.is_dir():
        raise UserError(f"{what} folder {out.parent} does not exist; create it first")
    return out


def run_dof(args: DofArgs) -> int:
    """The `dof` verb: capture, spectra, allocation, table, JSON, plot."""
    from dofattn.data import SPLITS, check_source, token_blocks
    from dofattn.dof import (HELDOUT_POINTS, allocate_dims, allocate_dims_auto, attention_dofs, check_sample_size,
                             sample_points)
    from dofattn.hf import load_model, parse_dtype

    # everything that can be checked without the model is checked before it loads
    out = _check_output(args.out, "--out", (".json",))
    plot = _check_output(args.plot, "--plot", (".png", ".pdf", ".svg")) if args.plot else None
    if args.samples < 2:
        raise UserError(f"--samples must be at least 2, got {args.samples}")
    if args.lam <= 0:
        raise UserError(f"--lam must be positive, got {args.lam:g}")
    if args.budget is not None and args.budget < 1:
        raise UserError(f"--budget is the mean feature dimension per layer and must be >= 1, got {args.budget}")
    check_source(args.data)
    if args.split not in SPLITS:
        raise UserError(f"unknown --split {args.split!r}; use one of {', '.join(SPLITS)}")
    if args.num_blocks < 1 or args.batch_size < 1:
        raise UserError("--num-blocks and --batch-size must be at least 1")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    if args.lam_auto and args.lam_scale != "trace":
        raise UserError("--lam-auto searches trace-relative λ; drop --lam-scale raw")
    heldout = HELDOUT_POINTS if args.lam_auto else 0
    check_sample_size(args.samples * args.repeats + heldout, args.num_blocks, args.seq_len)
    device, dtype = _resolve_device(args.device), parse_dtype(args.dtype)

    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    blocks = token_blocks(args.data, tokenizer, args.seq_len, args.num_blocks, split=args.split, seed=args.seed)
    sample = sample_points(model, blocks, args.samples * args.repeats + heldout, args.batch_size, args.seed)
    budget = args.budget or sample.head_dim
    meta = {"model": args.model, "data": args.data, "num_blocks": args.num_blocks, "seq_len": args.seq_len}
    if args.lam_auto:
        train, held = sample.split(args.samples * args.repeats)
        result = allocate_dims_auto(train, held, budget, args.clip, args.repeats, progress=True, **meta)
        print(format_lam_search(result))
    else:
        result = allocate_dims(sample, args.lam, budget, args.clip, args.lam_scale, progress=True,
                               repeats=args.repeats, **meta)
    if args.attention:
        for layer, heads in zip(result.layers, attention_dofs(model, blocks, result.lam)):
            layer.attention_dof = sum(heads) / len(heads)
    elapsed = time.perf_counter() - start

    print(format_table(result))
    if args.attention:
        order = sorted(result.layers, key=lambda layer: (-layer.attention_dof, layer.layer))
        print("largest attention DoF (what student.keep_softmax = K keeps): layers "
              f"{', '.join(str(layer.layer) for layer in order[:5])}")
    print(f"total dim {sum(result.dims)} = {len(result.dims)} layers x mean {sum(result.dims) / len(result.dims):g}"
          f"{' (clipped)' if args.clip else ''}; {elapsed:.1f} s")
    for warning in result.warnings():
        print(f"WARNING: {warning}", file=sys.stderr)
    write_atomic(out, result.to_json())
    print(f"wrote {out}")
    if plot:
        from dofattn.plots import plot_dof

        plot_dof(result, plot)
        print(f"wrote {plot}")
    return 0


def format_lam_search(result) -> str:
    rows = [f"{'λ':>10}  {'held-out attention error':>24}  {'DoF max/min':>11}  {'dims':>9}"]
    for row in result.lam_search:
        lam = "uniform" if row["lam"] is None else f"2^{math.log2(row['lam']):.0f}"
        mark = " <- chosen" if row["lam"] == result.lam else ""
        rows.append(f"{lam:>10}  {row['attention_error']:>24.4g}  {row['dof_spread']:>11.2f}  "
                    f"{min(row['dims']):>4}-{max(row['dims']):<4}{mark}")
    return "\n".join(rows)


def format_table(result) -> str:
    spread = result.repeats > 1
    attention = any(layer.attention_dof is not None for layer in result.layers)
    std_header = f"  {'± std':>6}" if spread else ""
    attention_header = f"  {'attn DoF':>8}" if attention else ""
    rows = [f"{'layer':>5}  {'DoF max':>8}{std_header}  {'DoF min':>8}  {'dim':>5}  {'head dims':>12}"
            f"{attention_header}"]
    for layer in result.layers:
        heads = f"{min(layer.head_dims)}-{max(layer.head_dims)}"
        std = f"  {layer.dof_std:>6.2f}" if spread else ""
        attn = f"  {layer.attention_dof:>8.2f}" if attention else ""
        rows.append(f"{layer.layer:>5}  {layer.dof:>8.2f}{std}  {min(layer.head_dof):>8.2f}  {layer.dim:>5}  "
                    f"{heads:>12}{attn}")
    return "\n".join(rows)


@dataclass
class BenchArgs:
    """Time the student's attention and generation against softmax attention (SDPA) on this machine.

    Prefill: one layer's causal attention over T tokens (SDPA vs PRF features + linear attention, the linear op
    alone, and the sliding-window hybrid). Decode: one token against a context of T (SDPA over a KV cache vs one
    step on the constant-size state). Generation: --model and its linearized student (untrained features; speed
    does not depend on training) prefill a prompt and generate greedily. Medians of --repeats runs; a JSON with the
    hardware goes to --out.
    """

    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("auto", "float32 or bfloat16; auto: bfloat16 on CUDA, float32 on CPU")
    seq_lens: str = _opt("auto", "comma-separated T for prefill and decode; auto: 512,2048 on CPU, "
                                 "2048,8192,32768,131072 on CUDA")
    heads: int = _opt(9, "attention heads of the op benchmarks")
    head_dim: int = _opt(64, "head size of the op benchmarks")
    features: int = _opt(64, "feature dimension M of the student")
    window: int = _opt(64, "window of the hybrid rows (0: skip them)")
    sink: int = _opt(4, "sink tokens of the second hybrid row, beside the window (0: skip it)")
    decode_batch: int = _opt(1, "batch size of the decode benchmark")
    repeats: int = _opt(5, "timed runs per measurement (the median is reported)")
    model: str = _opt("smollm2-135m", "model for the generation benchmark; 'none' skips it")
    gen_contexts: str = _opt("auto", "comma-separated prompt lengths for generation; auto: 512 on CPU, 2048,8192,32768 "
                                     "on CUDA")
    new_tokens: int = _opt(16, "tokens generated after each prompt")
    parts: str = _opt("prefill,decode,generation", "which measurements to run (comma-separated)")
    compile: bool = _opt(False, "also time the students' static decoder compiled with torch.compile (for the CPU): "
                                "minutes of compilation per student, and once more at a second prompt length; "
                                "the first is reported as compile_ms")
    out: str = _opt("bench.json", "where to write the JSON result (rewritten after each part)")


def run_bench(args: BenchArgs) -> int:
    """The `bench` verb."""
    from dofattn.bench import BenchConfig, bench, format_tables, parse_ints

    out = _check_output(args.out, "--out", (".json",))
    device = _resolve_device(args.device)
    cuda = device.startswith("cuda")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    seq_lens = parse_ints(args.seq_lens if args.seq_lens != "auto" else
                          ("2048,8192,32768,131072" if cuda else "512,2048"), "--seq-lens")
    contexts = parse_ints(args.gen_contexts if args.gen_contexts != "auto" else
                          ("2048,8192,32768" if cuda else "512"), "--gen-contexts")
    cfg = BenchConfig(device=device, dtype=dtype, seq_lens=seq_lens, heads=args.heads, head_dim=args.head_dim,
                      features=args.features, window=args.window, sink=args.sink, decode_batch=args.decode_batch,
                      repeats=args.repeats, model=None if args.model == "none" else args.model,
                      gen_contexts=contexts, new_tokens=args.new_tokens,
                      parts=[p.strip() for p in args.parts.split(",") if p.strip()], compile=args.compile)
    result = bench(cfg, save=lambda partial: write_atomic(out, json.dumps(partial, indent=2)))
    print(format_tables(result))
    write_atomic(out, json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


@dataclass
class SampleArgs:
    """Write text sampled from the teacher, as a .jsonl training source for `dofattn distill --data`.

    Each sample is a prompt cut from the train split of --data (never its validation split), continued by the model
    for --new-tokens tokens at --temperature (1 samples the model's own distribution). Pool it with the real text
    and keep scoring on held-out real text:

        dofattn sample --samples 2000 --out teacher.jsonl
        dofattn distill --data wiki-sample+teacher.jsonl --eval-data wiki-sample ...

    Samples are appended one batch at a time; the same command goes on after an interruption.
    """

    model: str = _opt("smollm2-135m", "the teacher: alias, hub id, folder or .gguf file")
    data: str = _opt("wiki-sample", "where the prompts come from (its train split): " + DATA_HELP)
    samples: int = _opt(1000, "number of samples to write in all")
    prompt_tokens: int = _opt(32, "tokens of real text each sample starts from")
    new_tokens: int = _opt(480, "tokens the model adds to each prompt")
    temperature: float = _opt(1.0, "sampling temperature (> 0)")
    batch_size: int = _opt(32, "samples generated together")
    seed: int = _opt(0, "seed for the prompts and the sampling")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "model dtype: float32 or bfloat16 (sample with the teacher a bfloat16 distill "
                                 "run compares against)")
    out: str = _opt("teacher-text.jsonl", "the .jsonl file to write or go on with")


def run_sample(args: SampleArgs) -> int:
    """The `sample` verb."""
    from dofattn.data import check_source
    from dofattn.hf import load_model, parse_dtype
    from dofattn.sample import SampleSpec, check, done_samples, sample_text

    out = Path(args.out).expanduser()
    if out.suffix != ".jsonl":
        raise UserError(f"--out {args.out} must end in .jsonl")
    check_source(args.data)
    spec = SampleSpec(model=args.model, data=args.data, prompt_tokens=args.prompt_tokens,
                      new_tokens=args.new_tokens, temperature=args.temperature, batch_size=args.batch_size,
                      seed=args.seed)
    check(spec, args.samples)
    done_samples(out, spec)                        # refuse a foreign file before loading the model
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=_resolve_device(args.device))
    start = time.perf_counter()
    result = sample_text(model, tokenizer, spec, args.samples, out)
    elapsed = time.perf_counter() - start
    tokens = result["new"] * args.new_tokens
    rate = f", {tokens / elapsed:.0f} new tokens/s" if result["new"] else ""
    print(f"{out}: {result['samples']} samples of {args.prompt_tokens}+{args.new_tokens} tokens "
          f"({result['new']} new in {elapsed:.0f} s{rate})")
    return 0


@dataclass
class ExportArgs:
    """Write a student as a Hugging Face model folder that transformers loads where dofattn is installed.

    AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True) gives the student. OUT gets config.json (the
    base config and the student's spec), modeling_dofattn.py, model.safetensors (every weight; the student's own
    tensors in float32; shards past 5 GB), the tokenizer, a generation config and a model card with the run's
    evaluation numbers. `dofattn eval` and `dofattn generate` take OUT as --model.

        dofattn export --model runs/distill --out exports/student
        dofattn export --model runs/long --out exports/long --merge-lora --dtype bfloat16
    """

    model: str = _opt("runs/distill", "a dofattn distill run folder, or a student folder")
    out: str | None = _opt(None, "the folder to write: new, empty, or a previous export (replaced)")
    merge_lora: bool = _opt(False, "fold LoRA adapters into the projection weights (no peft needed to load; the "
                                   "base model is then no longer inside); without it they are kept as peft layers")
    dtype: str = _opt("float32", "dtype of the base model's weights: float32, bfloat16 or float16")


def run_export(args: ExportArgs) -> int:
    """The `export` verb."""
    from dofattn.export import export

    if not args.out:
        raise UserError("give --out DIR, the folder to write the export to")
    out = export(args.model, args.out, merge_lora=args.merge_lora, dtype=args.dtype)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({size / 2 ** 20:.1f} MiB); load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, "
          f"trust_remote_code=True) or dofattn generate --model {out}")
    return 0


VERBS = {"dof": (DofArgs, run_dof), "distill": (DistillArgs, run_distill), "recipes": (RecipesArgs, run_recipes),
         "eval": (EvalArgs, run_eval),
         "generate": (GenerateArgs, run_generate), "bench": (BenchArgs, run_bench),
         "sample": (SampleArgs, run_sample), "export": (ExportArgs, run_export)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dofattn",
        description="Turn a pretrained softmax-attention LM into a linear-attention one, with feature "
                    "dimensions allocated by the degrees of freedom of each layer's attention kernel.")
    parser.add_argument("--version", action="version", version=f"dofattn {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (cls, _) in VERBS.items():
        doc = (cls.__doc__ or "").strip()
        epilog = "recipes:\n" + recipe_lines() if name == "distill" else None
        sub = verbs.add_parser(name, help=doc.splitlines()[0], description=doc, epilog=epilog,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_arguments(sub, cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.verb is None:
        parser.print_help()
        return 2
    cls, run = VERBS[ns.verb]
    args = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
    try:
        return run(args)
    except UserError as err:
        print(f"dofattn: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dofattn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
