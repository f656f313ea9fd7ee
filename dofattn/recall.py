"""Long-context recall: a fact hidden at a chosen depth in long filler text, asked for at the end.

Two tasks, offline and deterministic (every code, key and filler offset drawn from `seed`):

- `passkey`: a five-digit pass key stated once in the classic repeated filler ("The grass is green. The sky is
  blue. ..."), asked for after the filler. The only new fact in the prompt; the easy case.
- `multikey` (in the style of RULER's multi-key needle in a haystack): four lines "The special magic number for
  KEY is: NUMBER." with six-digit numbers and different keys, in real text (the data's documents, joined), one of
  the four asked for at the end. A model must retrieve the right number among similar ones, and the filler gives
  it nothing to lean on.

A prompt and its answer have `length` tokens together, so that a length of the model's context fits it. `depth` places the asked fact: 0 at the start of the filler,
1 at its end, just before the question; the fact is moved back to the nearest sentence end so that no word is
split. The other keys of `multikey` are placed at random depths.

Scoring: the prompt and its answer (the number's tokens; a space the tokenizer writes as a token of its own ends
the prompt) are read in one forward pass, and a prompt counts as answered when the model's most likely next token
is right at every token of the answer (teacher forcing: the same as greedy generation
writing the answer first, without generating). Chance is 10^-5 for a pass key and 10^-6 for a magic number; a
model that cannot see the fact scores about 0.

    result = run(student, tokenizer, ["passkey", "multikey"], lengths=[1024, 2048], depths=5)   # teacher_mode's
    print(format_recall(result))                                                               # as the teacher

`dofattn eval --recall` runs it (`jobs.eval.run`). The copy probe that picks the layers a student keeps softmax for
recall (`keep_softmax_by = "copy"`) is in `dofattn.distill.choose`.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from dofattn.errors import UserError

TASKS = ("passkey", "multikey")

PASSKEY_INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the pass key.")
PASSKEY_FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
                  " There and back again.")
PASSKEY_NEEDLE = " The pass key is {value}. Remember it. {value} is the pass key."
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"

MULTIKEY_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                  "I will quiz you about the numbers afterwards.\n\n")
MULTIKEY_NEEDLE = " The special magic number for {key} is: {value}."
MULTIKEY_QUESTION = ("\n\nWhat is the special magic number for {key} mentioned in the provided text? "
                     "The special magic number for {key} is:")
MULTIKEY_KEYS = 4
KEYS = ("apple", "river", "candle", "garden", "pencil", "harbor", "violin", "window", "tiger", "blanket", "mirror",
        "lantern", "meadow", "rocket", "saddle", "thunder", "walnut", "castle", "feather", "glacier", "hammer",
        "island", "jacket", "kettle", "ladder", "marble", "needle", "orchard", "pepper", "quarry", "ribbon",
        "spider", "tunnel", "velvet", "wagon", "anchor", "barrel", "cactus", "dolphin", "engine", "falcon",
        "goblet", "helmet", "igloo", "jungle", "kitten", "lemon", "magnet", "nickel", "oyster", "parrot", "quilt",
        "rabbit", "sponge", "trumpet", "umbrella", "valley", "whistle", "yogurt", "zipper", "bottle", "cherry",
        "desert", "forest")


@dataclass(frozen=True)
class Prompt:
    """One recall prompt: token ids of the prompt and of its answer, and where the asked fact starts."""

    task: str
    length: int          # tokens of the prompt and the answer together
    depth: float         # asked for: 0 (the filler's start) .. 1 (its end)
    sample: int
    ids: list[int]       # the prompt
    answer: list[int]    # the answer's tokens, after the prompt
    needle_at: int       # token index in `ids` where the asked fact starts

    @property
    def distance(self) -> int:
        """Tokens from the asked fact's start to the end of the prompt."""
        return len(self.ids) - self.needle_at


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _question_and_answer(tokenizer, question: str, value: str) -> tuple[list[int], list[int]]:
    """The question and its answer " VALUE" tokenized together, split at the first token that holds a digit: a
    tokenizer that writes the space as its own token (SmolLM2's) leaves it in the question, so the answer is the
    number itself and not a choice between " " and " a"."""
    ids = _tokens(tokenizer, question + " " + value)
    split = next(i for i, token in enumerate(ids) if any(c.isdigit() for c in tokenizer.decode([token])))
    return ids[:split], ids[split:]


def _sentence_ends(tokenizer, ids: list[int]) -> list[int]:
    """Indices i where a sentence has ended before ids[i] (the token before ends in '.', '!', '?' or a newline)."""
    ends = [0]
    for i, token in enumerate(ids[:-1]):
        if tokenizer.decode([token]).rstrip(" ").endswith((".", "!", "?", "\n")):
            ends.append(i + 1)
    return ends


