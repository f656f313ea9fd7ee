"""Generate text with a linearized student (or any supported model) and its constant-size state.

--model takes a student folder written by `dofattn distill` (or `dofattn.student.save_student`), a folder
written by `dofattn export`, or a base model (alias, hub id, folder, .gguf). With a base model, --dims
linearizes it on the fly with untrained features (useful to check plumbing and speed, not quality); without
--dims the base model generates as it is.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from dofattn.commands import add_verb, config
from dofattn.errors import UserError
from dofattn.options import option


@dataclass
class GenerateArgs:
    """The model, the prompt and how to decode it."""

    model: str = option("smollm2-135m", "student folder, dofattn export, or a base model: alias, hub id, folder or "
                                        ".gguf file")
    prompt: str = option("The history of mathematics", "text to continue")
    max_new_tokens: int = option(40, "number of tokens to generate")
    dims: str | None = option(None, "linearize a base model first: fix, fix:C or a dof.json file")
    feature: str = option("prf", "feature map when linearizing with --dims: prf, performer, hedgehog or dijiang")
    temperature: float = option(0.0, "0 for greedy decoding, > 0 to sample")
    static: bool = option(False, "greedy decoding on static buffers (dofattn.engine): a CUDA graph per token on "
                                 "CUDA; needs every layer linear and --temperature 0")
    compile: bool = option(False, "with --static: compile the decode step with torch.compile (for the CPU; its "
                                  "first step compiles, minutes on a small CPU, so it pays off for long "
                                  "generations)")
    seed: int = option(0, "seed for sampling and for untrained features")
    device: str = option("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = option("float32", "model dtype: float32 or bfloat16")


def options() -> list[type]:
    return [GenerateArgs]


def add_parser(verbs):
    return add_verb(verbs, "generate", __doc__, options())


def run(ns) -> int:
    """The `generate` verb."""
    import torch

    from dofattn.export import is_export, load_export
    from dofattn.features import FEATURES
    from dofattn.hf import load_model, parse_dtype, resolve_device
    from dofattn.spec import Attention
    from dofattn.student import is_student, linearize, load_student, resolve_dims

    args = config(GenerateArgs, ns)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature:g}")
    if args.static and args.temperature > 0:
        raise UserError("--static decodes greedily; drop --temperature or --static")
    if args.compile and not args.static:
        raise UserError("--compile compiles the static decoder's step; add --static")
    if args.dims and args.feature not in FEATURES:
        raise UserError(f"unknown feature map {args.feature!r}; use one of {', '.join(FEATURES)}")
    device, dtype = resolve_device(args.device), parse_dtype(args.dtype)
    if is_student(args.model) or is_export(args.model):
        if args.dims:
            raise UserError(f"{args.model} is already a student; drop --dims")
        load = load_export if is_export(args.model) else load_student
        model, tokenizer, spec = load(args.model, dtype=dtype, device=device, merge_lora=True)
        what = (f"student of {spec.base_model} ({spec.attention.feature}, dims {min(spec.dims)}-"
                f"{max(spec.dims)})")
    else:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
        what = args.model
        if args.dims:
            dims = resolve_dims(args.dims, model, args.model)
            linearize(model, dims, Attention(feature=args.feature, window=0, sink=0), seed=args.seed)
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
