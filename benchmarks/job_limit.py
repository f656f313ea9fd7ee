"""The physical limit of a `dofattn distill` job on this machine: the FLOPs its stages must compute (counted on the
model built from its config: FlopCounterMode over fake tensors; matrix products and attention) at the rate this
machine computes one matrix product of the model's widths, beside what a run measured.

    python3 benchmarks/job_limit.py --recipe long-context --log runs/long-context/log.json --out limit.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def gemm_gflops(hidden: int, width: int, dtype: torch.dtype, device: str) -> float:
    """GFLOP/s of x [n, hidden] @ w [hidden, width], n sized to about 4 GFLOP a product: the best of 8 (what slows
    a product on a shared machine is noise; nothing makes it faster than the machine)."""
    n = max(64, min(4096, int(4e9 / (2 * hidden * width))))
    x = torch.randn(n, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, width, dtype=dtype, device=device)
    times = []
    for _ in range(8):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        x @ w
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n * hidden * width / min(times[1:]) / 1e9


def main() -> None:
    from dofattn import recipe as recipes
    from dofattn.distill.costs import forward_counts, layerwise_step_counts
    from dofattn.distill.plan import make_plan
    from dofattn.recipe import DOF_BLOCKS, DOF_SEQ_LEN
    from dofattn.model.hf import model_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="long-context")
    parser.add_argument("--log", help="a finished run's log.json: its stage times beside the limits")
    parser.add_argument("--out", help="write the figures as JSON")
    args = parser.parse_args()

    recipe = recipes.load(args.recipe)
    config = model_config(recipe.run.model)
    plan = make_plan(recipe, 1, config=config, device="cpu")      # with the end-to-end step's FLOPs
    L, lw, e2e, ev = plan.layers, recipe.layerwise, recipe.end_to_end, recipe.eval
    dtype = getattr(torch, recipe.run.dtype)
    rate = max(gemm_gflops(L.hidden, L.intermediate, dtype, "cpu") for _ in range(3)) * 1e9
    log = json.loads(open(args.log).read()) if args.log else {}

    def body(batch, length):
        return forward_counts(config, dtype, batch, length, logits=False)[1]

    head = 2 * L.hidden * L.vocab                                  # per scored token
    last = L.count if L.keep_softmax else max(L.linear) + 1       # kept layers chosen at run time: any may be last
    flops = {
        "dof": DOF_BLOCKS * (body(1, DOF_SEQ_LEN) + DOF_SEQ_LEN * head),
        "layerwise (teacher)": lw.blocks * body(1, lw.seq_len) * last / L.count,
        "layerwise (steps)": len(L.linear) * lw.steps * layerwise_step_counts(recipe, plan)[1],
        "end_to_end": e2e.steps * plan.end_to_end_flops,
        "evaluate": 3 * ev.blocks * (body(1, ev.seq_len) + ev.seq_len * head),
    }
    measured = dict(log.get("seconds", {}))
    if "layerwise" in measured:                     # the layer logs time the steps; the rest is the teacher's
        steps = sum(entry["seconds"] for entry in log["layers"].values())
        measured["layerwise (steps)"], measured["layerwise (teacher)"] = steps, measured["layerwise"] - steps
    rows = []
    for name, f in flops.items():
        seconds = measured.get(name)
        rows.append({"stage": name, "gflop": f / 1e9, "limit_s": f / rate, "measured_s": seconds})
    total = sum(flops.values())
    result = {"recipe": recipe.name, "model": recipe.run.model, "gemm_gflops": rate / 1e9, "stages": rows,
              "total_gflop": total / 1e9, "limit_s": total / rate,
              "measured_s": sum(log.get("seconds", {}).values()) or None}
    print(f"{recipe.name} on {recipe.run.model}: one {L.hidden} x {L.intermediate} matrix product at "
          f"{rate / 1e9:.0f} GFLOP/s ({recipe.run.dtype})")
    print(f"{'stage':<22}{'GFLOP':>10}{'limit s':>10}{'measured s':>12}")
    for r in rows:
        measured = f"{r['measured_s']:.0f}" if r["measured_s"] is not None else "-"
        print(f"{r['stage']:<22}{r['gflop']:>10.0f}{r['limit_s']:>10.0f}{measured:>12}")
    print(f"{'job':<22}{total / 1e9:>10.0f}{total / rate:>10.0f}"
          f"{result['measured_s'] or 0:>12.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