def _at_sentence_end(ends: list[int], want: int) -> int:
    """The last sentence end at or before token `want` (the first sentence end if none); `ends` ascending."""
    return ends[max(bisect.bisect_right(ends, want) - 1, 0)]


class RecallTasks:
    """Builds the prompts of the recall tasks for one tokenizer; `documents` are the `multikey` filler."""

    def __init__(self, tokenizer, documents: list[str], seed: int = 0):
        from dofattn.data import leading_tokens

        self.tokenizer, self.seed = tokenizer, seed
        self.lead = leading_tokens(tokenizer)            # its BOS, where it puts one first: every prompt starts so
        self.passkey_filler = [_tokens(tokenizer, s) for s in PASSKEY_FILLER]
        self.text = _tokens(tokenizer, "\n\n".join(documents)) if documents else []
        self.text_ends = _sentence_ends(tokenizer, self.text) if self.text else []

    def prompt(self, task: str, length: int, depth: float, sample: int) -> Prompt:
        if task not in TASKS:
            raise UserError(f"unknown recall task {task!r}; use one of {', '.join(TASKS)}")
        if not 0 <= depth <= 1:
            raise UserError(f"a depth is a fraction of the filler from 0 to 1, got {depth}")
        rng = random.Random(f"{self.seed}:{task}:{length}:{depth}:{sample}")
        return (self._passkey if task == "passkey" else self._multikey)(rng, length, depth, sample)

    def _filler_room(self, task: str, length: int, fixed: int) -> int:
        room = length - fixed
        if room < 16:
            raise UserError(f"a {task} prompt of {length} tokens leaves {max(room, 0)} for the filler; ask for "
                            f"prompts of at least {fixed + 16} tokens")
        return room

    def _passkey(self, rng: random.Random, length: int, depth: float, sample: int) -> Prompt:
        tok = self.tokenizer
        value = str(rng.randrange(10_000, 100_000))
        intro, needle = self.lead + _tokens(tok, PASSKEY_INTRO), _tokens(tok, PASSKEY_NEEDLE.format(value=value))
        question, answer = _question_and_answer(tok, PASSKEY_QUESTION, value)
        room = self._filler_room("passkey", length, len(intro) + len(needle) + len(question) + len(answer))
        filler, ends = [], [0]
        while len(filler) < room:                           # whole sentences, then cut to the room left
            filler += self.passkey_filler[(len(ends) - 1) % len(self.passkey_filler)]
            ends.append(len(filler))
        filler = filler[:room]
        at = _at_sentence_end([e for e in ends if e <= room], round(depth * room))
        ids = intro + filler[:at] + needle + filler[at:] + question
        return Prompt("passkey", length, depth, sample, ids, answer, len(intro) + at)

    def _multikey(self, rng: random.Random, length: int, depth: float, sample: int) -> Prompt:
        tok = self.tokenizer
        keys = rng.sample(KEYS, MULTIKEY_KEYS)
        values = [str(rng.randrange(100_000, 1_000_000)) for _ in keys]
        needles = [_tokens(tok, MULTIKEY_NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values)]
        intro = self.lead + _tokens(tok, MULTIKEY_INTRO)
        question, answer = _question_and_answer(tok, MULTIKEY_QUESTION.format(key=keys[0]), values[0])
        room = self._filler_room("multikey", length,
                                 len(intro) + sum(map(len, needles)) + len(question) + len(answer))
        if len(self.text) < room + 1:
            raise UserError(f"the filler text has {len(self.text)} tokens, fewer than the {room} a multikey prompt "
                            f"of {length} tokens needs; use shorter prompts or more text (--data)")
        start = _at_sentence_end(self.text_ends, rng.randrange(len(self.text) - room))
        filler = self.text[start:start + room]
        ends = [e - start for e in self.text_ends if start <= e <= start + room]
        spots = [_at_sentence_end(ends, round(depth * room))]                   # the asked key at `depth`
        spots += [_at_sentence_end(ends, rng.randrange(room + 1)) for _ in keys[1:]]
        order = sorted(range(len(keys)), key=lambda i: (spots[i], i))
        ids, done, needle_at = list(intro), 0, 0
        for i in order:
            ids += filler[done:spots[i]]
            done = spots[i]
            if i == 0:
                needle_at = len(ids)
            ids += needles[i]
        ids += filler[done:] + question
        return Prompt("multikey", length, depth, sample, ids, answer, needle_at)


