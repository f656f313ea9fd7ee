"""Evaluation against the teacher: perplexity, KL, agreement, per-layer errors, by position, lm-eval tasks, and
their tables (`dofattn eval` runs them: `jobs.eval`).

    with teacher_mode(student):            # linear layers bypassed: the original softmax model
        teacher_ppl = perplexity(student, blocks)
    student_ppl = perplexity(student, blocks)

`teacher_mode` works because a linearized model keeps every original weight: switching the attention
implementation back to SDPA skips the linear layers entirely, so no second copy of the model is needed.

Blocks are a tensor [N, T], or a list of such tensors of different lengths (`jobs.eval.text_blocks`: a plain file
scored whole, its last block shorter); every function that scores blocks takes both.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from dofattn.errors import UserError

Blocks = torch.Tensor | list[torch.Tensor]


@contextlib.contextmanager
def teacher_mode(model) -> Iterator[None]:
    """While active, `model` is its base model: softmax attention in every layer (its linear layers are ignored)
    and LoRA adapters, if any, switched off."""
    from dofattn.model.hf import softmax_implementation
    from dofattn.model.install import is_base
    from dofattn.model.lora import set_lora_enabled

    current = model.config._attn_implementation
    if is_base(model):
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


SCORE_VALUES = 512 * 49_152   # vocabulary-wide logits that exist at once over a batch's blocks: 512 predictions at
                              # SmolLM2's 49,152 tokens (0.1 GB in float32; the KL of 4 x 511 at once was 3.2 GB above
                              # the model), 96 at Gemma 3's 262,144


def vocabulary(model) -> int:
    """The LM head's rows: the logits a position has."""
    return model.get_output_embeddings().weight.shape[0]


def score_chunk(ids: torch.Tensor, vocab: int) -> int:
    """Positions per chunk of the scores of a batch `ids` [B, T] at a vocabulary of `vocab`: at most `SCORE_VALUES`
    logits over its B blocks (at least one position)."""
    return max(1, SCORE_VALUES // (vocab * ids.shape[0]))


def hidden_states(model, ids: torch.Tensor) -> torch.Tensor:
    """The base model body's last hidden states [B, T, d] (after its final norm), the LM head's input."""
    return model.base_model(input_ids=ids, use_cache=False).last_hidden_state


def head(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits [B, t, vocab] of `hidden` [B, t, d]: the LM head, then the config's final soft-capping (Gemma 2
    and 3: cap · tanh(logits / cap)), as the model's own forward applies them.

    The head reads `hidden` as rows of a dense [B·t, d] matrix: a slice of a longer block (a chunk of positions)
    handed to it as is takes bfloat16's strided path on the CPU, 5-40x slower (Gemma 3's head over 96 rows: 0.26 s
    dense, 10 s as a slice of 4 blocks of 512; docs/log, 2026-12-04)."""
    logits = model.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


def _log_probs(model, ids: torch.Tensor, chunk: int | None = None) -> Iterator[torch.Tensor]:
    """Next-token log-probabilities of `model` on ids [B, T], in float32: the body runs once, the LM head on
    `chunk` positions (`score_chunk`) at a time; one [B·c, vocab] tensor per chunk of c positions, each made when
    the one before is taken (a whole batch's at once: 0.4 GB at SmolLM2's vocabulary, 4 x 511 predictions)."""
    hidden = hidden_states(model, ids)[:, :-1]
    size = chunk or score_chunk(ids, vocabulary(model))
    for s in range(0, hidden.shape[1], size):
        yield torch.log_softmax(head(model, hidden[:, s:s + size]).float(), -1).flatten(0, 1)


def _chunk_targets(ids: torch.Tensor, vocab: int, chunk: int | None = None) -> list[torch.Tensor]:
    """The next tokens of ids [B, T] in the chunks `_log_probs` gives ([B·c] each)."""
    size = chunk or score_chunk(ids, vocab)
    return [t.flatten() for t in ids[:, 1:].split(size, 1)]


def _nll(log_p: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed negative log-likelihood of `targets` [N] under `log_p` [N, vocab]."""
    return -log_p.gather(1, targets[:, None]).sum().item()


def blocks_in_batches(blocks: Blocks, batch_size: int) -> list[torch.Tensor]:
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


