"""Write a student as a Hugging Face model folder that transformers loads where dofattn is installed.

AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True) gives the student. OUT gets config.json (the
base config and the student's spec), modeling_dofattn.py, model.safetensors (every weight; the student's own
tensors in float32; shards past 5 GB), the tokenizer, a generation config and a model card with the run's
evaluation numbers. `dofattn eval` and `dofattn generate` take OUT as --model.

    dofattn export --model runs/distill --out exports/student
    dofattn export --model runs/long --out exports/long --merge-lora --dtype bfloat16
"""

from __future__ import annotations

from dataclasses import dataclass

from dofattn.commands import add_verb, config
from dofattn.errors import UserError
from dofattn.options import option


@dataclass
class ExportArgs:
    """The arguments of `dofattn.export.export`."""

    model: str = option("runs/distill", "a dofattn distill run folder, or a student folder")
    out: str | None = option(None, "the folder to write: new, empty, or a previous export (replaced)")
    merge_lora: bool = option(False, "fold LoRA adapters into the projection weights (no peft needed to load; the "
                                     "base model is then no longer inside); without it they are kept as peft layers")
    dtype: str = option("float32", "dtype of the base model's weights: float32, bfloat16 or float16")


def options() -> list[type]:
    return [ExportArgs]


def add_parser(verbs):
    return add_verb(verbs, "export", __doc__, options())


def run(ns) -> int:
    """The `export` verb: `dofattn.export.export`."""
    from dofattn.export import export

    args = config(ExportArgs, ns)
    if not args.out:
        raise UserError("give --out DIR, the folder to write the export to")
    out = export(args.model, args.out, merge_lora=args.merge_lora, dtype=args.dtype)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({size / 2 ** 20:.1f} MiB); load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, "
          f"trust_remote_code=True) or dofattn generate --model {out}")
    return 0
