"""The `dofattn eval` job: a student, an export or any supported model scored against its teacher on text (whole
plain files too), lm-eval tasks and long-context recall, as one `EvalConfig` asks.

    result = run(EvalConfig(model="runs/long-context", num_blocks=4, out=None))    # what `dofattn eval` does
    result["ppl"] / result["teacher_ppl"], result["by_position"]["ratio"]

The measures are `evaluate`'s and `recall`'s, and here the per-layer errors (`layer_errors`, which read the
layerwise stage's l2 loss); this module loads the models, reads the text, runs what is asked for and writes the
JSON and the figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from dofattn.errors import UserError
from dofattn.io import check_output, new_name
from dofattn.jobs import no_grad
from dofattn.options import DATA_HELP, Machine, option
from dofattn.recipe import DEFAULT_RUN


ERROR_ROWS = 256   # query rows of a block longer than LONG_ROWS that the kernel error reads
LONG_ROWS = 512    # every row of a block up to this long (eval's default blocks)
LONG_BLOCK = 2048  # blocks (and task prompts) longer than this go one at a time by default (--batch-size auto)


def batch_of(cfg: EvalConfig, longest: int) -> int:
    """Blocks or task prompts per forward pass: `cfg.batch_size`, or by default 2, 1 past `LONG_BLOCK` tokens."""
    return cfg.batch_size or (1 if longest > LONG_BLOCK else 2)


@no_grad
def layer_errors(student, blocks, batch_size: int = 2, progress: bool = True) -> dict:
    """Per layer, on the teacher's own q/k/v: relative error of the linear attention output against softmax
    attention (‖o_lin − o_soft‖ / ‖o_soft‖), and the row-scaled L2 kernel error of PRF maps (the distillation's
    l2 loss; None for other maps). The kernel error is only comparable between students trained with the l2 loss:
    the softmax loss leaves the kernel's overall scale free. Layers left as softmax get None.

    Memory stays bounded at length: the outputs come from the attention kernels (no T × T), the kernel error reads
    `ERROR_ROWS` evenly spaced rows of a block longer than `LONG_ROWS`, and the forward computes no logits (`eval`
    sends blocks longer than `LONG_BLOCK` one at a time)."""
    import torch

    from dofattn.model.attach import bounded_of, linear_of
    from dofattn.model.capture import capture, run_forward
    from dofattn.distill.losses import l2_loss
    from dofattn.evaluate import blocks_in_batches, teacher_mode
    from dofattn.ops.softmax import expand_kv, softmax_attention
    from dofattn.model.student import attention_modules, linear_parts

    modules = attention_modules(student)
    num, den = [0.0] * len(modules), [0.0] * len(modules)
    kernel = [[] for _ in modules]

    def sink(a) -> None:
        linear, bounded = linear_of(modules[a.layer]), bounded_of(modules[a.layer])
        if linear is None:
            return
        query, key, value = a.query, a.key, a.value
        if bounded is not None:          # exact heads beside the linear ones: the linear heads' error
            query, key, value = bounded.heads.split(query, key, value, dim=2)[1]
        k, v = expand_kv(key, query.shape[2]), expand_kv(value, query.shape[2])
        exact = softmax_attention(query, k, v, a.scaling)                    # [B, T, H, D]
        approx = linear(query, key, value)
        num[a.layer] += (approx.float() - exact).square().sum().item()
        den[a.layer] += exact.square().sum().item()
        if linear.feature_map.estimates_kernel:             # the kernel error compares kernel values
            T = a.query.shape[1]
            at = None if T <= LONG_ROWS else torch.linspace(0, T - 1, ERROR_ROWS, device=k.device).long()
            kernel[a.layer].append(l2_loss(linear, query, k, v, a.scaling, at).item())

    device = next(student.parameters()).device
    with teacher_mode(student), capture(student, sink):
        for batch in tqdm(blocks_in_batches(blocks, batch_size), desc="layer errors", unit="batch",
                          disable=not progress, leave=False):
            run_forward(student, batch.to(device))
    linear = linear_parts(student)
    return {"output_error": [math.sqrt(n / d) if i in linear and d > 0 else None
                             for i, (n, d) in enumerate(zip(num, den))],
            "kernel_error": [sum(k) / len(k) if k else None for k in kernel]}


# --- `dofattn eval` -------------------------------------------------------------------------------------------------

@dataclass
class EvalConfig(Machine):
    """What `run` evaluates, on what, and where it writes; the fields are `dofattn eval`'s options of the same
    names (`dofattn eval --help` says more). `out` None: no JSON; a plot None: no figure."""

    model: str = option(DEFAULT_RUN, "student folder (from dofattn distill; the default recipe's run "
                                             "folder unless given), dofattn export, or any supported model")
    teacher: str | None = option(None, "another model to compare against (same tokenizer); default: the base "
                                       "model")
    data: str = option("wiki-sample", DATA_HELP)
    split: str | None = option(None, "train, validation or all (default: validation where --data has wiki-sample "
                                     "or hf: in it, all for files alone)")
    seq_len: int = option(512, "tokens per block")
    num_blocks: int | None = option(None, "blocks to evaluate (0: no perplexity, e.g. with --recall alone); auto: "
                                          "8, or where --data is plain .txt files, all of their text (the last "
                                          "block shorter)", none="auto")
    layer_blocks: int = option(2, "blocks used for the per-layer errors")
    batch_size: int | None = option(None, "blocks (or task prompts) per forward pass; auto: 2, or 1 where they are "
                                          "longer than 2048 tokens (memory bounded at length)",
                                    none="auto")
    tasks: list[str] | None = option(None, "also run zero-shot lm-eval tasks on the student and its teacher, "
                                           "comma-separated (piqa,arc_easy,arc_challenge,winogrande,logiqa,wsc273,"
                                           "mmlu need the hub; RULER's niah_single_1 ... built offline at "
                                           "--task-lengths; local ones via --task-path)")
    task_path: str | None = option(None, "folder of local lm-eval task YAMLs")
    verbose: bool = option(False, "with --tasks: show what lm-eval prints (its downloads, log lines, progress bars)",
                           short="-v")
    task_lengths: list[int] | None = option(None, "prompt lengths in tokens of the synthetic long-context tasks "
                                                  "(RULER's), each scored apart, e.g. 4096,8192; default 4096",
                                            none="default")
    out: str | None = option("auto", "where to write the JSON result; auto: eval.json in the student's run folder "
                                     "(else in this folder), or eval-2.json, ... where one is there already")
    plot: str | None = option(None, "also write a figure of the per-layer errors (.png, .pdf or .svg)")
    plot_positions: str | None = option(None, "also write a figure of perplexity and KL by context length (.png, "
                                              ".pdf or .svg)")
    recall: list[str] | None = option(None, "long-context recall tasks, comma-separated: passkey, multikey")
    lengths: list[int] | None = option(None, "comma-separated prompt lengths in tokens (answer included) of the "
                                             "recall tasks; auto: 1024, 2048, ... up to the model's context",
                                       none="auto")
    beyond_context: bool = option(False, "allow --seq-len and --lengths past the model's context (the teacher's "
                                         "positions there are untrained; a student's bounded layers may "
                                         "extrapolate)")
    extend_to: int | None = option(None, "read both models to this many tokens, past the context they were made "
                                         "for (SmolLM2: 8192): their RoPE scaled by YaRN to it, in every layer, "
                                         "without YaRN's attention temperature; a little worse within the context "
                                         "(docs/RESULTS.md)", none="off")
    depths: int = option(5, "depths of the hidden fact per length, evenly spaced from 0 (the filler's start) to 1 "
                            "(just before the question)")
    prompts: int | None = option(None, "prompts a cell: --recall's per task, length and depth, each with its own "
                                       "fact, keys and filler (auto: 1); --tasks' at most this many per task and "
                                       "length (auto: all)", none="auto", was=("samples", "limit"))
    plot_recall: str | None = option(None, "also write a figure of recall accuracy by length and depth (.png, "
                                           ".pdf or .svg)")
    teacher_answers: str | None = option(None, "the teacher's recall answers or task scores from an earlier eval "
                                               "JSON of the same prompts (--recall: same --data, --lengths, --depths, "
                                               "--prompts; --tasks: same teacher, --prompts, --dtype, --extend-to, "
                                               "every task and length in it), instead of running the teacher again")


DEFAULT_BLOCKS = 8        # --num-blocks auto, where the text is not plain .txt files
FIGURES = ("plot", "plot_positions", "plot_recall")


def plain_text(data: str) -> bool:
    """Whether `data` is plain .txt files alone (one, or several joined by +)."""
    from dofattn.data import sources

    return all(Path(part).expanduser().is_file() and Path(part).suffix == ".txt" for part in sources(data))


def text_blocks(data: str, tokenizer, seq_len: int, split: str = "all") -> list[torch.Tensor]:
    """Every token of `data`'s documents in `split`, in their order (EOS between documents, where the tokenizer has
    one), in blocks of `seq_len` and a last shorter one: [[N, seq_len], [1, rest]] (either part left out when
    empty; a rest that leaves nothing to predict, too), each led by the tokenizer's `leading_tokens` (its BOS where
    it puts one first). Scoring them predicts every token but each block's first; with a BOS, every text token."""
    import torch

    from dofattn.data import led, leading_tokens, text_length, texts

    ids: list[int] = []
    for i, text in enumerate(texts(data, split)):
        if i and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    lead = leading_tokens(tokenizer)
    if len(ids) + len(lead) < 2:
        raise UserError(f"{data} ({split} split) has {len(ids)} tokens; scoring needs at least 2")
    text_len = text_length(seq_len, lead)
    full = len(ids) // text_len * text_len
    whole = torch.tensor(ids, dtype=torch.long)
    parts = [whole[:full].view(-1, text_len)] if full else []
    parts += [whole[full:][None]] if len(ids) - full + len(lead) >= 2 else []
    return [led(part, lead) for part in parts]


