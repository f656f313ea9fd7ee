"""Peak memory of `dofattn eval` at length, above the loaded student, with eval's default options otherwise.

    python benchmarks/eval_memory.py runs/long-context --seq-len 8192 --num-blocks 2 --out eval_memory.json
    python benchmarks/eval_memory.py runs/long-context --batch-size 2      # two 8 K blocks a forward (CPU A: 1.96 GiB)

Runs the eval job (`jobs.eval.run`: perplexity and KL against the teacher by position, and the per-layer errors on
`--layer-blocks` blocks, as `dofattn eval` does by default) in this process and reads the process's peak resident
set from the moment the student is loaded to the end (`bench.PeakMemory`: VmHWM, reset through
/proc/self/clear_refs; Linux): what evaluation adds above the model. Issue 59's bound at 8 K tokens: 2 GiB.
"""

from __future__ import annotations

import argparse
import json
import time

GIB = 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a student: run folder or export")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--num-blocks", type=int, default=2)
    parser.add_argument("--layer-blocks", type=int, default=2, help="eval's default")
    parser.add_argument("--batch-size", type=int, default=None, help="eval's default: auto (1 past 2048 tokens)")
    parser.add_argument("--out", default="eval_memory.json")
    args = parser.parse_args()

    from dofattn import exported
    from dofattn.jobs import eval as eval_job
    from dofattn.jobs.bench import PeakMemory

    memory = PeakMemory("cpu")
    load_any = exported.load_any

    def loaded_then_measured(*a, **kw):           # the peak counts from the loaded student on
        result = load_any(*a, **kw)
        memory.start()
        return result

    exported.load_any = loaded_then_measured
    start = time.perf_counter()
    result = eval_job.run(eval_job.EvalConfig(model=args.model, seq_len=args.seq_len, num_blocks=args.num_blocks,
                                              layer_blocks=args.layer_blocks, batch_size=args.batch_size, out=None))
    row = {"model": args.model, "seq_len": args.seq_len, "num_blocks": args.num_blocks,
           "layer_blocks": args.layer_blocks, "batch_size": args.batch_size, "seconds": time.perf_counter() - start,
           "peak_above_model_gib": memory.above() / GIB, "ratio": result["ppl"] / result["teacher_ppl"]}
    print(json.dumps(row, indent=2))
    with open(args.out, "w") as f:
        json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
