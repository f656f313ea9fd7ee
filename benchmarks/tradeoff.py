"""One picture of the long-context trade-off: memory per sequence at 8 K tokens against the perplexity ratio at 4–8 K
tokens of context, each point labelled with its recall (pass key + multi-key answered of 40).

    python benchmarks/tradeoff.py --teacher-cache-mib 360 --out docs/results/tradeoff-8k.png \
        --model "window=docs/results/long-document-default.json,docs/results/recall-default.json,7.27" \
        --model "recall=docs/results/long-document-recall.json,docs/results/recall-recall.json" \
        --model "long-context, layerwise on 2 K=docs/results/long-document-long-context-2k.json,docs/results/recall-long-context-2k.json" \
        --model "long-context (default)=docs/results/long-document-long-context.json,docs/results/recall-long-context.json"

Each --model is NAME=BY_POSITION_JSON,RECALL_JSON[,CACHE_MIB] (CACHE_MIB for a recall file that has no cache sizes): `dofattn eval --seq-len 8192` output (its last by-position bucket,
4096–8191 tokens of context) and `dofattn eval --recall` output (its records' answers, and the cache the model holds
at 8,192 tokens). The teacher's point: ratio 1, its answers from the first model's recall file, its KV cache as given.
"""

from __future__ import annotations

import argparse
import json

MIB = 2 ** 20


def point(by_position: str, recall: str, cache_mib: str | None = None, who: str = "student") -> dict:
    ratio = json.load(open(by_position))["by_position"]["ratio"][-1] if who == "student" else 1.0
    records = json.load(open(recall))["recall"]["records"]
    answered = sum(r[who]["correct"] for r in records)
    at_8k = [r[who].get("cache_bytes") for r in records if r["length"] == 8192]   # the teacher's: not recorded
    cache = float(cache_mib) if cache_mib else (at_8k[0] or 0) / MIB
    return {"ratio": ratio, "answered": answered, "of": len(records), "cache_mib": cache}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="NAME=BY_POSITION_JSON,RECALL_JSON[,CACHE_MIB]")
    parser.add_argument("--teacher-cache-mib", type=float, required=True,
                        help="the teacher's KV cache at 8 K tokens (MiB), as measured (recall-memory-default.json)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    points = {}
    for spec in args.model:
        name, files = spec.split("=", 1)
        points[name] = point(*files.split(","))
    first = args.model[0].split("=", 1)[1].split(",")[:2]
    teacher = point(*first, who="teacher")
    teacher["cache_mib"] = args.teacher_cache_mib
    points = {"teacher": teacher, **points}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, p in points.items():
        ax.scatter(p["cache_mib"], p["ratio"], s=60, color="black" if name == "teacher" else None, zorder=3)
        ax.annotate(f"{name}\nrecall {p['answered']}/{p['of']}", (p["cache_mib"], p["ratio"]),
                    textcoords="offset points", xytext=(8, -4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("memory per sequence at 8 K tokens (MiB, float32, log scale)")
    ax.set_ylabel("perplexity × teacher at 4–8 K tokens of context")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_title("SmolLM2-135M: memory against long-context quality", fontsize=10)
    x = [p["cache_mib"] for p in points.values()]
    ax.set_xlim(min(x) / 1.6, max(x) * 3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
        json.dump(points, f, indent=2)
    for name, p in points.items():
        print(f"{name:14} {p['cache_mib']:8.1f} MiB  ratio {p['ratio']:.2f}  recall {p['answered']}/{p['of']}")


if __name__ == "__main__":
    main()
