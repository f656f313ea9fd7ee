"""`dofattn generate`: continue a prompt with a student (or any supported model) and its fixed-size cache.

    result = run(GenerateConfig(model="runs/long-context", prompt="The history of mathematics"))
    result["text"], result["tokens_per_s"]

The model is a student folder written by `dofattn distill` (or `student.save_student`), an export (`dofattn
export`), or a base model (alias, hub id, folder, .gguf): as it is, or with --student RECIPE made that recipe's
student with untrained features (--dims per layer), to check plumbing and speed, not quality.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from dofattn.errors import UserError
from dofattn.options import Machine, option
from dofattn.recipe import DEFAULT_RUN


@dataclass
class GenerateConfig(Machine):
    """The model, the prompt and how to decode it; the fields are `dofattn generate`'s options."""

    model: str = option(DEFAULT_RUN, "student folder (the default recipe's run folder unless given), "
                                             "dofattn export, or a base model: alias (smollm2-135m: the teacher), hub "
                                             "id, folder or .gguf file")
    prompt: str = option("The history of mathematics", "text to continue")
    max_new_tokens: int = option(40, "number of tokens to generate")
    student: str | None = option(None, "make a base model this recipe's student first (packaged name or .toml: its "
                                       "[student] architecture, untrained features)", none="none")
    dims: str | None = option(None, "features per head of each layer of that untrained student: C, fix (the head "
                                    "size), fix:C or a dof.json file", none="fix")
    temperature: float = option(0.0, "0 for greedy decoding, > 0 to sample")
    static: bool = option(False, "greedy decoding on static buffers (dofattn.engine): a CUDA graph per token on "
                                 "CUDA, eager steps on a CPU; needs a student and --temperature 0")
    compile: bool = option(False, "with --static: compile the decode step with torch.compile (for the CPU; its "
                                  "first step compiles, minutes on a small CPU, so it pays off for long "
                                  "generations)")
    seed: int = option(0, "seed for sampling and for untrained features")
    extend_to: int | None = option(None, "read to this many tokens, past the model's context (SmolLM2: 8192): its "
                                         "RoPE scaled by YaRN to it, without the attention temperature; a little "
                                         "worse within the context", none="off")


def check(cfg: GenerateConfig) -> None:
    """Every rule on the options, before a model loads."""
    from dofattn.jobs import check_default_run
    from dofattn.options import check_extend_to
    from dofattn.spec import is_export, is_student

    check_default_run(cfg.model)
    if cfg.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {cfg.max_new_tokens}")
    if not cfg.prompt:
        raise UserError("--prompt is empty: give some text to continue")
    if cfg.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {cfg.temperature:g}")
    if cfg.static and cfg.temperature > 0:
        raise UserError("--static decodes greedily; drop --temperature or --static")
    if cfg.compile and not cfg.static:
        raise UserError("--compile compiles the static decoder's step; add --static")
    check_extend_to(cfg.extend_to)
    if cfg.dims and is_student(cfg.model):
        raise UserError(f"{cfg.model} is a trained student whose feature dims are its own: drop --dims")
    if cfg.dims and not cfg.student:
        raise UserError("--dims sizes the features of an untrained student: add --student RECIPE (e.g. paper) to "
                        "make one of the base model --model")
    if cfg.dims:
        from dofattn.recipe import check_fixed_dims

        check_fixed_dims(cfg.dims)
    if cfg.static and not cfg.student and not (is_student(cfg.model) or is_export(cfg.model)):
        raise UserError(f"--static decodes a linearized student, and {cfg.model} is not one: give a run folder or an "
                        f"export, add --student RECIPE for an untrained one, or drop --static")


def load(cfg: GenerateConfig):
    """(model, tokenizer, what it is in words) as `cfg` asks."""
    from dofattn import recipe as recipes
    from dofattn.model.hf import local_layers, machine_dtype, refuse_config_only, resolve_device
    from dofattn.distill.choose import check_untrained
    from dofattn.jobs import check_default_run, load_for_job

    check_default_run(cfg.model)
    refuse_config_only(cfg.model, "generate")
    device = resolve_device(cfg.device)
    dtype = machine_dtype(cfg.dtype, device)
    recipe = recipes.load(cfg.student) if cfg.student else None
    if recipe is not None:              # before the model loads: refused at once
        check_untrained(recipe)
    model, tokenizer, spec = load_for_job(cfg.model, recipe, cfg.dims or "fix", dtype=dtype, device=device,
                                          merge_lora=True)
    if spec is None:
        return model, tokenizer, cfg.model
    words = "; ".join(spec.describe(local=local_layers(model.config)))
    if recipe is None:
        return model, tokenizer, f"student of {spec.base_model} ({words})"
    return model, tokenizer, f"{cfg.model} as recipe {recipe.name}'s student, untrained ({words})"


