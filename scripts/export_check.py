"""Does a trained student's export give what the student gives, loaded where dofattn is not? One real prompt:
the logits along it, the greedy continuation after it.

    python3 scripts/export_check.py runs/gemma exports/gemma --prompt-tokens 512 --new-tokens 32 --out check.json

EXPORT is written by `dofattn export --model RUN --out EXPORT` where it is not there yet. The student runs here
(dofattn's loader), the export in a fresh Python process in which dofattn cannot be imported (a finder refuses it)
and which has neither the checkout nor PYTHONPATH: `from_pretrained(EXPORT, trust_remote_code=True)` with its
tokenizer, as the export's model card says, then the same `generate` call. Both in float32 (the export's own
dtype set aside) so that they can agree to rounding. The prompt is the first validation block of the student's
text (--data), led by the tokenizer's BOS where it adds one. Exit 1 where the tokens differ or the logits differ by more
than --atol.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RELOAD = r"""
import json, sys, time


class NoDofattn:
    def find_spec(self, name, path=None, target=None):
        if name == "dofattn" or name.startswith("dofattn."):
            raise ImportError(f"{name}: dofattn is not installed here")


sys.meta_path.insert(0, NoDofattn())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, inputs, out, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
loaded = time.perf_counter() - start
ids = torch.load(inputs)
with torch.no_grad():
    logits = model(ids, use_cache=False).logits.float()[0]
    tokens = model.generate(ids, max_new_tokens=new, do_sample=False)
torch.save({"last": logits[-8:], "argmax": logits.argmax(-1), "tokens": tokens, "load_s": loaded,
            "dofattn imported": sorted(m for m in sys.modules if m.split(".")[0] == "dofattn")}, out)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a student folder (dofattn distill --out)")
    parser.add_argument("export", type=Path, help="its export (written here if it is not there)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--data", default="wiki-sample", help="the text the prompt is cut from (as --data)")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest difference of a logit allowed")
    parser.add_argument("--out", type=Path, help="JSON of the comparison")
    args = parser.parse_args()

    import torch

    from dofattn.data import token_blocks
    from dofattn.jobs import load_for_job

    if not args.export.exists():
        subprocess.run([sys.executable, "-m", "dofattn", "export", "--model", str(args.run), "--out",
                        str(args.export)], check=True)
    model, tokenizer, spec = load_for_job(str(args.run), None, "fix", dtype=torch.float32, device="cpu",
                                          merge_lora=True)
    ids = token_blocks(args.data, tokenizer, args.prompt_tokens, 1, split="validation")
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.float()[0]
        tokens = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(ids, Path(tmp) / "ids.pt")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        env.update(HF_MODULES_CACHE=str(Path(tmp) / "hf-modules"), HF_HUB_OFFLINE="1")
        subprocess.run([sys.executable, "-c", RELOAD, str(args.export.resolve()), str(Path(tmp) / "ids.pt"),
                        str(Path(tmp) / "got.pt"), str(args.new_tokens)], env=env, cwd=tmp, check=True)
        got = torch.load(Path(tmp) / "got.pt")
    new = slice(ids.shape[1], None)
    result = {
        "run": str(args.run), "export": str(args.export), "student": "; ".join(spec.describe()),
        "prompt_tokens": ids.shape[1], "new_tokens": args.new_tokens,
        "max_logit_difference_last_8": (got["last"] - logits[-8:]).abs().max().item(),
        "argmax_agreement_along_prompt": (got["argmax"] == logits.argmax(-1)).float().mean().item(),
        "same_tokens": bool(torch.equal(got["tokens"], tokens)),
        "student_text": tokenizer.decode(tokens[0, new]), "export_text": tokenizer.decode(got["tokens"][0, new]),
        "export_load_s": got["load_s"], "dofattn_imported_there": got["dofattn imported"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    ok = result["same_tokens"] and result["max_logit_difference_last_8"] <= args.atol \
        and not result["dofattn_imported_there"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
