"""Which layers does linear attention hurt most end to end, and does the DoF predict it?

    python experiments/layer_sensitivity.py runs/fix --dof runs/default/dof.json \
        --out docs/results/layer-sensitivity.json --plot docs/results/layer-sensitivity.png
    python experiments/layer_sensitivity.py --replot docs/results/layer-sensitivity.json \
        --plot docs/results/layer-sensitivity.png                  # the figure again, from a kept JSON

For a trained pure-linear student (every layer linear, student.window = 0), on blocks of its run's
training split (so that choosing layers by it stays honest on held-out text):
    restore i     the student with layer i given back its exact softmax attention, every other layer linear:
                  how much of the student's KL to the teacher that one layer accounts for
    alone i       the teacher with only layer i linear: the layer's damage in isolation
    attention     where the teacher's attention in layer i goes: the first token, the last 4, the last 64
Then on the validation blocks its run evaluated on, with no retraining, the student with three layers restored:
the three with the largest restore gain, the first three, the three with the largest DoF, and three random ones
(a permutation drawn with --seed). The rank correlation of DoF with each layer's
gain says whether "hard to approximate in isolation" is the signal student.keep_softmax should follow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@torch.no_grad()
def attention_profile(model, ids: torch.Tensor, start: int = 64) -> list[dict]:
    """Per layer, where the teacher's attention goes, averaged over heads and the queries at positions >= `start`
    of `ids` [B, T]: the mass on the first token (the sink), on the last 4 tokens and on the last 64 (what a
    64-token window covers)."""
    from dofattn.model.capture import capture, run_forward
    from dofattn.evaluate import teacher_mode
    from dofattn.ops.softmax import attention_logits, expand_kv

    rows: dict[int, dict] = {}

    def sink(x) -> None:
        p = torch.softmax(attention_logits(x.query, expand_kv(x.key, x.num_heads), x.scaling), -1)   # [B, H, T, T]
        T = p.shape[-1]
        dist = torch.arange(T, device=p.device)[:, None] - torch.arange(T, device=p.device)[None, :]   # query − key
        p = p[:, :, start:]
        dist = dist[start:]
        rows[x.layer] = {"sink": p[..., 0].mean().item(), "last_4": (p * (dist < 4)).sum(-1).mean().item(),
                         "last_64": (p * (dist < 64)).sum(-1).mean().item()}

    with teacher_mode(model), capture(model, sink):
        run_forward(model, ids)
    return [rows[i] for i in sorted(rows)]


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def top(values: list[float], k: int) -> list[int]:
    return sorted(sorted(range(len(values)), key=lambda i: -values[i])[:k])


def run_text(folder: Path) -> tuple[str, int, int]:
    """(training text, validation block length, seed) of a `dofattn distill` run folder: its recipe.toml, or the
    run.json of a run made before recipes."""
    if (folder / "recipe.toml").is_file():
        from dofattn.distill.run_folder import RunFolder
        from dofattn.errors import UserError

        try:
            r = RunFolder(folder).recipe
        except UserError as err:
            raise SystemExit(str(err)) from None
        return r.run.data, r.eval.seq_len, r.run.seed
    if not (folder / "run.json").is_file():
        raise SystemExit(f"{folder} is not a `dofattn distill` run folder: it has no recipe.toml (or run.json)")
    run = json.loads((folder / "run.json").read_text())
    return run["data"], run["eval_seq_len"], run["seed"]


@contextlib.contextmanager
def softmax_in(model, layers: list[int]) -> Iterator[None]:
    """While active, the attention layers in `layers` run exact softmax attention; their linear parts come back
    after."""
    from dofattn.model.attach import attach, detach
    from dofattn.model.student import attention_modules, linear_parts

    modules, linear = attention_modules(model), linear_parts(model)
    taken = {i: detach(modules[i]) for i in layers if i in linear}
    try:
        yield
    finally:
        for i, (part, bounded) in taken.items():
            attach(modules[i], linear=part, bounded=bounded)


class AgainstTeacher:
    """`compare` of a student against its own base model, repeated on fixed `blocks` [N, T] while the student
    changes (layers switched back to softmax, say): the teacher's log-probabilities are computed once and held
    in memory (N·(T−1)·vocab floats)."""

    def __init__(self, student, blocks: torch.Tensor, batch_size: int = 2):
        device = next(student.parameters()).device
        self.student = student
        self.batches = [blocks[s:s + batch_size].to(device) for s in range(0, len(blocks), batch_size)]
        from dofattn.evaluate import _log_probs, teacher_mode

        with torch.no_grad(), teacher_mode(student):
            self.teacher = [list(_log_probs(student, ids)) for ids in self.batches]

    @torch.no_grad()
    def __call__(self) -> dict:
        from dofattn.evaluate import _chunk_targets, _log_probs, _Tally

        tally = _Tally()
        for ids, log_t in zip(self.batches, self.teacher):
            start = 0
            for log_s, chunk_t, targets in zip(_log_probs(self.student, ids), log_t, _chunk_targets(ids)):
                length = targets.numel() // ids.shape[0]
                tally.add(log_s, chunk_t, targets, length, start)
                start += length
        return tally.result()


def main() -> int:
    from tqdm.auto import tqdm

    from dofattn.data import token_blocks
    from dofattn.dof import DofResult
    from dofattn.model.student import attention_modules, load_student

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, nargs="?", help="a pure-linear student's run folder")
    parser.add_argument("--dof", type=Path, help="dof.json with the per-layer DoF to compare against")
    parser.add_argument("--blocks", type=int, default=2, help="training blocks for the per-layer sweep")
    parser.add_argument("--final-blocks", type=int, default=8, help="validation blocks for the keep-3 comparison")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the random draw of --keep layers")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--replot", type=Path, help="only draw --plot from this script's earlier --out JSON")
    args = parser.parse_args()
    if args.replot:
        if not args.plot:
            parser.error("--replot draws a figure: give --plot")
        plot(json.loads(args.replot.read_text()), args.plot)
        return 0
    if args.run is None or args.dof is None:
        parser.error("give a run folder and --dof (or --replot with an earlier --out)")

    data, seq_len, seed = run_text(args.run)
    model, tokenizer, config = load_student(args.run)
    model.eval()
    modules = attention_modules(model)
    if config.attention.window or len(config.layers) != len(modules):
        raise SystemExit(f"{args.run} is not a pure-linear student with every layer linear")
    dof = [layer.dof for layer in DofResult.from_json(args.dof.read_text()).layers]
    train = token_blocks(data, tokenizer, seq_len, args.blocks, split="train", seed=seed)
    valid = token_blocks(data, tokenizer, seq_len, args.final_blocks, split="validation", seed=0)

    sweep = AgainstTeacher(model, train)
    student = sweep()
    restore, alone = [], []
    for i in tqdm(range(len(modules)), desc="layers", unit="layer"):
        with softmax_in(model, [i]):
            restore.append(sweep())
        with softmax_in(model, [j for j in range(len(modules)) if j != i]):      # only layer i linear
            alone.append(sweep())
    gain = [student["kl"] - r["kl"] for r in restore]
    profile = attention_profile(model, train[:1])
    damage = [a["kl"] for a in alone]

    final = AgainstTeacher(model, valid)
    drawn = torch.randperm(len(modules), generator=torch.Generator().manual_seed(args.seed))[:args.keep]
    choices = {"largest restore gain": top(gain, args.keep), "first": list(range(args.keep)),
               "largest DoF": top(dof, args.keep), f"random (seed {args.seed})": sorted(drawn.tolist())}
    kept = {"none": {"layers": [], **final()}}
    final_teacher_ppl = kept["none"]["teacher_ppl"]
    for name, layers in choices.items():
        with softmax_in(model, layers):
            kept[name] = {"layers": layers, **final()}

    corr = {"dof vs restore gain": spearman(dof, gain), "dof vs alone damage": spearman(dof, damage),
            "alone damage vs restore gain": spearman(damage, gain),
            "depth vs restore gain": spearman([-float(i) for i in range(len(modules))], gain),
            "mass on the last 4 tokens vs restore gain": spearman([r["last_4"] for r in profile], gain)}
    print(f"teacher ppl {student['teacher_ppl']:.2f}, student ppl {student['ppl']:.2f} KL {student['kl']:.3f} "
          f"({args.blocks} training blocks)")
    print("| layer | DoF | KL with it restored | gain | KL with only it linear | teacher's mass: sink, last 4, "
          "last 64 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i in range(len(modules)):
        print(f"| {i} | {dof[i]:.1f} | {restore[i]['kl']:.3f} | {gain[i]:.3f} | {damage[i]:.4f} | "
              f"{profile[i]['sink']:.2f}, {profile[i]['last_4']:.2f}, {profile[i]['last_64']:.2f} |")
    print(f"\nkeep {args.keep} as softmax without retraining ({args.final_blocks} validation blocks, teacher ppl "
          f"{final_teacher_ppl:.2f}):")
    print("| chosen by | layers | ppl (× teacher) | KL | agreement |")
    print("|---|---|---:|---:|---:|")
    for name, row in kept.items():
        print(f"| {name} | {', '.join(map(str, row['layers'])) or '–'} | {row['ppl']:.1f} "
              f"({row['ppl'] / final_teacher_ppl:.2f}×) | {row['kl']:.3f} | {row['top1_agreement']:.3f} |")
    print("\nSpearman rank correlations: " + ", ".join(f"{k} {v:+.2f}" for k, v in corr.items()))

    result = {"command": " ".join(sys.argv), "run": str(args.run), "dof_file": str(args.dof), "dof": dof,
              "sweep_blocks": args.blocks, "final_blocks": args.final_blocks, "teacher_ppl": student["teacher_ppl"],
              "student": student, "restore": restore, "restore_gain": gain, "alone": alone, "attention": profile,
              "keep": kept, "final_teacher_ppl": final_teacher_ppl, "spearman": corr}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


def plot(result: dict, path: Path) -> None:
    """Per layer: the KL gain of restoring softmax, the damage of that layer alone linear, and the DoF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gain, damage, dof = result["restore_gain"], [a["kl"] for a in result["alone"]], result["dof"]
    layers = list(range(len(gain)))
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    axes[0].bar(layers, gain, color="tab:red")
    axes[0].set_ylabel("KL gain from\nrestoring softmax")
    axes[1].bar(layers, damage, color="tab:orange")
    axes[1].set_ylabel("KL with only\nthis layer linear")
    axes[2].bar(layers, dof, color="tab:blue")
    axes[2].set_ylabel("DoF")
    axes[2].set_xlabel("layer")
    fig.suptitle(f"{result['run']}: per-layer sensitivity against DoF "
                 f"(Spearman DoF vs gain {result['spearman']['dof vs restore gain']:+.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