@torch.no_grad()
def perplexity(model, blocks: Blocks, batch_size: int = 4, desc: str = "perplexity",
               progress: bool = True) -> float:
    """exp(mean next-token cross-entropy) over `blocks` [N, T] (T−1 predictions per block)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in tqdm(blocks_in_batches(blocks, batch_size), desc=desc, unit="batch", disable=not progress, leave=False):
        ids = batch.to(device)
        targets = _chunk_targets(ids, vocabulary(model))
        total += sum(_nll(log_p, t) for log_p, t in zip(_log_probs(model, ids), targets))
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

    def add(self, log_s: torch.Tensor, log_t: torch.Tensor, targets: torch.Tensor, length: int,
            start: int = 0) -> None:
        """`length` predictions per block, those of positions start..start+length−1 (a chunk of a block's T − 1);
        rows of the batch come block after block."""
        nll_s = -log_s.gather(1, targets[:, None])[:, 0]
        nll_t = -log_t.gather(1, targets[:, None])[:, 0]
        kl = (log_t.exp() * (log_t - log_s)).sum(-1).clamp_min(0)        # >= 0: rounding gives -1e-8
        per_position = torch.stack([nll_s, nll_t, kl]).double().reshape(3, -1, length).sum(1).cpu()
        end = start + length
        if end > self.at.shape[1]:
            grow = end - self.at.shape[1]
            self.at = torch.cat([self.at, self.at.new_zeros(3, grow)], 1)
            self.seen = torch.cat([self.seen, self.seen.new_zeros(grow)])
        self.at[:, start:end] += per_position
        self.seen[start:end] += targets.numel() // length
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


def _ppl(x: float) -> str:
    """A perplexity in 10 columns: two decimals, or 4 significant digits where it is too large for them (the
    first prediction of a block that starts mid-document after a BOS: 4e7 on Gemma 3)."""
    return f"{x:10.2f}" if x < 1e6 else f"{x:10.4g}"


def format_positions(rows: dict) -> str:
    """The `by_position` buckets as a table: context length, predictions, both perplexities, their ratio, KL."""
    lines = [f"\n{'context':>11}{'tokens':>8}{'student':>10}{'teacher':>10}{'ratio':>8}{'KL':>8}"]
    for a, b, n, s, t, r, kl in zip(*(rows[k] for k in ("context_from", "context_to", "tokens", "ppl",
                                                          "teacher_ppl", "ratio", "kl"))):
        span = f"{a}" if a == b else f"{a}-{b}"
        lines.append(f"{span:>11}{n:>8}{_ppl(s)}{_ppl(t)}{r:8.3f}{kl:8.3f}")
    return "\n".join(lines)


@torch.no_grad()
def compare(student, blocks: Blocks, teacher=None, batch_size: int = 4, progress: bool = True) -> dict:
    """Student vs teacher on `blocks` [N, T]: both perplexities, mean per-token KL(teacher ‖ student) and top-1
    agreement of their next-token predictions. `teacher=None`: the student's own base model (`teacher_mode`)."""
    from dofattn.model.install import is_base

    device = next(student.parameters()).device
    tally = _Tally()
    for batch in tqdm(blocks_in_batches(blocks, batch_size), desc="student vs teacher", unit="batch",
                      disable=not progress, leave=False):
        ids = batch.to(device)
        student_hidden = hidden_states(student, ids)[:, :-1]
        if teacher is None and is_base(student):            # a base model is its own teacher: one forward
            teacher_hidden, teacher_model = student_hidden, student
        elif teacher is None:
            with teacher_mode(student):
                teacher_hidden = hidden_states(student, ids)[:, :-1]
            teacher_model = student
        else:
            teacher_hidden = hidden_states(teacher, ids.to(next(teacher.parameters()).device))[:, :-1]
            teacher_model = teacher
        size = score_chunk(ids, vocabulary(student))
        for start in range(0, student_hidden.shape[1], size):
            part = slice(start, start + size)
            log_s = torch.log_softmax(head(student, student_hidden[:, part]).float(), -1)
            log_t = torch.log_softmax(head(teacher_model, teacher_hidden[:, part]).float(), -1).to(device)
            tally.add(log_s.flatten(0, 1), log_t.flatten(0, 1), ids[:, 1:][:, part].flatten(), log_s.shape[1],
                      start)
    return tally.result()


def lm_eval_tasks(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                  batch_size: int = 4, lengths: list[int] | None = None,
                  scored=None, verbose: bool = False, manager=None) -> dict[str, dict[str, float]]:
    """Zero-shot lm-evaluation-harness tasks on the in-memory `model`: {task: {metric: value}}.

    `include_path` adds a folder of local task YAMLs. Tasks that are not local need their datasets from the
    Hugging Face hub; without a network they fail up front with a one-line error. Synthetic long-context tasks
    (RULER's niah_*, vt, cwe, fwe: lm-eval builds their prompts with the model's tokenizer, offline) are scored
    at each of `lengths` apart ({task: {"4096": accuracy, ...}}, `limit` prompts each; default 4096), as lm-eval
    scores them; `scored(length, {task: accuracy})` hears each length as it ends (a long run cut short keeps them).
    What lm-eval prints is kept off the terminal unless `verbose` (`quiet_output`). `manager`: the TaskManager
    `lm_tasks.check_tasks` gave for these tasks (its index takes seconds), else made here.
    """
    from dofattn.lm_tasks import check_tasks, local_names, task_manager

    manager = manager or check_tasks(tasks, include_path) or task_manager(include_path)
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from dofattn.model.hf import _hub_reachable

    local = local_names(include_path)
    synthetic = [t for t in tasks if synthetic_task(manager, t)]
    remote = [t for t in tasks if t not in local and t not in synthetic]
    if remote and not _hub_reachable():
        raise UserError(f"task(s) {', '.join(remote)} need their datasets from the Hugging Face hub, which cannot "
                        f"be reached; run with a network, or give local tasks with --task-path")
    device = str(next(model.parameters()).device)
    with quiet_output(verbose):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    found = {}
    rest = [t for t in tasks if t not in synthetic]
    if rest:
        with quiet_output(verbose):
            results = lm_eval.simple_evaluate(model=lm, tasks=rest, task_manager=manager, limit=limit,
                                              log_samples=False, bootstrap_iters=0)
        found.update({task: {name.split(",")[0]: value for name, value in metrics.items()
                             if isinstance(value, (int, float)) and not isinstance(value, bool)
                             and name != "sample_len"}
                      for task, metrics in results["results"].items()})
    if synthetic:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:     # the tokenizer the tasks build their prompts with
            tokenizer.save_pretrained(folder)
            for length in lengths or [4096]:
                sized = TaskManager(include_path=include_path,
                                    metadata={"max_seq_lengths": [length], "tokenizer": folder})
                with quiet_output(verbose):
                    results = lm_eval.simple_evaluate(model=lm, tasks=synthetic, task_manager=sized, limit=limit,
                                                      log_samples=False, bootstrap_iters=0)
                now = {task: results["results"][task][f"{length},none"] for task in synthetic}
                for task, value in now.items():
                    found.setdefault(task, {})[str(length)] = value
                if scored:
                    scored(length, now)
    return found


@contextlib.contextmanager
def quiet_output(verbose: bool = False) -> Iterator[None]:
    """While active (unless `verbose`), whatever is printed to the terminal's stdout and stderr, by Python or by a
    subprocess (lm-eval's nltk downloads, its `git describe`, its log lines and progress bars), goes to a temporary
    file instead; if the block fails, the file's last lines go to stderr, so that a failure still says why."""
    if verbose:
        yield
        return
    import os
    import sys
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    streams = sys.stdout, sys.stderr
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)                    # a subprocess's output, and C code's
        os.dup2(log.fileno(), 2)
        text = open(log.fileno(), "w", closefd=False, errors="replace")   # Python's, where sys.stdout is not fd 1
        sys.stdout = sys.stderr = text
        failed = False
        try:
            yield
        except BaseException as err:
            failed = not isinstance(err, (UserError, KeyboardInterrupt))
            raise
        finally:
            text.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if failed:
                log.seek(0)
                sys.stderr.write(log.read()[-4000:].decode(errors="replace"))


def synthetic_task(manager, task: str) -> bool:
    """Whether lm-eval builds the task's prompts itself (a `custom_dataset`, no hub dataset): RULER's."""
    entry = manager.task_index.get(task)
    cfg = getattr(entry, "cfg", None) or {}
    return bool(cfg.get("custom_dataset")) and not cfg.get("dataset_path")


def format_tasks(tasks: dict[str, dict[str, float]], teacher: dict[str, dict[str, float]] | None = None) -> str:
    """`lm_eval_tasks`' results, a row per task and metric (a synthetic task's metrics are its lengths), the
    student's beside the teacher's, after an empty line."""
    lines = ["", f"{'task':>22}  {'metric':>10}  {'student':>8}  {'teacher':>8}"]
    for task, metrics in tasks.items():
        for name, value in metrics.items():
            other = (teacher or {}).get(task, {}).get(name)
            lines.append(f"{task:>22}  {name:>10}  {value:8.4f}  {'-' if other is None else f'{other:8.4f}':>8}")
    return "\n".join(lines)


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
