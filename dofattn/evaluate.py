"""Evaluation against the teacher: perplexity, KL, agreement, per-layer errors, by position; and `dofattn eval`.

    result = run(EvalConfig(model="runs/distill", num_blocks=4, out=None))    # what `dofattn eval` does
    result["ppl"] / result["teacher_ppl"], result["by_position"]["ratio"]

    with teacher_mode(student):            # linear layers bypassed: the original softmax model
        teacher_ppl = perplexity(student, blocks)
    student_ppl = perplexity(student, blocks)

`teacher_mode` works because a linearized model keeps every original weight: switching the attention
implementation back to SDPA skips the linear layers entirely, so no second copy of the model is needed.

Blocks are a tensor [N, T], or a list of such tensors of different lengths (`text_blocks`: a plain file scored
whole, its last block shorter); every function that scores blocks takes both.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dofattn.options import DATA_HELP, option
from dofattn.errors import UserError

Blocks = torch.Tensor | list[torch.Tensor]


def resolve_device(name: str) -> str:
    """`auto` -> cuda where there is one, else cpu; cpu, cuda and cuda:N as they are (a UserError for cuda without
    a CUDA device, or for any other name)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} was asked for but no CUDA device is available; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto")
    return name


def check_output(path: str, what: str, suffixes: tuple[str, ...]) -> Path:
    """`path` as a file that can be written, with one of `suffixes`; a UserError naming option `what` if not."""
    out = Path(path)
    if out.suffix.lower() not in suffixes:
        raise UserError(f"{what} {path} should end in {' or '.join(suffixes)}")
    if out.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file name")
    if not out.parent.is_dir():
        raise UserError(f"{what} folder {out.parent} does not exist; create it first")
    return out


@contextlib.contextmanager
def teacher_mode(model) -> Iterator[None]:
    """While active, `model` is its base model: softmax attention in every layer (its linear layers are ignored)
    and LoRA adapters, if any, switched off."""
    from dofattn.attention import IMPLEMENTATIONS
    from dofattn.hf import softmax_implementation
    from dofattn.lora import set_lora_enabled

    current = model.config._attn_implementation
    if current not in IMPLEMENTATIONS:
        yield
        return
    has_lora = set_lora_enabled(model, False)
    model.set_attn_implementation(softmax_implementation(model.config))
    try:
        yield
    finally:
        model.set_attn_implementation(current)
        if has_lora:
            set_lora_enabled(model, True)


def _log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities [B·(T−1), vocab] of `model` on ids [B, T], in float32."""
    log_p = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), -1)
    return log_p.reshape(-1, log_p.shape[-1])


def _nll(log_p: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed negative log-likelihood of `targets` [N] under `log_p` [N, vocab]."""
    return -log_p.gather(1, targets[:, None]).sum().item()


def _batches(blocks: Blocks, batch_size: int) -> list[torch.Tensor]:
    """`blocks` (a tensor [N, T] or a list of them) in batches of at most `batch_size` blocks of one length."""
    parts = [blocks] if isinstance(blocks, torch.Tensor) else blocks
    return [part[start:start + batch_size] for part in parts for start in range(0, len(part), batch_size)]


def first_blocks(blocks: Blocks, n: int) -> Blocks:
    """The first `n` blocks of `blocks` (a tensor [N, T] or a list of them)."""
    if isinstance(blocks, torch.Tensor):
        return blocks[:n]
    parts = []
    for part in blocks:
        if n > 0:
            parts.append(part[:n])
            n -= len(parts[-1])
    return parts


def count_blocks(blocks: Blocks) -> int:
    return len(blocks) if isinstance(blocks, torch.Tensor) else sum(len(part) for part in blocks)