def check(cfg: EvalConfig) -> dict[str, Path]:
    """Everything about `cfg` that can be checked before a model loads; -> the output paths ({"out": ..., and each
    figure asked for})."""
    from dofattn.data import check_source, check_split
    from dofattn.jobs import check_default_run
    from dofattn.options import check_extend_to
    from dofattn.spec import is_student

    check_default_run(cfg.model)
    out = cfg.out
    if out == "auto":
        out = str(new_name(Path(cfg.model) / "eval.json" if is_student(cfg.model) else "eval.json"))
    paths = {"out": check_output(out, "--out", (".json",))} if out else {}
    paths.update({name: check_output(path, "--" + name.replace("_", "-"), (".png", ".pdf", ".svg"))
                  for name in FIGURES if (path := getattr(cfg, name))})
    check_source(cfg.data)
    if cfg.split is not None:
        check_split(cfg.split, "--split")
    if cfg.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, got {cfg.seq_len}")
    if cfg.task_path and not Path(cfg.task_path).is_dir():
        raise UserError(f"--task-path {cfg.task_path} is not a folder of lm-eval task YAMLs")
    if cfg.task_lengths is not None and (not cfg.tasks or min(cfg.task_lengths, default=0) < 1):
        raise UserError("--task-lengths gives positive prompt lengths of --tasks, e.g. --tasks niah_single_1 "
                        "--task-lengths 4096,8192")
    if cfg.prompts is not None and (cfg.prompts < 1 or not (cfg.recall or cfg.tasks)):
        raise UserError(f"--prompts {cfg.prompts}: give at least 1 prompt a cell of --recall or --tasks")
    if (cfg.num_blocks or 0) < 0 or cfg.layer_blocks < 0 or (cfg.batch_size is not None and cfg.batch_size < 1):
        raise UserError("--batch-size must be >= 1, --num-blocks and --layer-blocks >= 0")
    check_extend_to(cfg.extend_to)
    if cfg.teacher_answers and cfg.recall is None and not cfg.tasks:
        raise UserError("--teacher-answers gives the teacher's recall answers or task scores: use it with --recall "
                        "or --tasks")
    if cfg.teacher_answers and not Path(cfg.teacher_answers).is_file():
        raise UserError(f"--teacher-answers {cfg.teacher_answers} does not exist; give an earlier eval JSON")
    if cfg.num_blocks == 0 and not (cfg.recall or cfg.tasks):
        raise UserError("--num-blocks 0 leaves nothing to evaluate; add --recall or --tasks, or score some blocks")
    if cfg.recall is not None:
        from dofattn.recall import check_grid, check_tasks

        check_tasks(cfg.recall)
        check_grid(cfg.depths, cfg.prompts or 1)
    return paths