class FirstToken:
    """A streamer for HF `generate` that times the first new token: `put` gets the prompt, then each new token, so
    its second call is the end of reading the prompt (and of the first token's forward, which is the prompt's)."""

    def __init__(self):
        self.calls, self.at = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def check_context(model, prompt_tokens: int, new_tokens: int) -> None:
    """A UserError where the prompt and the tokens asked for run past the model's context (as `eval` refuses a
    block past it): the positions beyond were never trained; --extend-to reads further."""
    from dofattn.model.hf import context_length

    context = context_length(model.config)
    if context and prompt_tokens + new_tokens > context:
        raise UserError(f"the prompt ({prompt_tokens} tokens) and --max-new-tokens {new_tokens} run past the "
                        f"model's context of {context} tokens: shorten the prompt, or add --extend-to "
                        f"{2 ** (prompt_tokens + new_tokens - 1).bit_length()} (YaRN)")


@contextlib.contextmanager
def prompt_bar(tokens: int, model, progress):
    """A context in which a prompt of `tokens` read in chunks shows a progress bar (stderr), when `progress` is on
    and the model reads in chunks; else nothing."""
    from dofattn.model.prompt import PromptReader, reading_progress

    if progress is None or not isinstance(model, PromptReader) or tokens <= model.prompt_chunk:
        yield
        return
    from tqdm.auto import tqdm

    with tqdm(total=tokens, desc="reading the prompt", unit="token", leave=False) as bar, \
            reading_progress(lambda done, total: bar.update(done - bar.n)):
        yield


def run(cfg: GenerateConfig, progress=None) -> dict:
    """The prompt continued: {"text" (prompt and continuation), "new_tokens", "seconds", "prompt_tokens",
    "prompt_s" (reading the prompt, its first new token included), "tokens_per_s" (the new tokens after the first,
    a second each), "model" (what generated it, in words)}. `progress(text)` gets progress lines (None: quiet)."""
    check(cfg)                          # on the options alone: before torch and transformers are imported
    import torch

    from dofattn.model.hf import use_threads

    use_threads(cfg.threads)
    model, tokenizer, what = load(cfg)
    if cfg.extend_to:
        from dofattn.model.hf import extend_context

        extend_context(model, cfg.extend_to)
        what += f", read to {cfg.extend_to} tokens (YaRN)"
    if progress:
        progress(f"generating with {what}")
    torch.manual_seed(cfg.seed)
    device = next(model.parameters()).device
    inputs = tokenizer(cfg.prompt, return_tensors="pt").to(device)
    sampling = {"do_sample": True, "temperature": cfg.temperature} if cfg.temperature > 0 else {"do_sample": False}
    prompt_tokens = inputs["input_ids"].shape[1]
    check_context(model, prompt_tokens, cfg.max_new_tokens)
    start = time.perf_counter()
    if cfg.static:
        from dofattn.engine import StaticDecoder

        decoder = StaticDecoder(model, compile=cfg.compile)
        with prompt_bar(prompt_tokens, model, progress):
            out = decoder.generate(inputs["input_ids"], cfg.max_new_tokens, tokenizer.eos_token_id)
        what += ", static decoding" + (" with a CUDA graph" if decoder.graph else "")
        if "compile_s" in decoder.timings:
            what += f", compiled in {decoder.timings['compile_s']:.0f} s"
        prompt_s = decoder.timings["prefill_s"]
    else:
        first = FirstToken()
        with torch.no_grad(), prompt_bar(prompt_tokens, model, progress):
            out = model.generate(**inputs, max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 streamer=first, **sampling)
        prompt_s = (first.at or time.perf_counter()) - start
    seconds = time.perf_counter() - start
    new = out[0, prompt_tokens:]
    eos = tokenizer.eos_token_id
    ended = eos is not None and bool((new == eos).any())
    if ended:                                 # the static decoder fills after the end with it: cut there
        new = new[:int((new == eos).nonzero()[0]) + 1]
    later = len(new) - 1                          # the tokens after the first, which the prompt's forward gives
    return {"text": cfg.prompt + tokenizer.decode(new, skip_special_tokens=True), "new_tokens": len(new),
            "seconds": seconds, "prompt_tokens": prompt_tokens, "prompt_s": prompt_s,
            "tokens_per_s": later / (seconds - prompt_s) if later and seconds > prompt_s else float("nan"),
            "model": what,
            "stopped": "at the end-of-text token" if ended else f"after --max-new-tokens {cfg.max_new_tokens}"}
