"""A markdown table of finished `dofattn distill` runs, read from their log.json files.

    python benchmarks/runs_table.py runs/distill runs/window64 runs/keep3-dof --out docs/results/fidelity.json
    python benchmarks/runs_table.py runs/w64-dof-s* runs/w64-fix-s* --by-seed       # mean ± sd over seeds
    python benchmarks/runs_table.py runs/window64 runs/w64-lora8 --curves curves.png  # ppl against tokens
    python benchmarks/runs_table.py runs/wl-* --by-seed --at-tokens 163840   # pooled at one point of the curves
    python benchmarks/runs_table.py docs/results/distill-fix.json            # a kept log.json stands for its run
    python benchmarks/runs_table.py runs/a runs/b --loss-windows 25 --from-step 228   # training loss, step windows
    python benchmarks/runs_table.py runs/a --fit-until 250000    # a power law through the curve, and what it predicts
    python benchmarks/runs_table.py runs/a --fresh-from 600      # training loss on blocks met before against new ones

One row per run folder: what differs from its recipe (the recipe keys that differ from its named packaged recipe;
for a run made before recipes, the flags that differ from its --recipe's defaults), validation perplexity after
layerwise training and at the end (and the ratio to the teacher's), KL(teacher ‖ student) per token, top-1
agreement, the softmax layers kept, and the run's own stage timings. The JSON collects the same rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# --- logs written before recipes (dofattn ≤ 0.1.0 flags) ----------------------------------------------------------
# Those runs recorded their `dofattn distill` flags (run.json; a kept log.json under "args") and their end-to-end
# phase under "direct". dofattn no longer reads those flags, so what the table needs of them is kept here as data.

OLD_SHOWN = ("recipe", "data", "eval_data", "continue_from", "dims", "feature", "loss", "window", "keep_softmax",
             "keep_by", "progressive", "per_head", "lora_rank", "lora_targets", "steps", "then_direct_steps",
             "direct_seq_len", "direct_batch_size", "direct_blocks", "direct_lr", "cooldown_steps", "kd_weight",
             "lm_weight", "hidden_weight", "dof_repeats", "lam_auto", "decay", "decay_start", "gate", "conv",
             "conv_lr", "delta", "delta_lr", "sink", "dtype")
# The flags' defaults as dofattn 0.1.0 had them (those the table reads); None: set by the recipe (OLD_RECIPES).
OLD_DEFAULTS = {"recipe": "dofattn", "data": "wiki-sample", "eval_data": None, "continue_from": None, "dims": "dof",
                "feature": "prf", "loss": "softmax", "window": None, "keep_softmax": 0, "keep_by": "attn-dof",
                "progressive": False, "per_head": False, "lora_rank": None, "lora_targets": "attention",
                "steps": 150, "then_direct_steps": None, "direct_seq_len": None, "direct_batch_size": None,
                "direct_blocks": None, "direct_lr": 0.002, "cooldown_steps": 0, "kd_weight": 1.0, "lm_weight": 1.0,
                "hidden_weight": 0.0, "dof_repeats": 1, "lam_auto": False, "decay": False, "gate": False, "conv": 0,
                "conv_lr": None, "delta": False, "delta_lr": None, "sink": None, "dtype": "float32",
                "train_blocks": 64, "seq_len": 256, "eval_seq_len": 512}
# Flags added over time, with the value that reproduces a run recorded before each existed.
OLD_LATER = {"window": 0, "keep_softmax": 0, "keep_by": "dof", "lora_rank": 0, "eval_every": 0,
             "progressive": False, "per_head": False, "dof_repeats": 1, "recipe": "paper", "direct_seq_len": None,
             "direct_blocks": None, "lam_auto": False, "decay": False, "decay_start": None, "sink": 0,
             "eval_data": None, "continue_from": None, "cooldown_steps": 0, "lora_targets": "attention",
             "gate": False, "hidden_weight": 0.0, "conv": 0, "conv_lr": None, "delta": False, "delta_lr": None,
             "lm_weight": 1.0}
# What each old --recipe set for the flags left unset (None); a callable reads the value off the other flags.
OLD_RECIPES = {"dofattn": {"window": 64, "direct_seq_len": lambda a: a["eval_seq_len"], "direct_batch_size": 1,
                           "lora_rank": 0, "then_direct_steps": 30,
                           "sink": lambda a: 4 if a["window"] and not a["decay"] else 0},
               "paper": {"window": 0, "direct_batch_size": 2, "lora_rank": 0, "then_direct_steps": 30, "sink": 0}}
OLD_RECIPES["long"] = {**OLD_RECIPES["dofattn"], "direct_batch_size": 2, "lora_rank": 8, "then_direct_steps": 400,
                       "direct_blocks": 1200}


def old_arguments(**flags) -> dict:
    """The arguments an old `dofattn distill` run with these flags recorded: the defaults, then its recipe's values
    for the flags left unset (what run.json holds, as far as the table reads it)."""
    args = {**OLD_DEFAULTS, **flags}
    if args["recipe"] not in OLD_RECIPES:
        raise SystemExit(f"unknown old recipe {args['recipe']!r}; those runs had one of {', '.join(OLD_RECIPES)}")
    for name, value in OLD_RECIPES[args["recipe"]].items():
        if args.get(name) is None:
            args[name] = value(args) if callable(value) else value
    return args


def old_inert(args: dict) -> set[str]:
    """Flags that changed nothing in a run: --keep-by without softmax layers, --sink without a window."""
    inert = set() if args.get("keep_softmax", OLD_LATER["keep_softmax"]) else {"keep_by"}
    return inert if args.get("window", OLD_LATER["window"]) else inert | {"sink"}


def old_effective(args: dict) -> dict:
    """The run's shown flags with what a None stands for spelled out (the direct phase's blocks and block length:
    the layerwise ones)."""
    out = {k: args.get(k, OLD_LATER.get(k)) for k in OLD_SHOWN}
    for k in old_inert(out):
        out[k] = None
    merged = {**args, **out}
    out["direct_blocks"] = merged["direct_blocks"] or merged["train_blocks"]
    out["direct_seq_len"] = merged["direct_seq_len"] or merged["seq_len"]
    return out


def describe_old(args: dict, log: dict, name: str) -> dict:
    """The row of a run recorded with the old flags (`args`: its run.json)."""
    run = old_effective(args)
    default = old_effective(old_arguments(recipe=args.get("recipe", OLD_LATER["recipe"])))
    skip = old_inert(run)    # flags that change nothing in this run are no difference, whatever the recipe's
    changed = {k: v for k, v in run.items() if k not in skip and v != default[k]}
    # the same run described against one reference (the dofattn recipe), so that runs of either recipe that train
    # the same student group together over seeds; "recipe" is only a preset and is left out
    reference = old_effective(old_arguments(recipe="dofattn"))
    setting = {k: v for k, v in run.items() if k != "recipe" and k not in skip and v != reference[k]}
    return row(log, name, changed, setting, args.get("seed", 0), log.get("direct", {}), run["direct_blocks"],
               run["direct_batch_size"])


# --- run folders of recipes ---------------------------------------------------------------------------------------

# Keys that do not change the student: left out of what differs (the seed is a column of its own).
NOT_A_DIFFERENCE = ("run.seed", "end_to_end.eval_every", "end_to_end.checkpoint_every")


def describe_recipe_run(folder: Path) -> dict:
    """The row of a run folder with recipe.toml: its settings are the recipe keys that differ from its named
    packaged recipe (a recipe of another name: from the window recipe, with its name)."""
    from dofattn import recipe as recipes
    from dofattn.distill.run_folder import RunFolder

    log = RunFolder(folder).log
    if log is None or "evaluation" not in log or "recipe" not in log:
        raise SystemExit(f"{folder} has no finished log.json: give the folders of finished `dofattn distill` runs")
    keys = {k: v for k, v in log["recipe"].items() if k != "name"}
    name = log["recipe"].get("name", "window")
    name = recipes.RENAMED.get(name, name)          # a run from before the recipes were renamed
    known = name in recipes.packaged()

    def differ(reference: str) -> dict:
        ref = recipes.load(reference).keys()
        return {k: v for k, v in keys.items() if k not in NOT_A_DIFFERENCE and v != ref.get(k)}

    changed = differ(name if known else "window")
    if not known:
        changed = {"recipe": name, **changed}
    e2e = log.get("end_to_end", {})
    blocks = keys.get("end_to_end.blocks") or keys.get("layerwise.blocks")
    return row(log, folder.name, changed, differ("window"), keys.get("run.seed", 0), e2e, blocks,
               keys.get("end_to_end.batch_size"))


def row(log: dict, name: str, changed: dict, setting: dict, seed: int, e2e: dict, blocks: int | None,
        batch_size: int | None) -> dict:
    ev = log["evaluation"]
    return {"run": name, "changed": changed, "setting": setting, "seed": seed,
            "dims": [min(log["dims"]), max(log["dims"])],
            "softmax_layers": log.get("softmax_layers", []), "teacher_ppl": ev["teacher_ppl"],
            "layerwise_ppl": ev.get("layerwise_student_ppl"), "ppl": ev["student_ppl"],
            "vs_teacher": ev["student_ppl"] / ev["teacher_ppl"], "kl": ev.get("kl"),
            "top1_agreement": ev.get("top1_agreement"),
            "seconds": log["seconds"], "curve": e2e.get("curve", []),
            "direct_blocks": blocks, "direct_batch_size": batch_size,
            "losses": e2e.get("losses", [])}


def describe(path: Path) -> dict:
    """The row of a run folder (recipe.toml, or an old one's run.json, beside log.json) or of a kept log.json."""
    if path.is_file():  # a kept log (docs/results/distill-*.json): an old run's log.json, which holds its flags too
        try:
            log = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            log = {}
        if not isinstance(log, dict) or "args" not in log or "evaluation" not in log:
            raise SystemExit(f"{path} is not a `dofattn distill` log.json")
        return describe_old(log["args"], log, Path(log["args"]["out"]).name)
    if (path / "recipe.toml").is_file():
        return describe_recipe_run(path)
    if not (path / "run.json").is_file() or not (path / "log.json").is_file():
        raise SystemExit(f"{path} has no recipe.toml (or run.json) and log.json: give the folders of finished "
                         f"`dofattn distill` runs, or their log.json files")
    return describe_old(json.loads((path / "run.json").read_text()), json.loads((path / "log.json").read_text()),
                        path.name)


def loss_windows(rows: list[dict], size: int, start: int = 0) -> tuple[list[tuple[int, int]], list[list[float]]]:
    """Mean end-to-end training loss of each run over windows of `size` steps from step `start`, up to the last
    step every run reached (runs with the same --seed train on the same batches step for step, so the windows
    compare them on the same text): ([(first, last + 1)] per window, [[mean] per window] per run)."""
    end = min(len(r["losses"]) for r in rows)
    if end <= start:
        raise SystemExit(f"--from-step {start}: a run has only {end} end-to-end steps")
    bounds = [(a, min(a + size, end)) for a in range(start, end, size)]
    return bounds, [[sum(r["losses"][a:b]) / (b - a) for a, b in bounds] for r in rows]


def fresh_and_seen(row: dict, start: int, window: int = 50) -> dict:
    """The run's end-to-end training loss from step `start` on, split by whether the step's blocks were drawn at an
    earlier step: steps whose blocks are all new, steps whose blocks were all met before (the rest left out).

    New blocks grow rarer as the run goes on while the loss falls, so the plain means differ by the trend too.
    `difference` compares like with like: in each window of `window` steps that has both kinds, the mean loss on
    blocks met before minus that on new ones, averaged over those windows.

    distill draws each step's blocks with replacement from (seed, step) alone (`end_to_end.draw`), so the draws are
    replayed here (one process; a torchrun run splits its draws across ranks and logs rank 0's loss). Both kinds are
    random draws from the same blocks at the same stage of training, so a lower loss on the blocks met before is
    what the student has learned of those blocks' text, not of text in general."""
    from dofattn.distill.end_to_end import draw

    seen: set[int] = set()
    fresh: dict[int, list[float]] = {}    # window -> the losses of its steps on new blocks
    again: dict[int, list[float]] = {}    # ... on blocks met before
    for step, loss in enumerate(row["losses"]):
        drawn = draw(row["seed"], step, row["direct_blocks"], row["direct_batch_size"]).tolist()
        if step >= start:
            met = [d in seen for d in drawn]
            if not any(met):
                fresh.setdefault((step - start) // window, []).append(loss)
            elif all(met):
                again.setdefault((step - start) // window, []).append(loss)
        seen.update(drawn)
    mean = lambda xs: sum(xs) / len(xs)   # noqa: E731
    paired = [mean(again[w]) - mean(fresh[w]) for w in sorted(fresh) if w in again]
    if not paired:
        raise SystemExit(f"{row['run']}: from step {start} of {len(row['losses'])}, no window of {window} steps has "
                         f"steps on new blocks and on blocks met before; try an earlier --fresh-from or a wider "
                         f"--fresh-window")
    fresh_all, again_all = sum(fresh.values(), []), sum(again.values(), [])
    return {"run": row["run"], "from_step": start, "window": window, "fresh_steps": len(fresh_all),
            "fresh_loss": mean(fresh_all), "seen_steps": len(again_all), "seen_loss": mean(again_all),
            "windows": len(paired), "difference": mean(paired), "blocks_met": len(seen),
            "blocks": row["direct_blocks"]}


def markdown(rows: list[dict]) -> str:
    lines = ["| run | differs from its recipe's defaults | ppl after layerwise | final ppl (× teacher) | KL | "
             "agreement | softmax layers |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        changed = ", ".join(f"{k}={v}" for k, v in r["changed"].items()) or "(its recipe's defaults)"
        layerwise = f"{r['layerwise_ppl']:.1f}" if r["layerwise_ppl"] else "–"
        kl = "–" if r["kl"] is None else f"{r['kl']:.3f}"
        agreement = "–" if r["top1_agreement"] is None else f"{r['top1_agreement']:.3f}"
        lines.append(f"| {r['run']} | {changed} | {layerwise} | {r['ppl']:.1f} ({r['vs_teacher']:.2f}×) | {kl} | "
                     f"{agreement} | {r['softmax_layers'] or '–'} |")
    return "\n".join(lines)


def at_tokens(row: dict, tokens: int) -> float:
    """The run's validation perplexity / teacher's at `tokens` end-to-end tokens, read off its curve."""
    for point in row["curve"]:
        if point["tokens"] == tokens:
            return point["ppl"] / row["teacher_ppl"]
    have = ", ".join(str(p["tokens"]) for p in row["curve"]) or "none (run it with --eval-every)"
    raise SystemExit(f"{row['run']} has no validation point at {tokens} end-to-end tokens; it has: {have}")


def seed_summary(rows: list[dict], tokens: int | None = None) -> list[dict]:
    """Runs that train the same student but for --seed, pooled: mean and sample standard deviation of the final
    ratio to the teacher, with the seeds. `changed` is against the window recipe (before recipes: the dofattn
    recipe, its forerunner).

    With `tokens`, the ratio is read off each run's curve at that many end-to-end tokens instead, and runs that
    differ only in how many end-to-end steps they were given pool too: the end-to-end phase has a constant learning
    rate and draws each step's blocks from (seed, step), so a shorter run is the start of a longer one."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        setting = {k: v for k, v in r["setting"].items()
                   if tokens is None or k not in ("then_direct_steps", "end_to_end.steps")}
        groups.setdefault(json.dumps(setting, sort_keys=True), []).append(r)
    summary = []
    for key, members in groups.items():
        seeds = [m["seed"] for m in members]
        if len(set(seeds)) < len(seeds):   # with `tokens`, a shorter run of a seed is the start of a longer one
            twice = sorted({seed for seed in seeds if seeds.count(seed) > 1})
            raise SystemExit(f"runs {', '.join(m['run'] for m in members if m['seed'] in twice)} train the same "
                             f"student with the same seed ({twice}): give one folder per seed")
        ratios = [m["vs_teacher"] if tokens is None else at_tokens(m, tokens) for m in members]
        mean = sum(ratios) / len(ratios)
        sd = (sum((x - mean) ** 2 for x in ratios) / (len(ratios) - 1)) ** 0.5 if len(ratios) > 1 else 0.0
        summary.append({"changed": json.loads(key), "seeds": [m["seed"] for m in members], "runs": len(members),
                        "vs_teacher_mean": mean, "vs_teacher_sd": sd, "vs_teacher": ratios})
    return summary


def power_fit(row: dict, until: int, start: int = 0, targets: tuple[float, ...] = (1.5, 1.25)) -> dict:
    """A power law through the run's validation curve, ratio − 1 = a · tokensᵇ (least squares on log-log), fitted to
    the points with `start` ≤ end-to-end tokens ≤ `until`: the exponent b, where the law puts each later point of
    the curve beside where it was, and how many tokens the law says each target ratio takes. A law with no floor:
    what it says beyond the fitted range is a trend, not a promise; the later points show how far it held."""
    import numpy as np

    points = [(c["tokens"], c["ppl"] / row["teacher_ppl"]) for c in row["curve"]]
    fitted = [(t, r) for t, r in points if start <= t <= until and t > 0]
    if len(fitted) < 2 or any(r <= 1 for _, r in fitted):
        raise SystemExit(f"{row['run']}: a power law needs at least 2 validation points above the teacher between "
                         f"{start} and {until} end-to-end tokens; it has "
                         f"{', '.join(f'{t}: {r:.3f}' for t, r in points) or 'no curve (run it with --eval-every)'}")
    b, log_a = np.polyfit(np.log([t for t, _ in fitted]), np.log([r - 1 for _, r in fitted]), 1)
    predict = lambda tokens: 1 + float(np.exp(log_a + b * np.log(tokens)))   # noqa: E731
    later = [{"tokens": t, "ratio": r, "law": predict(t)} for t, r in points if t > until]
    reach = {str(g): (float(np.exp((np.log(g - 1) - log_a) / b)) if b < 0 else None) for g in targets}
    return {"run": row["run"], "points": len(fitted), "from": fitted[0][0], "until": fitted[-1][0],
            "exponent": float(b), "a": float(np.exp(log_a)), "later": later, "tokens_to": reach}


IMAGE_SUFFIXES = (".png", ".pdf", ".svg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="finished run folders, or their log.json files (as kept in "
                                                "docs/results/distill-*.json)")
    parser.add_argument("--out", help="also write the rows as JSON")
    parser.add_argument("--by-seed", action="store_true", help="also pool runs that differ only in --seed: mean ± "
                                                               "standard deviation of the ratio to the teacher")
    parser.add_argument("--at-tokens", type=int, help="with --by-seed: pool the ratio at this many end-to-end "
                                                          "tokens, read off each run's curve, not the final one")
    parser.add_argument("--curves", help="also draw validation perplexity against end-to-end tokens (runs made "
                                         "with --eval-every) into this image")
    parser.add_argument("--loss-windows", type=int, metavar="K", help="also print each run's mean end-to-end "
                                                                     "training loss over windows of K steps")
    parser.add_argument("--from-step", type=int, default=0, help="with --loss-windows: the first step counted")
    parser.add_argument("--fresh-from", type=int, metavar="STEP", help="also print each run's mean end-to-end "
                        "training loss from STEP on, on blocks drawn for the first time against blocks met before")
    parser.add_argument("--fresh-window", type=int, default=50, metavar="K", help="with --fresh-from: compare the "
                        "two kinds of step within windows of K steps (the loss falls as the run goes on)")
    parser.add_argument("--fit-until", type=int, metavar="TOKENS", help="also fit ratio − 1 = a · tokensᵇ to each "
                        "run's curve up to TOKENS end-to-end tokens; print the law against the later points and the "
                        "tokens it gives each target")
    parser.add_argument("--fit-from", type=int, default=0, metavar="TOKENS", help="with --fit-until: the first "
                                                                                 "point fitted")
    parser.add_argument("--targets", type=float, nargs="+", default=[1.5, 1.25], help="with --fit-until: the ratios "
                                                                                        "to the teacher to reach")
    args = parser.parse_args()
    if args.loss_windows is not None and args.loss_windows < 1:
        parser.error(f"--loss-windows must be at least 1 step, got {args.loss_windows}")
    if args.fresh_from is not None and args.fresh_from < 0:
        parser.error(f"--fresh-from must be a step, 0 or more, got {args.fresh_from}")
    if args.fresh_window < 1:
        parser.error(f"--fresh-window must be at least 1 step, got {args.fresh_window}")
    if args.fit_until is not None and args.fit_until <= args.fit_from:
        parser.error(f"--fit-until {args.fit_until} must be above --fit-from {args.fit_from}")
    if any(g <= 1 for g in args.targets):
        parser.error(f"--targets are ratios to the teacher's perplexity above 1, got {args.targets}")
    if args.at_tokens is not None and not args.by_seed:
        parser.error("--at-tokens pools runs over seeds: add --by-seed")
    for flag, path in (("--out", args.out), ("--curves", args.curves)):
        if path and Path(path).is_dir():
            parser.error(f"{flag} {path} is a folder; give a file name")
    if args.curves and Path(args.curves).suffix.lower() not in IMAGE_SUFFIXES:
        parser.error(f"--curves {args.curves}: give an image file name ending in {', '.join(IMAGE_SUFFIXES)}")
    rows = [describe(Path(f)) for f in args.runs]
    print(f"teacher ppl {rows[0]['teacher_ppl']:.2f}\n{markdown(rows)}")
    result = rows
    if args.by_seed:
        summary = seed_summary(rows, args.at_tokens)
        what = "final ppl" if args.at_tokens is None else f"ppl at {args.at_tokens} end-to-end tokens"
        print(f"\n| differs from the window recipe | seeds | {what} × teacher, mean ± sd | each |\n"
              "|---|---|---:|---|")
        for g in summary:
            changed = ", ".join(f"{k}={v}" for k, v in g["changed"].items()) or "(the window recipe)"
            each = ", ".join(f"{x:.3f}" for x in g["vs_teacher"])
            print(f"| {changed} | {g['seeds']} | {g['vs_teacher_mean']:.3f} ± {g['vs_teacher_sd']:.3f} | {each} |")
        result = {"runs": rows, "by_seed": summary, "at_tokens": args.at_tokens}
    if args.loss_windows:
        bounds, means = loss_windows(rows, args.loss_windows, args.from_step)
        print("\n| steps | " + " | ".join(f"{a}–{b}" for a, b in bounds) + " | all |\n|---|"
              + "---:|" * (len(bounds) + 1))
        first, last = bounds[0][0], bounds[-1][1]
        for row, m in zip(rows, means):
            total = sum(row["losses"][first:last]) / (last - first)
            print(f"| {row['run']} | " + " | ".join(f"{x:.3f}" for x in m) + f" | {total:.3f} |")
    if args.fresh_from is not None:
        splits = [fresh_and_seen(row, args.fresh_from, args.fresh_window) for row in rows]
        print(f"\n| run | steps from {args.fresh_from} on new blocks | their loss | on blocks met before | their loss "
              f"| met before − new, within {args.fresh_window} steps (windows) | blocks met (of) |\n"
              "|---|---:|---:|---:|---:|---:|---:|")
        for sp in splits:
            print(f"| {sp['run']} | {sp['fresh_steps']} | {sp['fresh_loss']:.3f} | {sp['seen_steps']} | "
                  f"{sp['seen_loss']:.3f} | {sp['difference']:+.3f} ({sp['windows']}) | {sp['blocks_met']} "
                  f"({sp['blocks']}) |")
        result = {"runs": rows, "fresh_and_seen": splits} if isinstance(result, list) else {**result,
                                                                                             "fresh_and_seen": splits}
    if args.fit_until is not None:
        fits = [power_fit(row, args.fit_until, args.fit_from, tuple(args.targets)) for row in rows]
        for fit in fits:
            reach = ", ".join(f"{g}× at {'never' if t is None else f'{t / 1e6:.1f} M'}"
                              for g, t in fit["tokens_to"].items())
            print(f"\n{fit['run']}: ratio − 1 = {fit['a']:.3g} · tokens^{fit['exponent']:.3f}, fitted to "
                  f"{fit['points']} points ({fit['from']}–{fit['until']} tokens); the law puts {reach}")
            if fit["later"]:
                print("| tokens | " + " | ".join(str(p["tokens"]) for p in fit["later"]) + " |\n|---|"
                      + "---:|" * len(fit["later"]))
                print("| measured | " + " | ".join(f"{p['ratio']:.3f}" for p in fit["later"]) + " |")
                print("| the law | " + " | ".join(f"{p['law']:.3f}" for p in fit["later"]) + " |")
        result = {"runs": rows, "fits": fits} if isinstance(result, list) else {**result, "fits": fits}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.curves:
        plot_curves(rows, args.curves)
        print(f"wrote {args.curves}")


def plot_curves(rows: list[dict], path: str) -> None:
    """Validation perplexity / teacher's against end-to-end training tokens, one line per run (log-scale tokens);
    the point at 0 tokens is the student after layerwise training alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    highest = 1.0
    for r in rows:
        if not r["curve"]:
            continue
        points = [(c["tokens"], c["ppl"]) for c in r["curve"]]
        if r["layerwise_ppl"]:
            points.insert(0, (0, r["layerwise_ppl"]))
        tokens, ppl = zip(*points)
        ratios = [p / r["teacher_ppl"] for p in ppl]
        highest = max(highest, *ratios)
        ax.plot(tokens, ratios, marker="o", ms=3, label=r["run"])
    ax.axhline(1.0, color="black", lw=1, ls="--", label="teacher")
    ax.axhline(1.05, color="grey", lw=1, ls=":", label="1.05× (the window target)")
    if highest > 2:  # pure linear students next to window ones: a log scale shows both
        ax.axhline(1.5, color="grey", lw=1, ls="-.", label="1.5× (the pure-linear target)")
        ax.set_yscale("log")
    ax.set_xscale("symlog", linthresh=5000)
    ax.set_xlim(left=0)
    ax.set_xlabel("end-to-end training tokens")
    ax.set_ylabel("validation perplexity / teacher's")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
