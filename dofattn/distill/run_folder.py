"""The run folder (`--out`): what a run records, when the same command resumes it, and reading it back.

A run folder holds `recipe.toml` (the fully resolved recipe: passing it back as `--recipe` makes the same run),
`log.json` (written at the end), the student (`dofattn.json`, `features.safetensors`), the layerwise stage's layer
files and the end-to-end checkpoints; nothing of the teacher (the layerwise stage streams it). `RunFolder` reads
one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dofattn import recipe as recipes
from dofattn.errors import UserError
from dofattn.io import write_atomic, write_json
from dofattn.recipe import CONTINUE_MAY_CHANGE, Recipe
from dofattn.spec import CONFIG_FILE, WEIGHTS_FILE

RECIPE_FILE, LOG_FILE = "recipe.toml", "log.json"
# What --continue-from copies: what `dofattn distill` wrote.
RUN_FILES = (RECIPE_FILE, LOG_FILE, "dof.json", "attention_dof.json", CONFIG_FILE, WEIGHTS_FILE, "layers",
             "end_to_end")


@dataclass
class RunLog:
    """What `log.json` records."""

    recipe: dict = field(default_factory=dict)
    dims: list[int] = field(default_factory=list)
    softmax_layers: list[int] = field(default_factory=list)
    layers: dict = field(default_factory=dict)        # layer -> the layerwise stage's log
    end_to_end: dict = field(default_factory=dict)
    evaluation: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)       # stage -> wall time
    peak_rss: dict = field(default_factory=dict)      # stage -> peak resident memory, bytes (Linux)


class RunFolder:
    """A `dofattn distill` run folder: its recipe, its log, and the blocks each end-to-end step drew."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / RECIPE_FILE).is_file():
            old = " (a run of an older dofattn: run.json)" if (self.path / "run.json").is_file() else ""
            raise UserError(f"{self.path} is not a dofattn distill run folder{old}: it has no {RECIPE_FILE}")

    @property
    def recipe(self) -> Recipe:
        return recipes.load(str(self.path / RECIPE_FILE))

    @property
    def log(self) -> dict | None:
        """log.json, or None before the run first finished."""
        path = self.path / LOG_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def draws(self, step: int, processes: int = 1):
        """The end-to-end blocks (indices into the phase's blocks) step `step` trained on."""
        from dofattn.distill.end_to_end import draw

        r = self.recipe
        return draw(r.run.seed, step, r.end_to_end_blocks, r.end_to_end.batch_size * processes)


def _differ(before: Recipe, now: Recipe, ignore: tuple[str, ...] = ()) -> list[str]:
    a, b = before.keys(), now.keys()
    return sorted(k for k in a if k not in ignore and a[k] != b[k])


def refuse_foreign_folder(out: Path) -> None:
    if (out / "run.json").is_file():
        raise UserError(f"--out {out} holds a run of an older dofattn (run.json, no {RECIPE_FILE}); it cannot be "
                        f"resumed: give another --out")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not a dofattn run folder; give another --out")


def refuse(out: Path, recipe: Recipe) -> bool:
    """Refuse a run folder made with another recipe, or a folder that holds something else; only reads (the dry run
    and the run, before anything loads, ask it). -> whether `out` holds a run of this recipe whose end-to-end phase
    is to grow (more steps than its own: allowed, the run goes on to them; each step's blocks come from the seed and
    the step, so with as many processes as before and no cooldown begun, the result is the longer run's)."""
    path = out / RECIPE_FILE
    if not path.is_file():
        refuse_foreign_folder(out)
        return False
    before = recipes.load(str(path))
    changed = _differ(before, recipe)
    if changed == ["end_to_end.steps"] and recipe.end_to_end.steps > before.end_to_end.steps:
        return True
    if changed:
        more = (" (end_to_end.steps can only grow)" if "end_to_end.steps" in changed
                and recipe.end_to_end.steps < before.end_to_end.steps else "")
        raise UserError(f"run folder {out} holds a run with another recipe ({', '.join(changed)}){more}; give "
                        f"another --out, or delete the folder to start over")
    return False


def check(out: Path, recipe: Recipe) -> None:
    """`refuse`, then record the recipe: in a new folder, or one whose end-to-end phase grows."""
    grows = refuse(out, recipe)
    if grows or not (out / RECIPE_FILE).is_file():
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / RECIPE_FILE, recipe.to_toml())


def check_continue(source: Path, out: Path, recipe: Recipe) -> None:
    """--continue-from: refuse a `source` that is not a finished run folder, or whose recipe differs from this one
    outside CONTINUE_MAY_CHANGE (only reads; nothing is written). Nothing to check once `out` holds a run: a rerun of
    the same command resumes it."""
    if (out / RECIPE_FILE).is_file():
        return
    refuse_foreign_folder(out)
    if not (source / RECIPE_FILE).is_file() or not (source / LOG_FILE).is_file():
        raise UserError(f"--continue-from {source} is not a finished (or time-limited) dofattn distill run folder: "
                        f"it needs {RECIPE_FILE} and {LOG_FILE}")
    if source.resolve() == out.resolve():
        raise UserError("--continue-from and --out are the same folder; to go on in place, rerun the run's own "
                        "command with a larger end_to_end.steps")
    before = recipes.load(str(source / RECIPE_FILE))
    changed = _differ(before, recipe, ignore=CONTINUE_MAY_CHANGE)
    if changed:
        raise UserError(f"--continue-from {source} was run with other {', '.join(changed)}; keep them as its "
                        f"{RECIPE_FILE} has them (e.g. --recipe {source / RECIPE_FILE})")
    scored = before.run.eval_data or before.run.data, recipe.run.eval_data or recipe.run.data
    if scored[0] != scored[1]:
        raise UserError(f"--continue-from {source} was scored on {scored[0]!r}, this run on {scored[1]!r}: give "
                        f"--eval-data {scored[0]} so its perplexity curve goes on comparably")
    done = json.loads((source / LOG_FILE).read_text()).get("end_to_end", {}).get("steps", 0)
    if recipe.end_to_end.steps < done:
        raise UserError(f"end_to_end.steps = {recipe.end_to_end.steps} is fewer than the {done} end-to-end steps "
                        f"--continue-from {source} made; give at least {done}")


def copy_run(source: Path, out: Path, recipe: Recipe) -> bool:
    """--continue-from: copy `source`'s RUN_FILES to a new `out` whose recipe.toml is `recipe` (`check_continue`
    has accepted it). Returns whether it copied: not once `out` holds a run."""
    if (out / RECIPE_FILE).is_file():
        return False
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in RUN_FILES:
        if (source / name).is_dir():
            shutil.copytree(source / name, staging / name)
        elif (source / name).is_file():
            shutil.copy2(source / name, staging / name)
    (staging / RECIPE_FILE).write_text(recipe.to_toml())
    if out.exists():
        out.rmdir()
    staging.rename(out)
    return True


def write_log(out: Path, log: dict) -> None:
    write_json(out / LOG_FILE, log, indent=2)