@torch.no_grad()
def read_answer(model, prompt: Prompt) -> tuple[list[int], float, int]:
    """The model's most likely token at each answer position (given the prompt and the answer before it), the
    answer's log-probability, and the bytes its generation cache holds after the whole sequence (what it keeps
    per sequence at this length: a KV cache, or a state with its window and sink). The prompt is read in one cached
    call and the answer in a second, as generation would (a student's selected keys, `exact.Select`, are chosen
    after the prompt); logits only at the answer's positions. A model without a cache: one forward pass."""
    from transformers import DynamicCache

    from dofattn.attention.cache import cache_bytes
    from dofattn.attention.cache import cache_kwargs

    device = next(model.parameters()).device
    n = len(prompt.answer)
    cache = DynamicCache(config=model.config) if hasattr(model, "config") else None
    if cache is None:
        ids = torch.tensor([prompt.ids + prompt.answer], device=device)
        logits = model(input_ids=ids, logits_to_keep=n + 1).logits[0, :-1].float()            # [n, vocab]
    else:
        kwargs = cache_kwargs(model, cache)
        first = model(input_ids=torch.tensor([prompt.ids], device=device), use_cache=True, logits_to_keep=1,
                      **kwargs).logits[0]                                                       # [1, vocab]
        answer = torch.tensor([prompt.answer], device=device)    # all of it, so the cache holds the whole sequence
        rest = model(input_ids=answer, use_cache=True, logits_to_keep=n, **kwargs).logits[0, :-1]
        logits = torch.cat([first.float(), rest.float()])                                       # [n, vocab]
    answer = torch.tensor(prompt.answer, device=device)
    log_p = torch.log_softmax(logits, -1).gather(1, answer[:, None]).sum().item()
    return logits.argmax(-1).tolist(), log_p, cache_bytes(cache)


def check_grid(depths: int, samples: int) -> None:
    """UserError unless a grid has at least one depth and one sample per cell."""
    if depths < 1 or samples < 1:
        raise UserError(f"--depths and --prompts must be at least 1, got {depths} and {samples}")


def make_prompts(tasks: RecallTasks, names: list[str], lengths: list[int], depths: int,
                 samples: int) -> list[Prompt]:
    """Every task of `names` at every length, at `depths` depths evenly spaced from 0 to 1 (0.5 alone for one), with
    `samples` prompts per cell."""
    check_grid(depths, samples)
    fractions = [0.5] if depths == 1 else [i / (depths - 1) for i in range(depths)]
    return [tasks.prompt(task, length, depth, s) for task in names for length in lengths for depth in fractions
            for s in range(samples)]


def describe(prompt: Prompt, tokenizer) -> dict:
    """A prompt's record before any model's answer: what it asks, where, and the answer as text."""
    return {"task": prompt.task, "length": prompt.length, "depth": prompt.depth, "sample": prompt.sample,
            "distance": prompt.distance, "answer": tokenizer.decode(prompt.answer)}


def record_key(record: dict) -> tuple:
    """What identifies a prompt across runs: task, length, depth, sample and the answer."""
    return record["task"], record["length"], record["depth"], record["sample"], record["answer"]


def evaluate_recall(models: dict, tasks: RecallTasks, prompts: list[Prompt], given: dict | None = None,
                    progress: bool = True) -> dict:
    """Each model on the same prompts: `models` maps a name ("student", "teacher") to a function that returns a
    context manager yielding the model (a student's own teacher is the student in `teacher_mode`). `given` maps
    the name of a model not run here to its answers from an earlier run ({`record_key`: answer}). Returns the
    per-prompt records and the accuracy per cell."""
    given = given or {}
    records = [describe(p, tasks.tokenizer) for p in prompts]
    for name, answers in given.items():
        for record in records:
            record[name] = answers[record_key(record)]
    bar = tqdm(total=len(prompts) * len(models), desc="recall", unit="prompt", disable=not progress, leave=False)
    for name, use in models.items():
        with use() as model:
            for prompt, record in zip(prompts, records):
                bar.set_postfix_str(f"{name} {prompt.task} {prompt.length}")
                guess, log_p, memory = read_answer(model, prompt)
                record[name] = {"correct": guess == prompt.answer, "said": tasks.tokenizer.decode(guess),
                                "log_p": log_p, "cache_bytes": memory}
                bar.update()
    bar.close()
    return {"records": records, "cells": cells(records, [*models, *given])}


def cells(records: list[dict], names: list[str]) -> list[dict]:
    """Accuracy per task, length and depth for each model in `names`, in record order."""
    table: dict[tuple, dict] = {}
    for r in records:
        cell = table.setdefault((r["task"], r["length"], r["depth"]),
                                {"task": r["task"], "length": r["length"], "depth": r["depth"], "prompts": 0,
                                 **{name: 0.0 for name in names}})
        cell["prompts"] += 1
        for name in names:
            cell[name] += r[name]["correct"]
    for cell in table.values():
        for name in names:
            cell[name] /= cell["prompts"]
    return list(table.values())


