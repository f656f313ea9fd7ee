"""What a gated student's gates do on real text: per layer, how far back each token lets the state reach.

    python experiments/gate_stats.py runs/hh-gate-mlp-bf16 [--blocks 8] [--seq-len 512] [--out gate-stats.json]

A gate multiplies the state by g_t before token t (`--gate`, `attention.LinearAttention`). Its half-life,
ln 2 / −ln g_t, is how many more tokens halve what the state holds: a token with a half-life under 1 all but
clears the state, one of thousands keeps it. Over the validation blocks of the run's data this prints, per layer,
the quantiles of the half-life over tokens and heads, the share of token-heads below 1 token and above 1 000,
and the half-lives the heads' decay rates alone would give (the gate at w = 0, where training started from).
Writes the numbers to JSON ("layers") and, with --plot, the half-life quantiles over layers to a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from dofattn.data import token_blocks
from dofattn.model.student import attention_modules, load_student

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


# what `collect` records: a method of the values, and the part of a LinearAttention that has it
RECORDED = {"log_gates": "decay"}


def collect(model, blocks: torch.Tensor, batch_size: int = 2) -> dict[str, dict[int, torch.Tensor]]:
    """{method: {layer: [N] float32 values of every token and head}} over `blocks`, from one pass of the model's own
    forward: the log gates ("log_gates") of the gated layers; a method no layer has maps to {}."""
    seen: dict[str, dict[int, list[torch.Tensor]]] = {method: {} for method in RECORDED}
    for i, module in enumerate(attention_modules(model)):
        linear = getattr(module, "dofattn", None)
        for method, name in RECORDED.items():
            part = None if linear is None else getattr(linear, name)
            if part is None or not hasattr(part, method):          # a per-head decay has no gates
                continue
            original = getattr(part, method)

            def record(v, i=i, original=original, parts=seen[method]):
                out = original(v)
                parts.setdefault(i, []).append(out.detach().flatten().float())
                return out

            setattr(part, method, record)
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            model(blocks[start:start + batch_size], use_cache=False)
    return {method: {i: torch.cat(parts) for i, parts in layers.items()} for method, layers in seen.items()}


def half_lives(log_gates: torch.Tensor) -> torch.Tensor:
    """ln 2 / -log g in tokens (inf where g = 1)."""
    return math.log(2) / (-log_gates.double()).clamp_min(1e-300)


def scored_text(folder: Path) -> str:
    """The text a run folder's student was scored on: its recipe's (or, for a run of the old flags, its run.json's)."""
    from dofattn.distill.run_folder import RECIPE_FILE, RunFolder

    if (folder / RECIPE_FILE).is_file():
        run = RunFolder(folder).recipe.run
        return run.eval_data or run.data
    old = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else {}
    return old.get("eval_data") or old.get("data") or "wiki-sample"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("student", help="a student folder distilled with --gate")
    parser.add_argument("--blocks", type=int, default=8, help="validation blocks (default: the runs' 8)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--data", default=None, help="text to read (default: the run's evaluation data)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=None, help="JSON file (default: gate-stats.json in the student folder)")
    parser.add_argument("--plot", default=None, help="PNG of the half-life quantiles over layers")
    args = parser.parse_args()

    folder = Path(args.student)
    model, tokenizer, config = load_student(folder, dtype=getattr(torch, args.dtype))
    data = args.data or scored_text(folder)
    blocks = token_blocks(data, tokenizer, args.seq_len, args.blocks, split="validation", seed=0)   # as distill and eval
    recorded = collect(model.eval(), blocks)
    gates = recorded["log_gates"]
    if not gates:
        raise SystemExit("this student has no gated layers (student.decay = gate)")
    rows = []
    if gates:
        print(f"{'layer':>5} " + " ".join(f"{'q' + str(int(q * 100)):>8}" for q in QUANTILES)
              + f" {'<1 tok':>7} {'>1000':>7} {'rates alone (min-max)':>22}")
    for i, logs in sorted(gates.items()):
        life = half_lives(logs)
        quantiles = torch.quantile(life.clamp_max(1e12)[torch.randperm(len(life))[:1_000_000]],
                                   torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
        linear = attention_modules(model)[i].dofattn
        rate_lives = half_lives(linear.decay.log_decay()).tolist()
        row = {"layer": i, "quantiles": dict(zip(map(str, QUANTILES), quantiles)),
               "below_1": (life < 1).double().mean().item(), "above_1000": (life > 1000).double().mean().item(),
               "rates_alone": rate_lives}
        rows.append(row)
        print(f"{i:>5} " + " ".join(f"{q:>8.3g}" for q in quantiles)
              + f" {row['below_1']:>7.3f} {row['above_1000']:>7.3f} {min(rate_lives):>10.3g}-{max(rate_lives):<10.3g}")
    out = Path(args.out) if args.out else folder / "gate-stats.json"
    out.write_text(json.dumps({"student": str(folder), "data": data, "blocks": args.blocks,
                               "seq_len": args.seq_len, "layers": rows}, indent=2))
    print(f"wrote {out}")
    if args.plot and rows:
        plot(rows, args.plot, folder.name)
        print(f"wrote {args.plot}")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in rows]
    q = {k: [r["quantiles"][k] for r in rows] for k in rows[0]["quantiles"]}
    fig, ax = plt.subplots(figsize=(9, 4), constrained_layout=True)
    ax.fill_between(layers, q["0.05"], q["0.95"], alpha=0.2, color="tab:blue", label="5-95% of token-heads")
    ax.fill_between(layers, q["0.25"], q["0.75"], alpha=0.4, color="tab:blue", label="25-75%")
    ax.plot(layers, q["0.5"], color="tab:blue", marker="o", ms=3, label="median")
    ax.plot(layers, [min(r["rates_alone"]) for r in rows], color="tab:red", ls="--", lw=1,
            label="decay rates alone (w = 0): shortest head")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("half-life of the state (tokens)")
    ax.set_title(f"{title}: each token's gate on validation text")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
