"""How many PyTorch operations one decode token costs: the teacher against its linearized students, on CPU.

    python benchmarks/decode_ops.py [--context 128] [--out decode_ops.json]

On a 2-core CPU a decode step of SmolLM2-135M is bound by the number of small operations, not by arithmetic, so
the count of aten operators per token (torch.profiler, one cached forward of one token after a prompt of
`--context` tokens) says how far a student's step is from the teacher's. The count does not depend on the
machine's load, unlike a time. Students are untrained (64 PRF features per layer): the count does not depend on
training. Rows: the teacher (SDPA, KV cache), the pure linear student, and the `default` recipe's shape (window 64,
sink 4), each through HF's cached forward (what `generate` runs per token).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dofattn.attention.cache import cache_kwargs  # noqa: E402
from dofattn.model.hf import load_model  # noqa: E402
from dofattn.model.student import attention_modules, linearize  # noqa: E402
from dofattn.spec import Attention


def aten_ops(run) -> Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


@torch.no_grad()
def count(window: int | None, sink: int, context: int) -> dict:
    from transformers import DynamicCache

    model, _ = load_model("smollm2-135m")
    if window is not None:
        linearize(model, [64] * len(attention_modules(model)), Attention(feature="prf", window=window, sink=sink))
    ids = torch.randint(100, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    token = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    ops = aten_ops(lambda: model(input_ids=token, use_cache=True, **cache_kwargs(model, cache)))
    return {"total": sum(ops.values()), "top": ops.most_common(8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--out", default="decode_ops.json")
    args = parser.parse_args()
    rows = {"teacher": count(None, 0, args.context), "pure linear": count(0, 0, args.context),
            "window 64 + sink 4": count(64, 4, args.context)}
    teacher = rows["teacher"]["total"]
    for name, row in rows.items():
        print(f"{name:>20}  {row['total']:>6} aten ops per token  ({row['total'] / teacher:.1f}x the teacher's)")
    Path(args.out).write_text(json.dumps({"context": args.context, "torch": torch.__version__, "rows": rows},
                                         indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