def run(cfg: EvalConfig, progress=None) -> dict:
    """`dofattn eval`: the student `cfg.model` against its teacher, as `cfg` asks (see `EvalConfig`); returns what
    it writes to `cfg.out`. `progress(text)` gets each table as it is ready and each file written (print, say;
    None: quiet).

        result = run(EvalConfig(model="runs/window", data="notes.txt", out=None))   # a plain file, scored whole
        result["tokens"], result["ppl"], result["kl"]
    """
    say = progress or (lambda text: None)
    paths = check(cfg)                  # on the options alone: before torch and transformers are imported
    if cfg.tasks:                       # the names too (kept from lm-eval's last index: `lm_tasks`)
        from dofattn.lm_tasks import check_tasks

        task_manager = check_tasks(cfg.tasks, cfg.task_path)
    from dofattn.data import WIKI_SAMPLE, sources
    from dofattn.evaluate import format_comparison, format_layer_errors, format_tasks, lm_eval_tasks
    from dofattn.jobs import load_for_job
    from dofattn.model.hf import (context_length, extend_context, machine_dtype, refuse_config_only, resolve_device,
                                  use_threads)

    refuse_config_only(cfg.model, "eval")
    refuse_config_only(cfg.teacher, "eval --teacher")
    use_threads(cfg.threads)
    held_out = any(part == WIKI_SAMPLE or part.startswith("hf:") for part in sources(cfg.data))
    split = cfg.split or ("validation" if held_out else "all")
    device = resolve_device(cfg.device)
    dtype = machine_dtype(cfg.dtype, device)
    model, tokenizer, _ = load_for_job(cfg.model, dtype=dtype, device=device)
    if cfg.extend_to:
        extend_context(model, cfg.extend_to)
    context = context_length(model.config)
    exact_blocks = cfg.num_blocks != 0 and not (cfg.num_blocks is None and plain_text(cfg.data))   # of --seq-len
    if exact_blocks and context and cfg.seq_len > context and not cfg.beyond_context:
        raise UserError(past_context(cfg.seq_len, context))
    if cfg.task_lengths and context and max(cfg.task_lengths) > context and not cfg.beyond_context:
        raise UserError(f"--task-lengths {max(cfg.task_lengths)} is past the model's context of {context} tokens: "
                        f"add --extend-to {max(cfg.task_lengths)}, or --beyond-context")
    if cfg.recall is not None:
        from dofattn.recall import resolve_lengths

        lengths = resolve_lengths(cfg.lengths, context, cfg.beyond_context)
    teacher_name, teacher = load_teacher(cfg, dtype, device)
    from dofattn.model.install import is_base

    itself = teacher is None and is_base(model)      # a base model, scored alone: its teacher is itself
    if itself:
        say(f"{cfg.model} is not a student: its teacher is itself (ratio 1, KL 0; text and tasks are scored once); "
            f"give a run folder or an export, or --teacher OTHER to compare two models")
    result = {"model": cfg.model, "teacher": teacher_name or "base model", "data": cfg.data, "split": split,
              **({"extend_to": cfg.extend_to} if cfg.extend_to else {})}
    if cfg.tasks:                       # the teacher's scores reused: checked before anything runs
        result["task_setup"] = task_setup(cfg, teacher_name, str(dtype).removeprefix("torch."))
        reused = reused_task_scores(cfg, result["task_setup"]) if cfg.teacher_answers else None
    errors = {}
    if cfg.num_blocks != 0:
        result.update(score_text(cfg, model, tokenizer, teacher, split, context))
        errors = {key: result[key] for key in ("output_error", "kernel_error") if key in result}
        say(format_comparison(result))
    if errors:
        say(format_layer_errors(errors))
    if cfg.recall is not None:
        from dofattn import recall

        result["recall"] = recall.grid(model, tokenizer, cfg.recall, lengths, cfg.depths, cfg.prompts or 1,
                                       data=cfg.data, split=split, teacher=teacher, teacher_answers=cfg.teacher_answers)
        say(recall.format_recall(result["recall"]))
    if cfg.tasks:
        from dofattn.evaluate import teacher_mode

        def run_tasks(m, who):
            heard = lambda length, now: say(f"{who} at {length} tokens: "  # noqa: E731
                                            + ", ".join(f"{task} {value:.4f}" for task, value in now.items()))
            return lm_eval_tasks(m, tokenizer, cfg.tasks, cfg.task_path, cfg.prompts,
                                 batch_of(cfg, max(cfg.task_lengths or [4096])),
                                 cfg.task_lengths, scored=heard, verbose=cfg.verbose, manager=task_manager)

        result["tasks"] = run_tasks(model, "student")
        if reused is not None:
            result["teacher_tasks"], result["teacher_answers"] = reused, cfg.teacher_answers
        elif itself:
            result["teacher_tasks"] = result["tasks"]
        elif teacher is not None:
            result["teacher_tasks"] = run_tasks(teacher, "teacher")
        else:
            with teacher_mode(model):                # the student's own base model: its softmax attention
                result["teacher_tasks"] = run_tasks(model, "teacher")
        say(format_tasks(result["tasks"], result["teacher_tasks"]))
    write_outputs(cfg, paths, result, errors, split, say)
    return result