@torch.no_grad()
def perplexity(model, blocks: Blocks, batch_size: int = 4, desc: str = "perplexity",
               progress: bool = True) -> float:
    """exp(mean next-token cross-entropy) over `blocks` [N, T] (T−1 predictions per block)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in tqdm(_batches(blocks, batch_size), desc=desc, unit="batch", disable=not progress, leave=False):
        ids = batch.to(device)
        total += _nll(_log_probs(model, ids), ids[:, 1:].reshape(-1))
        count += ids[:, 1:].numel()
    return math.exp(total / count)


class _Tally:
    """Running sums of the student-vs-teacher numbers over batches of next-token log-probs [N, vocab], N = B·(T−1)
    predictions of B blocks of T tokens: overall, and per prediction position (for `by_position`). Batches may
    have blocks of different lengths."""

    def __init__(self):
        self.student_nll = self.teacher_nll = self.kl = self.agree = 0.0
        self.count = 0
        self.at = torch.zeros(3, 0, dtype=torch.float64)   # student NLL, teacher NLL and KL summed per position
        self.seen = torch.zeros(0, dtype=torch.float64)    # predictions per position

    def add(self, log_s: torch.Tensor, log_t: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        """`length`: predictions per block (T − 1); rows of the batch come block after block."""
        nll_s = -log_s.gather(1, targets[:, None])[:, 0]
        nll_t = -log_t.gather(1, targets[:, None])[:, 0]
        kl = (log_t.exp() * (log_t - log_s)).sum(-1)
        per_position = torch.stack([nll_s, nll_t, kl]).double().reshape(3, -1, length).sum(1).cpu()
        if length > self.at.shape[1]:
            grow = length - self.at.shape[1]
            self.at = torch.cat([self.at, self.at.new_zeros(3, grow)], 1)
            self.seen = torch.cat([self.seen, self.seen.new_zeros(grow)])
        self.at[:, :length] += per_position
        self.seen[:length] += targets.numel() // length
        self.student_nll += nll_s.sum().item()
        self.teacher_nll += nll_t.sum().item()
        self.kl += kl.sum().item()
        self.agree += (log_s.argmax(-1) == log_t.argmax(-1)).sum().item()
        self.count += targets.numel()

    def result(self) -> dict:
        n = self.count
        return {"ppl": math.exp(self.student_nll / n), "teacher_ppl": math.exp(self.teacher_nll / n),
                "kl": self.kl / n, "top1_agreement": self.agree / n, "tokens": n,
                "by_position": by_position(self.at, self.seen)}


def by_position(sums: torch.Tensor, blocks: int | torch.Tensor) -> dict:
    """Per-position sums [3, T−1] (student NLL, teacher NLL, KL over `blocks` blocks, or over `blocks[t]` blocks at
    position t where blocks differ in length) pooled into buckets of context length that double: the prediction at
    position t sees t + 1 tokens, and bucket [a, b) holds the predictions that see a..b−1 of them (1, 2–3, 4–7,
    ...). Where in the context a student falls behind: a gap that grows with the context is the long range; one
    that starts at the first tokens is local."""
    length = sums.shape[1]
    seen = torch.full((length,), float(blocks), dtype=torch.float64) if isinstance(blocks, (int, float)) else blocks
    edges = [1]
    while edges[-1] <= length:
        edges.append(2 * edges[-1])
    edges[-1] = length + 1
    rows = {"context_from": [], "context_to": [], "tokens": [], "ppl": [], "teacher_ppl": [], "ratio": [], "kl": []}
    for a, b in zip(edges, edges[1:]):
        n = seen[a - 1:b - 1].sum().item()
        nll_s, nll_t, kl = (sums[:, a - 1:b - 1].sum(1) / n).tolist()
        for key, value in zip(rows, (a, b - 1, round(n), math.exp(nll_s), math.exp(nll_t),
                                     math.exp(nll_s - nll_t), kl)):
            rows[key].append(value)
    return rows


def format_positions(rows: dict) -> str:
    """The `by_position` buckets as a table: context length, predictions, both perplexities, their ratio, KL."""
    lines = [f"\n{'context':>11}{'tokens':>8}{'student':>10}{'teacher':>10}{'ratio':>8}{'KL':>8}"]
    for a, b, n, s, t, r, kl in zip(*(rows[k] for k in ("context_from", "context_to", "tokens", "ppl",
                                                          "teacher_ppl", "ratio", "kl"))):
        span = f"{a}" if a == b else f"{a}-{b}"
        lines.append(f"{span:>11}{n:>8}{s:10.2f}{t:10.2f}{r:8.3f}{kl:8.3f}")
    return "\n".join(lines)


@torch.no_grad()
def compare(student, blocks: Blocks, teacher=None, batch_size: int = 4, progress: bool = True) -> dict:
    """Student vs teacher on `blocks` [N, T]: both perplexities, mean per-token KL(teacher ‖ student) and top-1
    agreement of their next-token predictions. `teacher=None`: the student's own base model (`teacher_mode`)."""
    device = next(student.parameters()).device
    tally = _Tally()
    for batch in tqdm(_batches(blocks, batch_size), desc="student vs teacher", unit="batch",
                      disable=not progress, leave=False):
        ids = batch.to(device)
        log_s = _log_probs(student, ids)
        if teacher is None:
            with teacher_mode(student):
                log_t = _log_probs(student, ids)
        else:
            log_t = _log_probs(teacher, ids.to(next(teacher.parameters()).device)).to(device)
        tally.add(log_s, log_t, ids[:, 1:].reshape(-1), ids.shape[1] - 1)
    return tally.result()


