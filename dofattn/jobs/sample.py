"""Training text sampled from the teacher: more text for the end-to-end phase when the source runs out.

    dofattn sample --data wiki-sample --samples 2000 --out runs/teacher-text.jsonl
    dofattn distill --data wiki-sample+runs/teacher-text.jsonl --eval-data wiki-sample ...

    run(SampleSpec(data="wiki-sample"), samples=2000, out="runs/teacher-text.jsonl")    # the same from Python

Each sample starts from a prompt of `prompt_tokens` tokens cut from the *train* split of the data (never from
validation), and the teacher continues it for `new_tokens` tokens by ancestral sampling at `temperature` (1 = the
teacher's own distribution; special tokens such as EOS are suppressed, so every sample has its full length). The
samples are appended to a .jsonl file (field `text`: prompt and continuation) one batch at a time, so an interrupted
run loses at most one batch and the same command goes on where it stopped, with the same text as an uninterrupted run.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from dofattn.data import token_blocks
from dofattn.errors import UserError
from dofattn.io import check_parent
from dofattn.jobs import no_grad
from dofattn.options import DATA_HELP, Machine, option


@dataclass(frozen=True)
class SampleSpec:
    """What decides the samples: a file is continued only with the same spec. Its fields are `dofattn sample`'s
    options of the same names."""

    model: str = option("smollm2-135m", "the teacher: alias, hub id, folder or .gguf file")
    data: str = option("wiki-sample", "where the prompts come from (its train split): " + DATA_HELP)
    prompt_tokens: int = option(32, "tokens of real text each sample starts from")
    new_tokens: int = option(480, "tokens the model adds to each prompt")
    temperature: float = option(1.0, "sampling temperature (> 0)")
    batch_size: int = option(32, "samples generated together")
    seed: int = option(0, "seed for the prompts and the sampling")


def check(spec: SampleSpec, samples: int) -> None:
    if min(samples, spec.prompt_tokens, spec.new_tokens, spec.batch_size) < 1:
        raise UserError("--samples, --prompt-tokens, --new-tokens and --batch-size must be at least 1")
    if spec.temperature <= 0:
        raise UserError(f"--temperature must be > 0 (sampling), got {spec.temperature:g}")


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def done_samples(out: Path, spec: SampleSpec) -> int:
    """How many samples `out` already holds for `spec`; 0 for a new file. Refuses a file written otherwise."""
    meta = meta_path(out)
    if not out.exists():
        if meta.exists():
            meta.unlink()
        return 0
    if not meta.is_file():
        raise UserError(f"{out} exists and was not written by `dofattn sample`; give another --out")
    before = json.loads(meta.read_text())
    changed = sorted(k for k, v in asdict(spec).items() if before.get(k) != v)
    if changed:
        raise UserError(f"{out} holds samples made with other options ({', '.join(changed)}); give another --out "
                        f"or the same options to go on")
    lines = out.read_bytes().split(b"\n")
    complete = len(lines) - 1                      # a line counts once its newline is written
    if lines[-1]:                                  # a torn last line from an interrupted write: drop it
        out.write_bytes(b"\n".join(lines[:-1]) + (b"\n" if complete else b""))
    return complete


def prompts(spec: SampleSpec, tokenizer, samples: int) -> torch.Tensor:
    """[N, prompt_tokens]: every distinct cut of the train split (N >= `samples`), in an order fixed by the seed."""
    blocks = token_blocks(spec.data, tokenizer, spec.prompt_tokens, None, split="train", seed=spec.seed)
    if samples > len(blocks):
        raise UserError(f"{spec.data} (train split) has {len(blocks)} prompts of {spec.prompt_tokens} tokens, "
                        f"fewer than --samples {samples}; ask for fewer samples or shorter prompts")
    order = list(range(len(blocks)))
    random.Random(spec.seed).shuffle(order)
    return blocks[order]


@no_grad
def sample_text(model, tokenizer, spec: SampleSpec, samples: int, out: Path, progress: bool = True) -> dict:
    """Append `samples` teacher samples to `out` (see the module docstring); returns a summary."""
    import torch

    check(spec, samples)
    start = done_samples(out, spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta_path(out).write_text(json.dumps(asdict(spec), indent=2))
    if start >= samples:
        return {"samples": start, "new": 0}
    ids = prompts(spec, tokenizer, samples)
    device = next(model.parameters()).device
    special = sorted(set(tokenizer.all_special_ids))
    bar = tqdm(total=samples, initial=start, desc="sampling", unit="sample", disable=not progress)
    first = start - start % spec.batch_size            # batches are the unit of the seed: redo a partial one
    with open(out, "ab") as f:
        for b in range(first, samples, spec.batch_size):
            batch = ids[b: b + spec.batch_size].to(device)  # whole batches: sample i does not depend on --samples
            torch.manual_seed(spec.seed * 1_000_003 + b // spec.batch_size)
            gen = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=True,
                                 temperature=spec.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens,
                                 suppress_tokens=special, pad_token_id=tokenizer.pad_token_id)
            for i, row in enumerate(gen.cpu()):
                if not start <= b + i < samples:
                    continue
                text = tokenizer.decode(row, skip_special_tokens=True)
                f.write((json.dumps({"text": text}) + "\n").encode())
            f.flush()
            bar.update(min(b + spec.batch_size, samples) - max(b, start))
    bar.close()
    return {"samples": samples, "new": samples - start}


@dataclass
class SampleRun(Machine):
    """Beside `SampleSpec` (what decides the text): how many samples, where they go, on what device. Its fields are
    `dofattn sample`'s options of the same names."""

    samples: int = option(1000, "number of samples to write in all")
    out: str = option("teacher-text.jsonl", "the .jsonl file to write or go on with")


@dataclass(frozen=True)
class SampleConfig:
    """A `dofattn sample` job: the spec whole and the run's settings."""

    spec: SampleSpec = field(default_factory=SampleSpec)
    run: SampleRun = field(default_factory=SampleRun)


def run(cfg: SampleConfig, progress=None) -> dict:
    """`dofattn sample`: load `spec.model` and append samples to `out` until it holds `samples` (a .jsonl file),
    everything checked before the model loads. -> {"samples": in the file, "new": written now, "seconds", "out"}."""
    from dofattn.data import check_source

    spec, samples, device, dtype = cfg.spec, cfg.run.samples, cfg.run.device, cfg.run.dtype
    out = Path(cfg.run.out).expanduser()
    if out.suffix != ".jsonl":
        raise UserError(f"--out {out} must end in .jsonl")
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give a .jsonl file name")
    check_parent(out, "--out")
    check_source(spec.data)
    check(spec, samples)
    done_samples(out, spec)                        # refuse a foreign file before loading the model
    from dofattn.model.hf import load_model, machine_dtype, refuse_config_only, resolve_device, use_threads

    refuse_config_only(spec.model, "sample (text from a trained model)")
    use_threads(cfg.run.threads)
    device = resolve_device(device)
    model, tokenizer = load_model(spec.model, dtype=machine_dtype(dtype, device), device=device)
    start = time.perf_counter()
    result = sample_text(model, tokenizer, spec, samples, out, progress is not None)
    return {**result, "seconds": time.perf_counter() - start, "out": str(out)}