def cache_at(result: dict, name: str, length: int) -> int | None:
    """The most bytes model `name`'s cache held after any prompt of `length` tokens (None: not recorded, as in
    teacher answers from an eval JSON written before caches were measured)."""
    sizes = [r[name]["cache_bytes"] for r in result["records"] if r["length"] == length and "cache_bytes" in r[name]]
    return max(sizes) if sizes else None


def accuracy(result: dict, name: str, task: str, length: int | None = None) -> float:
    """Mean accuracy of model `name` on `task` (at one `length`, or over all)."""
    hits = [r[name]["correct"] for r in result["records"]
            if r["task"] == task and (length is None or r["length"] == length)]
    return sum(hits) / len(hits)


def check_tasks(names: list[str]) -> list[str]:
    """`names` if they are recall tasks (at least one), else a UserError naming the unknown ones."""
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise UserError(f"--recall {','.join(names)!r}: unknown task {', '.join(unknown) or '(none)'}; use "
                        f"{', '.join(TASKS)}, comma-separated")
    return names


def resolve_lengths(lengths: list[int] | None, context: int | None, beyond: bool = False) -> list[int]:
    """The prompt lengths: `lengths`, each within the model's `context` (None: it names none; `beyond`: past it
    too); or for None (the command line's `auto`) 1024, 2048, ... up to the context, the context alone if it is
    shorter than 1024."""
    if lengths is None:
        if not context:
            raise UserError("the model names no context length; pass --lengths, e.g. --lengths 1024,2048,4096")
        auto = [1024]
        while auto[-1] * 2 <= context:
            auto.append(auto[-1] * 2)
        return auto if auto[-1] <= context else [context]
    if context and max(lengths) > context and not beyond:
        raise UserError(f"--lengths {','.join(map(str, lengths))!r}: {max(lengths)} tokens is beyond the model's "
                        f"context of {context}; add --beyond-context to ask anyway")
    return lengths


def read_teacher_answers(path: str) -> dict:
    """{`record_key`: the teacher's answer} from an eval JSON with recall."""
    import json
    from pathlib import Path

    try:
        return {record_key(r): r["teacher"] for r in json.loads(Path(path).read_text())["recall"]["records"]}
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--teacher-answers {path} is not an eval JSON with recall answers") from None


def grid(model, tokenizer, names: list[str], lengths: list[int], depths: int = 5, samples: int = 1,
         data: str = "wiki-sample", split: str = "validation", teacher=None, teacher_answers: str | None = None,
         progress: bool = True) -> dict:
    """The recall grid of `dofattn eval --recall`: every task of `names` at every length and depth, `samples`
    prompts a cell (the multikey filler from `data`'s `split`), answered by `model` ("student") and `teacher`
    (None: `model` in `evaluate.teacher_mode`), or with the teacher's answers read from `teacher_answers` (an eval
    JSON of the same prompts). -> {"lengths", "depths", "samples", "records", "cells"[, "teacher_answers"]}."""
    import contextlib

    from dofattn.data import load_texts
    from dofattn.evaluate import teacher_mode

    @contextlib.contextmanager
    def own_teacher():
        with teacher_mode(model):
            yield model

    check_tasks(names)
    documents = load_texts(data, split) if "multikey" in names else []
    tasks = RecallTasks(tokenizer, documents, seed=0)
    prompts = make_prompts(tasks, names, lengths, depths, samples)
    models, given = {"student": lambda: contextlib.nullcontext(model)}, {}
    if teacher_answers:             # checked before the student runs: the same prompts, every one answered
        given["teacher"] = read_teacher_answers(teacher_answers)
        missing = next((p for p in prompts if record_key(describe(p, tokenizer)) not in given["teacher"]), None)
        if missing is not None:
            raise UserError(f"--teacher-answers {teacher_answers} has no teacher answer for {missing.task} at "
                            f"{missing.length} tokens, depth {missing.depth:g}, sample {missing.sample}; run the "
                            f"same --recall, --lengths, --depths, --prompts and --data, or drop it")
    else:
        models["teacher"] = (lambda: contextlib.nullcontext(teacher)) if teacher is not None else own_teacher
    result = evaluate_recall(models, tasks, prompts, given, progress)
    if given:
        result["teacher_answers"] = teacher_answers
    return {"lengths": lengths, "depths": depths, "samples": samples, **result}


def format_recall(recall: dict) -> str:
    """Accuracy per task and length, student against teacher, and the cache each holds per sequence there."""
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