class AgainstTeacher:
    """`compare` of a student against its own base model, repeated on fixed `blocks` [N, T] while the student
    changes (layers switched back to softmax, say): the teacher's log-probabilities are computed once and held
    in memory (N·(T−1)·vocab floats)."""

    def __init__(self, student, blocks: torch.Tensor, batch_size: int = 2):
        device = next(student.parameters()).device
        self.student = student
        self.batches = [blocks[s:s + batch_size].to(device) for s in range(0, len(blocks), batch_size)]
        with torch.no_grad(), teacher_mode(student):
            self.teacher = [_log_probs(student, ids) for ids in self.batches]

    @torch.no_grad()
    def __call__(self) -> dict:
        tally = _Tally()
        for ids, log_t in zip(self.batches, self.teacher):
            tally.add(_log_probs(self.student, ids), log_t, ids[:, 1:].reshape(-1), ids.shape[1] - 1)
        return tally.result()


@torch.no_grad()
def layer_errors(student, blocks: Blocks, batch_size: int = 2, progress: bool = True) -> dict:
    """Per layer, on the teacher's own q/k/v: relative error of the linear attention output against softmax
    attention (‖o_lin − o_soft‖ / ‖o_soft‖), and the row-scaled L2 kernel error of PRF maps (the distillation's
    l2 loss; None for other maps). The kernel error is only comparable between students trained with the l2 loss:
    the softmax loss leaves the kernel's overall scale free. Layers left as softmax get None."""
    from dofattn.capture import capture, run_forward
    from dofattn.distill.losses import l2_loss
    from dofattn.features import PositiveRandomFeatures
    from dofattn.ops.softmax import expand_kv, softmax_attention
    from dofattn.student import attention_modules

    modules = attention_modules(student)
    num, den = [0.0] * len(modules), [0.0] * len(modules)
    kernel = [[] for _ in modules]

    def sink(a) -> None:
        linear = getattr(modules[a.layer], "dofattn", None)
        if linear is None:
            return
        k, v = expand_kv(a.key, a.num_heads), expand_kv(a.value, a.num_heads)
        exact = softmax_attention(a.query, k, v, a.scaling)                  # [B, T, H, D]
        approx = linear(a.query, a.key, a.value)
        num[a.layer] += (approx.float() - exact).square().sum().item()
        den[a.layer] += exact.square().sum().item()
        if isinstance(linear.feature_map, PositiveRandomFeatures):
            kernel[a.layer].append(l2_loss(linear, a.query, k, v, a.scaling).item())

    device = next(student.parameters()).device
    with teacher_mode(student), capture(student, sink):
        for batch in tqdm(_batches(blocks, batch_size), desc="layer errors", unit="batch", disable=not progress,
                          leave=False):
            run_forward(student, batch.to(device))
    linear_layers = [hasattr(m, "dofattn") for m in modules]
    return {"output_error": [math.sqrt(n / d) if lin and d > 0 else None
                             for n, d, lin in zip(num, den, linear_layers)],
            "kernel_error": [sum(k) / len(k) if k else None for k in kernel]}


