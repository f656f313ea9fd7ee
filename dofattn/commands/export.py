"""Write a student as a Hugging Face model folder that transformers loads with torch alone, without dofattn.

AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True) gives the student. OUT gets config.json (the
base config and the student's spec), modeling_dofattn.py and dofattn_code.py (the dofattn code the student runs,
copied), model.safetensors (every weight; the student's own tensors in float32; shards past 5 GB), the tokenizer,
a generation config and a model card with the run's evaluation numbers. `dofattn eval` and `dofattn generate` take OUT as --model.

    dofattn export --model runs/long-context --out exports/student
    dofattn export --model runs/window-lora --out exports/window-lora --merge-lora --dtype bfloat16
"""

from __future__ import annotations


from dofattn.commands import add_verb, config


def options() -> list[type]:
    from dofattn.jobs.export import ExportConfig
    return [ExportConfig]


def add_parser(verbs):
    return add_verb(verbs, "export", __doc__, options())


def run(ns) -> int:
    """The `export` verb: `jobs.export.run`."""
    from dofattn.jobs.export import ExportConfig, run as export
    out = export(config(ExportConfig, ns))
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({size / 2 ** 20:.1f} MiB); load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, "
          f"trust_remote_code=True) and its tokenizer with AutoTokenizer, trust_remote_code=True too (without it "
          f"transformers asks), or dofattn generate --model {out}")
    return 0