def task_setup(cfg: EvalConfig, teacher_name: str | None, dtype: str) -> dict:
    """What the teacher's task scores depend on besides the tasks and lengths: saved with them, compared where
    --teacher-answers reuses them."""
    from dofattn.model.exported import is_any_student, spec_of

    teacher = teacher_name or (spec_of(cfg.model).base_model if is_any_student(cfg.model) else cfg.model)
    return {"teacher": teacher, "prompts": cfg.prompts, "dtype": dtype, "extend_to": cfg.extend_to,
            "task_path": cfg.task_path}


def reused_task_scores(cfg: EvalConfig, setup: dict) -> dict:
    """The teacher's scores of `cfg.tasks` (at `cfg.task_lengths` for the synthetic ones) from the eval JSON
    `cfg.teacher_answers`, checked before the student runs: the same `task_setup`, every task and length there."""
    path = cfg.teacher_answers
    try:
        earlier = json.loads(Path(path).read_text())
        scores, theirs = earlier["teacher_tasks"], earlier["task_setup"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--teacher-answers {path} is not an eval JSON with the teacher's task scores and their "
                        f"setup; run the teacher once with --tasks (this version), or drop it") from None
    differ = [f"{key} {theirs.get(key)!r} there, {value!r} here" for key, value in setup.items()
              if theirs.get(key) != value]
    if differ:
        raise UserError(f"--teacher-answers {path} scored another setup ({'; '.join(differ)}); run the same, or "
                        f"drop it")
    lengths = [str(n) for n in cfg.task_lengths or [4096]]
    found = {}
    for task in cfg.tasks:
        score = scores.get(task)
        by_length = isinstance(score, dict) and all(key.isdigit() for key in score)    # a synthetic task's
        missing = [n for n in lengths if n not in score] if score and by_length else []
        if not score or missing:
            raise UserError(f"--teacher-answers {path} has no teacher score for {task}"
                            f"{' at ' + ', '.join(missing) if missing else ''}; run the same --tasks and "
                            f"--task-lengths, or drop it")
        found[task] = {n: score[n] for n in lengths} if by_length else score
    return found