HUB_TASKS = ("piqa", "arc_easy", "arc_challenge", "winogrande", "logiqa", "wsc273", "mmlu")


def lm_eval_tasks(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                  batch_size: int = 4) -> dict[str, dict[str, float]]:
    """Zero-shot lm-evaluation-harness tasks on the in-memory `model`: {task: {metric: value}}.

    `include_path` adds a folder of local task YAMLs. Tasks that are not local need their datasets from the
    Hugging Face hub; without a network they fail up front with a one-line error.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("--tasks needs lm-evaluation-harness: pip install 'dofattn[eval]'") from None
    from dofattn.hf import _hub_reachable

    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}; e.g. {', '.join(HUB_TASKS)}, or a local "
                        f"task YAML in --task-path")
    local = set(TaskManager(include_path=include_path, include_defaults=False).all_tasks) if include_path else set()
    remote = [t for t in tasks if t not in local]
    if remote and not _hub_reachable():
        raise UserError(f"task(s) {', '.join(remote)} need their datasets from the Hugging Face hub, which cannot "
                        f"be reached; run with a network, or give local tasks with --task-path")
    device = str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                      log_samples=False, bootstrap_iters=0)
    return {task: {name.split(",")[0]: value for name, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "sample_len"}
            for task, metrics in results["results"].items()}


def format_tasks(tasks: dict[str, dict[str, float]]) -> str:
    """`lm_eval_tasks`' result, one task a line, after an empty one."""
    return "\n".join([""] + [f"{task:>22}  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
                             for task, metrics in tasks.items()])


# --- `dofattn eval` -------------------------------------------------------------------------------------------------

@dataclass
class EvalConfig:
    """What `run` evaluates, on what, and where it writes; the fields are `dofattn eval`'s options of the same
    names (`dofattn eval --help` says more). `out` None: no JSON; a plot None: no figure."""

    model: str = option("runs/distill", "student folder (from dofattn distill), dofattn export, or any supported "
                                        "model")
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
    batch_size: int = option(2, "blocks per forward pass")
    device: str = option("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = option("float32", "model dtype: float32 or bfloat16")
    tasks: list[str] | None = option(None, "also run zero-shot lm-eval tasks, comma-separated (piqa,arc_easy,"
                                           "arc_challenge,winogrande,logiqa,wsc273,mmlu need the hub; local ones "
                                           "via --task-path)")
    task_path: str | None = option(None, "folder of local lm-eval task YAMLs")
    limit: int | None = option(None, "evaluate at most this many examples per lm-eval task")
    out: str | None = option("eval.json", "where to write the JSON result")
    plot: str | None = option(None, "also write a figure of the per-layer errors (.png, .pdf or .svg)")
    plot_positions: str | None = option(None, "also write a figure of perplexity and KL by context length (.png, "
                                              ".pdf or .svg)")
    recall: list[str] | None = option(None, "long-context recall tasks, comma-separated: passkey, multikey")
    lengths: list[int] | None = option(None, "comma-separated prompt lengths in tokens (answer included) of the "
                                             "recall tasks; auto: 1024, 2048, ... up to the model's context",
                                       none="auto")
    depths: int = option(5, "depths of the hidden fact per length, evenly spaced from 0 (the filler's start) to 1 "
                            "(just before the question)")
    samples: int = option(1, "recall prompts per task, length and depth, each with its own fact, keys and filler")
    plot_recall: str | None = option(None, "also write a figure of recall accuracy by length and depth (.png, "
                                           ".pdf or .svg)")
    teacher_answers: str | None = option(None, "the teacher's recall answers from an earlier eval JSON of the same "
                                               "prompts (same --data, --lengths, --depths, --samples), instead of "
                                               "running the teacher again")


DEFAULT_BLOCKS = 8        # --num-blocks auto, where the text is not plain .txt files
FIGURES = ("plot", "plot_positions", "plot_recall")


def plain_text(data: str) -> bool:
    """Whether `data` is plain .txt files alone (one, or several joined by +)."""
    from dofattn.data import sources

    return all(Path(part).expanduser().is_file() and Path(part).suffix == ".txt" for part in sources(data))


def text_blocks(data: str, tokenizer, seq_len: int, split: str = "all") -> list[torch.Tensor]:
    """Every token of `data`'s documents in `split`, in their order (EOS between documents, where the tokenizer has
    one), in blocks of `seq_len` and a last shorter one: [[N, seq_len], [1, rest]] (either part left out when
    empty; a rest of one token, which nothing predicts, too). Scoring them predicts every token but each block's
    first."""
    from dofattn.data import texts

    ids: list[int] = []
    for i, text in enumerate(texts(data, split)):
        if i and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise UserError(f"{data} ({split} split) has {len(ids)} tokens; scoring needs at least 2")
    full = len(ids) // seq_len * seq_len
    whole = torch.tensor(ids, dtype=torch.long)
    parts = [whole[:full].view(-1, seq_len)] if full else []
    return parts + ([whole[full:][None]] if len(ids) - full >= 2 else [])


def check(cfg: EvalConfig) -> dict[str, Path]:
    """Everything about `cfg` that can be checked before a model loads; -> the output paths ({"out": ..., and each
    figure asked for})."""
    from dofattn.data import check_source

    paths = {"out": check_output(cfg.out, "--out", (".json",))} if cfg.out else {}
    paths.update({name: check_output(path, "--" + name.replace("_", "-"), (".png", ".pdf", ".svg"))
                  for name in FIGURES if (path := getattr(cfg, name))})
    check_source(cfg.data)
    if cfg.task_path and not Path(cfg.task_path).is_dir():
        raise UserError(f"--task-path {cfg.task_path} is not a folder of lm-eval task YAMLs")
    if (cfg.num_blocks or 0) < 0 or cfg.layer_blocks < 0 or cfg.batch_size < 1:
        raise UserError("--batch-size must be >= 1, --num-blocks and --layer-blocks >= 0")
    if cfg.teacher_answers and cfg.recall is None:
        raise UserError("--teacher-answers gives the teacher's recall answers: use it with --recall")
    if cfg.num_blocks == 0 and not (cfg.recall or cfg.tasks):
        raise UserError("--num-blocks 0 leaves nothing to evaluate; add --recall or --tasks, or score some blocks")
    if cfg.recall is not None:
        from dofattn.recall import check_grid, check_tasks

        check_tasks(cfg.recall)
        if cfg.teacher_answers and not Path(cfg.teacher_answers).is_file():
            raise UserError(f"--teacher-answers {cfg.teacher_answers} does not exist; give an eval JSON with recall")
        check_grid(cfg.depths, cfg.samples)
    return paths


def run(cfg: EvalConfig, show=None) -> dict:
    """`dofattn eval`: the student `cfg.model` against its teacher, as `cfg` asks (see `EvalConfig`); returns what
    it writes to `cfg.out`. `show(text)` gets each table as it is ready and each file written (print, say).

        result = run(EvalConfig(model="runs/distill", data="notes.txt", out=None))   # a plain file, scored whole
        result["tokens"], result["ppl"], result["kl"]
    """
    from dofattn.data import WIKI_SAMPLE, sources, token_blocks
    from dofattn.export import is_export, load_export, lora_merged
    from dofattn.hf import load_model, parse_dtype
    from dofattn.io import write_atomic
    from dofattn.student import is_student, load_student

    say = show or (lambda text: None)
    paths = check(cfg)
    held_out = any(part == WIKI_SAMPLE or part.startswith("hf:") for part in sources(cfg.data))
    split = cfg.split or ("validation" if held_out else "all")
    device, dtype = resolve_device(cfg.device), parse_dtype(cfg.dtype)
    teacher_name = cfg.teacher
    if is_export(cfg.model):
        model, tokenizer, spec = load_export(cfg.model, dtype=dtype, device=device)
        if lora_merged(cfg.model) and not teacher_name:   # its own base weights carry the merged adapters
            teacher_name = spec.base_model
    elif is_student(cfg.model):
        model, tokenizer, _ = load_student(cfg.model, dtype=dtype, device=device)
    else:
        model, tokenizer = load_model(cfg.model, dtype=dtype, device=device)
    if cfg.recall is not None:
        from dofattn.hf import context_length
        from dofattn.recall import resolve_lengths

        lengths = resolve_lengths(cfg.lengths, context_length(model.config))
    teacher = load_model(teacher_name, dtype=dtype, device=device)[0] if teacher_name else None
    result = {"model": cfg.model, "teacher": teacher_name or "base model", "data": cfg.data, "split": split}
    errors = {}
    if cfg.num_blocks != 0:
        if cfg.num_blocks is None and plain_text(cfg.data):
            blocks = text_blocks(cfg.data, tokenizer, cfg.seq_len, split)
        else:
            blocks = token_blocks(cfg.data, tokenizer, cfg.seq_len, cfg.num_blocks or DEFAULT_BLOCKS, split=split,
                                  seed=0)
        result.update(seq_len=cfg.seq_len, **compare(model, blocks, teacher, cfg.batch_size))
        errors = layer_errors(model, first_blocks(blocks, cfg.layer_blocks)) if cfg.layer_blocks else {}
        result.update(errors)
        say(format_comparison(result))
    if errors:
        say(format_layer_errors(errors))
    if cfg.recall is not None:
        from dofattn import recall

        result["recall"] = recall.run(model, tokenizer, cfg.recall, lengths, cfg.depths, cfg.samples, data=cfg.data,
                                      split=split, teacher=teacher, teacher_answers=cfg.teacher_answers)
        say(recall.format_recall(result["recall"]))
    if cfg.tasks:
        result["tasks"] = lm_eval_tasks(model, tokenizer, cfg.tasks, cfg.task_path, cfg.limit, cfg.batch_size)
        say(format_tasks(result["tasks"]))
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
    return result


def format_comparison(result: dict) -> str:
    """Student against teacher: perplexities and their ratio, KL, top-1 agreement, then `format_positions`."""
    ratio = result["ppl"] / result["teacher_ppl"]
    return "\n".join([f"{'':>22}{'student':>12}{'teacher':>12}",
                      f"{'perplexity':>22}{result['ppl']:12.2f}{result['teacher_ppl']:12.2f}   ({ratio:.2f}x)",
                      f"{'KL(teacher||student)':>22}{result['kl']:12.4f}",
                      f"{'top-1 agreement':>22}{result['top1_agreement']:12.3f}",
                      format_positions(result["by_position"])])


def format_layer_errors(errors: dict) -> str:
    """`layer_errors` per layer: output error (softmax for a layer kept) and kernel error."""
    lines = [f"\n{'layer':>5}  {'output error':>12}  {'kernel error':>12}"]
    for i, (o, k) in enumerate(zip(errors["output_error"], errors["kernel_error"])):
        lines.append(f"{i:>5}  {'softmax' if o is None else f'{o:.4f}':>12}  {'-' if k is None else f'{k:.3g}':>12}")
    return "\n".join(lines)