def load_teacher(cfg: EvalConfig, dtype, device: str):
    """(its name, the teacher model) of `cfg.teacher`; (None, None): the student's own base model (`teacher_mode`),
    unless an export's base weights carry merged adapters: then its base model, loaded."""
    from dofattn.model.exported import is_any_student, lora_merged, spec_of
    from dofattn.model.hf import extend_context, load_model

    name = cfg.teacher
    if not name and is_any_student(cfg.model) and lora_merged(cfg.model):
        name = spec_of(cfg.model).base_model
    if not name:
        return None, None
    teacher = load_model(name, dtype=dtype, device=device)[0]
    if cfg.extend_to:
        extend_context(teacher, cfg.extend_to)
    return name, teacher


def past_context(seq_len: int, context: int) -> str:
    return (f"--seq-len {seq_len} is past the model's context of {context} tokens: add --extend-to {seq_len} (RoPE "
            f"scaled to it), or --beyond-context to score it as it is")


def score_text(cfg: EvalConfig, model, tokenizer, teacher, split: str, context: int | None) -> dict:
    """The student against its teacher on the text's blocks (`evaluate.compare`), and each layer's errors on the
    first `cfg.layer_blocks` of them."""
    from dofattn.data import token_blocks
    from dofattn.evaluate import compare, first_blocks

    if cfg.num_blocks is None and plain_text(cfg.data):
        blocks = text_blocks(cfg.data, tokenizer, cfg.seq_len, split)
    else:
        blocks = token_blocks(cfg.data, tokenizer, cfg.seq_len, cfg.num_blocks or DEFAULT_BLOCKS, split=split,
                              seed=0)
    longest = max(b.shape[-1] for b in (blocks if isinstance(blocks, list) else [blocks]))
    if context and longest > context and not cfg.beyond_context:
        raise UserError(past_context(cfg.seq_len, context))
    batch = batch_of(cfg, longest)
    found = {"seq_len": cfg.seq_len, **compare(model, blocks, teacher, batch)}
    if cfg.layer_blocks:
        found.update(layer_errors(model, first_blocks(blocks, cfg.layer_blocks), batch))
    return found


def write_outputs(cfg: EvalConfig, paths: dict, result: dict, errors: dict, split: str, say) -> None:
    """The result's JSON and plots where `cfg` asks for them (`check`'s paths)."""
    from dofattn.io import write_atomic

    if "out" in paths:
        write_atomic(paths["out"], json.dumps(result, indent=2))
        say(f"wrote {paths['out']}")
    if "plot" in paths and errors:
        from dofattn.plots import plot_layer_errors

        plot_layer_errors(errors, paths["plot"], title=f"{cfg.model} vs {result['teacher']}")
        say(f"wrote {paths['plot']}")
    if "plot_positions" in paths and cfg.num_blocks != 0:
        from dofattn.plots import plot_by_position

        plot_by_position({cfg.model: result["by_position"]}, paths["plot_positions"],
                         title=f"{cfg.data} ({split}), blocks of {cfg.seq_len} tokens")
        say(f"wrote {paths['plot_positions']}")
    if "plot_recall" in paths and cfg.recall is not None:
        from dofattn.plots import plot_recall

        plot_recall(result["recall"], paths["plot_recall"], title=f"{cfg.model}: recall against the teacher")
        say(f"wrote {paths['plot_recall']}")


