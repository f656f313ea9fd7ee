"""benchmarks/runs_table.py on hand-written run folders (old ones with run.json, and recipe run folders), on kept logs
of the experiment record: what differs from a recipe, pooling over seeds, bad paths."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dofattn import recipe as recipes
from dofattn.distill.end_to_end import draw
from dofattn.distill.run_folder import RunFolder

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "runs_table.py"
spec = importlib.util.spec_from_file_location("runs_table", SCRIPT)
runs_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runs_table)

EVALUATION = {"teacher_ppl": 20.0, "layerwise_student_ppl": None, "kl": 0.5, "top1_agreement": 0.6}


def fake_run(folder: Path, ppl: float, curve: list[dict] | None = None, losses: list[float] | None = None,
             **options) -> Path:
    """A run folder as `dofattn distill` left it before recipes, as far as the table reads it: run.json (the
    flags, its recipe's values filled in) and log.json (the end-to-end phase under "direct")."""
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps(runs_table.old_arguments(**options)))
    log = {"dims": [32, 96], "softmax_layers": [], "seconds": {"direct": 10.0},
           "direct": {"curve": curve or [], "losses": losses or []},
           "evaluation": {**EVALUATION, "student_ppl": ppl, "layerwise_student_ppl": 2 * ppl}}
    (folder / "log.json").write_text(json.dumps(log))
    return folder


def fake_recipe_run(folder: Path, ppl: float, recipe: str = "window", sets: tuple[str, ...] = (),
                    losses: list[float] | None = None, name: str | None = None) -> Path:
    """A run folder as `dofattn distill` leaves it now, as far as the table reads it: recipe.toml and log.json."""
    r = recipes.load(recipe, sets=list(sets))
    text = r.to_toml() if name is None else r.to_toml().replace(f'name = "{r.name}"', f'name = "{name}"')
    folder.mkdir(parents=True)
    (folder / "recipe.toml").write_text(text)
    log = {"recipe": {"name": name or r.name, **r.keys()}, "dims": [32, 96], "softmax_layers": [],
           "layers": {}, "seconds": {"end_to_end": 10.0},
           "end_to_end": {"steps": len(losses or []), "curve": [], "losses": losses or []},
           "evaluation": {**EVALUATION, "student_ppl": ppl, "layerwise_student_ppl": 2 * ppl}}
    (folder / "log.json").write_text(json.dumps(log))
    return folder


def test_a_row_names_the_options_that_differ_from_its_recipe(tmp_path):
    row = runs_table.describe(fake_run(tmp_path / "a", 30.0, window=0, direct_lr=0.006, lora_rank=8))
    assert row["changed"] == {"window": 0, "lora_rank": 8, "direct_lr": 0.006}
    assert row["vs_teacher"] == pytest.approx(1.5)
    line = runs_table.markdown([row]).splitlines()[-1]
    assert "direct_lr=0.006" in line and "30.0 (1.50×)" in line


def test_the_model_dtype_is_a_difference(tmp_path):
    rows = [runs_table.describe(fake_run(tmp_path / f"s{seed}-{dtype}", 24.0, seed=seed, dtype=dtype))
            for dtype in ("float32", "bfloat16") for seed in (0, 1)]
    assert [r["changed"] for r in rows] == [{}, {}, {"dtype": "bfloat16"}, {"dtype": "bfloat16"}]
    assert [g["changed"] for g in runs_table.seed_summary(rows)] == [{}, {"dtype": "bfloat16"}]


def test_the_text_and_a_continued_run_are_differences(tmp_path):
    pooled = {"data": "wiki-sample+teacher.jsonl", "eval_data": "wiki-sample", "continue_from": "runs/a"}
    rows = [runs_table.describe(fake_run(tmp_path / "plain", 24.0)),
            runs_table.describe(fake_run(tmp_path / "pooled", 24.0, **pooled))]
    assert [r["changed"] for r in rows] == [{}, pooled]


def test_seeds_pool_to_mean_and_sample_sd(tmp_path):
    rows = [runs_table.describe(fake_run(tmp_path / f"s{seed}", ppl, seed=seed))
            for seed, ppl in ((0, 22.0), (1, 26.0), (2, 24.0))]
    [group] = runs_table.seed_summary(rows)
    assert group["seeds"] == [0, 1, 2]
    assert group["vs_teacher_mean"] == pytest.approx(1.2)
    assert group["vs_teacher_sd"] == pytest.approx(0.1)


def test_loss_windows_average_the_common_steps(tmp_path):
    """Windows of 2 steps from step 1, up to the last step both runs reached (the longer run's step 5 is left out);
    the command prints them with a weighted mean over all counted steps."""
    a = fake_run(tmp_path / "a", 22.0, losses=[9.0, 4.0, 2.0, 3.0, 1.0, 7.0])
    b = fake_run(tmp_path / "b", 24.0, losses=[9.0, 5.0, 5.0, 1.0, 1.0])
    rows = [runs_table.describe(f) for f in (a, b)]
    bounds, means = runs_table.loss_windows(rows, 2, start=1)
    assert bounds == [(1, 3), (3, 5)]
    assert means == [[3.0, 2.0], [5.0, 1.0]]
    with pytest.raises(SystemExit, match="--from-step 5: a run has only 5 end-to-end steps"):
        runs_table.loss_windows(rows, 2, start=5)
    out = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), "--loss-windows", "2", "--from-step", "1"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "| steps | 1–3 | 3–5 | all |" in out.stdout and "| a | 3.000 | 2.000 | 2.500 |" in out.stdout


def test_pooling_at_tokens_reads_the_curves(tmp_path):
    rows = [runs_table.describe(fake_run(tmp_path / f"s{seed}", 25.0, seed=seed,
                                         curve=[{"step": 10, "tokens": 5120, "ppl": ppl}]))
            for seed, ppl in ((0, 30.0), (1, 34.0))]
    [group] = runs_table.seed_summary(rows, tokens=5120)
    assert group["vs_teacher"] == pytest.approx([1.5, 1.7])
    with pytest.raises(SystemExit, match="no validation point at 999"):
        runs_table.seed_summary(rows, tokens=999)


def test_a_power_law_is_recovered_and_held_against_the_later_points(tmp_path):
    """Points on ratio = 1 + 2 · (tokens / 1e5)^-0.4 exactly: the fit to the first three gives the law back, puts
    the later points where they are, and the tokens for a target solve the law; a point off the law shows."""
    law = lambda t: 1 + 2 * (t / 1e5) ** -0.4   # noqa: E731
    tokens = [51200, 102400, 204800, 409600, 819200]
    curve = [{"step": t // 1024, "tokens": t, "ppl": 20.0 * law(t)} for t in tokens]
    curve[-1]["ppl"] = 20.0 * 1.9                 # measured above the law's 1.86
    fit = runs_table.power_fit(runs_table.describe(fake_run(tmp_path / "a", 38.0, curve)), until=204800)
    assert fit["points"] == 3 and fit["exponent"] == pytest.approx(-0.4)
    assert fit["a"] == pytest.approx(2 * 1e5 ** 0.4)
    assert [p["tokens"] for p in fit["later"]] == tokens[3:]
    assert [p["law"] for p in fit["later"]] == pytest.approx([law(409600), law(819200)])
    assert [p["ratio"] for p in fit["later"]] == pytest.approx([law(409600), 1.9])
    assert law(fit["tokens_to"]["1.5"]) == pytest.approx(1.5) and fit["tokens_to"]["1.5"] > 819200
    assert law(fit["tokens_to"]["1.25"]) == pytest.approx(1.25)
    late = runs_table.power_fit(runs_table.describe(fake_run(tmp_path / "b", 38.0, curve)), until=10 ** 6,
                                start=100000)
    assert late["points"] == 4 and late["from"] == 102400 and late["later"] == []


def test_a_rising_curve_never_reaches_a_target_and_too_few_points_are_refused(tmp_path):
    rising = [{"step": 1, "tokens": 1000, "ppl": 40.0}, {"step": 2, "tokens": 2000, "ppl": 44.0}]
    fit = runs_table.power_fit(runs_table.describe(fake_run(tmp_path / "a", 44.0, rising)), until=2000)
    assert fit["exponent"] > 0 and fit["tokens_to"] == {"1.5": None, "1.25": None}
    with pytest.raises(SystemExit, match="at least 2 validation points above the teacher"):
        runs_table.power_fit(runs_table.describe(fake_run(tmp_path / "b", 44.0, rising)), until=1000)
    below = [{"step": 1, "tokens": 1000, "ppl": 30.0}, {"step": 2, "tokens": 2000, "ppl": 19.0}]
    with pytest.raises(SystemExit, match="above the teacher"):
        runs_table.power_fit(runs_table.describe(fake_run(tmp_path / "c", 19.0, below)), until=2000)


def test_fresh_and_seen_split_the_steps_by_the_blocks_distill_drew(tmp_path):
    """Each step's loss is its step number here; the split replays distill's own draws (`end_to_end.draw`) and keeps
    the steps whose blocks are all new and those whose blocks were all drawn before."""
    losses = [float(step) for step in range(40)]
    row = runs_table.describe(fake_run(tmp_path / "a", 30.0, losses=losses, seed=3, direct_blocks=12,
                                       direct_batch_size=2))
    seen, fresh, again = set(), [], []
    for step in range(40):
        drawn = set(draw(3, step, 12, 2).tolist())
        if step >= 2:
            (fresh if not drawn & seen else again if drawn <= seen else []).append(step)
        seen |= drawn
    assert fresh and again     # 12 blocks, 80 draws: both kinds occur after step 2
    split = runs_table.fresh_and_seen(row, 2, window=40)   # one window: the difference is that of the plain means
    assert (split["fresh_steps"], split["seen_steps"]) == (len(fresh), len(again))
    assert split["fresh_loss"] == pytest.approx(sum(fresh) / len(fresh))
    assert split["seen_loss"] == pytest.approx(sum(again) / len(again))
    assert split["windows"] == 1 and split["difference"] == pytest.approx(split["seen_loss"] - split["fresh_loss"])
    assert split["blocks_met"] == len(seen) <= 12 and split["blocks"] == 12
    # a loss that falls by 1 a step and is the same for both kinds at each step: the plain means differ (new blocks
    # come early), the windowed difference is as small as a window's spread of steps allows
    trend = runs_table.describe(fake_run(tmp_path / "b", 30.0, losses=[-float(step) for step in range(40)], seed=3,
                                         direct_blocks=12, direct_batch_size=2))
    plain = runs_table.fresh_and_seen(trend, 2, window=40)
    windowed = runs_table.fresh_and_seen(trend, 2, window=4)
    assert plain["seen_loss"] - plain["fresh_loss"] < -5
    assert abs(windowed["difference"]) <= 3 and windowed["windows"] >= 1
    with pytest.raises(SystemExit, match="no window of 50 steps"):
        runs_table.fresh_and_seen(row, 40)     # past the last step: neither kind


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env)


def test_keep_by_counts_only_beside_softmax_layers(tmp_path):
    """A run from before --keep-by's default changed (keep_by=dof recorded) differs in nothing without softmax
    layers; with them the choice is shown."""
    plain = runs_table.describe(fake_run(tmp_path / "a", 30.0, keep_by="dof"))
    kept = runs_table.describe(fake_run(tmp_path / "b", 30.0, keep_softmax=3, keep_by="dof"))
    assert "keep_by" not in plain["changed"] and kept["changed"]["keep_by"] == "dof"


def test_a_kept_log_file_stands_for_its_run(tmp_path):
    """docs/results/distill-*.json (a run's log.json, which carries its arguments) gives the folder's row."""
    run = fake_run(tmp_path / "w64-lora", 30.0, [{"step": 10, "tokens": 5120, "ppl": 31.0}], lora_rank=8)
    kept = tmp_path / "distill-w64-lora.json"
    log = json.loads((run / "log.json").read_text())
    kept.write_text(json.dumps({**log, "args": {**json.loads((run / "run.json").read_text()), "out": "runs/w64-lora"}}))
    row, folder_row = runs_table.describe(kept), runs_table.describe(run)
    assert row == folder_row and row["run"] == "w64-lora" and row["changed"] == {"lora_rank": 8}
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit, match="is not a `dofattn distill` log.json"):
        runs_table.describe(tmp_path / "other.json")


def test_bad_paths_are_refused_before_anything_is_written(tmp_path):
    run = fake_run(tmp_path / "a", 30.0)
    other = fake_run(tmp_path / "b", 31.0)
    for args, message in (((str(run), "--curves", str(other)), "is a folder"),
                          ((str(run), "--curves", str(tmp_path / "c.txt")), "give an image file name"),
                          ((str(run), "--out", str(other)), "is a folder"),
                          ((str(tmp_path),), "has no recipe.toml (or run.json) and log.json"),
                          ((str(run), "--fit-until", "100", "--fit-from", "100"), "must be above --fit-from"),
                          ((str(run), "--fit-until", "100", "--targets", "0.9"), "above 1"),
                          ((str(run), "--fit-until", "100", "--out", str(tmp_path / "fit.json")), "at least 2")):
        proc = run_script(*args)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr)
    assert sorted(p.name for p in other.iterdir()) == ["log.json", "run.json"]
    assert not (tmp_path / "b.png").exists() and not (tmp_path / "fit.json").exists()


# --- the experiment record: kept logs of runs made before recipes ---------------------------------------------------

RESULTS = ROOT / "docs" / "results"


@pytest.mark.skipif(not (RESULTS / "distill-keep3-bf16-teacher-text.json").is_file(), reason="no experiment record")
def test_a_kept_log_of_the_record_reads_as_it_always_did():
    """A kept log of a continued run on pooled text with many flags set: what differs from its recipe, and the split
    of its training loss by the blocks its steps drew, as the table gave them when dofattn still had those flags."""
    row = runs_table.describe(RESULTS / "distill-keep3-bf16-teacher-text.json")
    assert row["run"] == "keep3-teacher-text" and row["seed"] == 0
    assert row["changed"] == {
        "data": "wiki-sample+runs/teacher-text.jsonl", "eval_data": "wiki-sample",
        "continue_from": "runs/keep3-hh-decay-bf16", "dims": "fix", "feature": "hedgehog", "window": 0,
        "keep_softmax": 3, "keep_by": "attn-dof", "lora_rank": 8, "then_direct_steps": 4000,
        "direct_batch_size": 2, "direct_blocks": 2350, "decay": True, "dtype": "bfloat16"}
    assert list(row["changed"]) == ["data", "eval_data", "continue_from", "dims", "feature", "window",
                                    "keep_softmax", "keep_by", "lora_rank", "then_direct_steps",
                                    "direct_batch_size", "direct_blocks", "decay", "dtype"]
    split = runs_table.fresh_and_seen(row, 300)
    assert (split["fresh_steps"], split["seen_steps"], split["windows"], split["blocks_met"]) == (344, 1097, 40, 2086)
    assert split["difference"] == pytest.approx(-0.08537261696798557)


@pytest.mark.skipif(not (RESULTS / "distill-hh-gate-conv4-long.json").is_file(), reason="no experiment record")
def test_a_kept_log_of_the_paper_recipe_era_names_its_flags():
    row = runs_table.describe(RESULTS / "distill-hh-gate-conv4-long.json")
    assert row["changed"] == {
        "continue_from": "runs/hh-gate-conv4-lr1e-2-const", "feature": "hedgehog", "window": 0, "lora_rank": 8,
        "lora_targets": "all", "then_direct_steps": 1000, "direct_batch_size": 2, "direct_blocks": 1200,
        "gate": True, "conv": 4, "conv_lr": 0.01}


def test_old_recipes_fill_the_flags_left_unset():
    """The old --recipe presets: the dofattn recipe's sink only beside a window and without --decay; paper's
    end-to-end blocks are the layerwise ones."""
    assert runs_table.old_arguments()["sink"] == 4
    assert runs_table.old_arguments(decay=True)["sink"] == 0
    assert runs_table.old_arguments(window=0)["sink"] == 0
    long = runs_table.old_effective(runs_table.old_arguments(recipe="long"))
    assert (long["lora_rank"], long["then_direct_steps"], long["direct_blocks"], long["direct_seq_len"]) == \
        (8, 400, 1200, 512)
    paper = runs_table.old_effective(runs_table.old_arguments(recipe="paper"))
    assert (paper["window"], paper["direct_blocks"], paper["direct_seq_len"]) == (0, 64, 256)
    with pytest.raises(SystemExit, match="unknown old recipe 'fast'"):
        runs_table.old_arguments(recipe="fast")


# --- run folders of recipes -----------------------------------------------------------------------------------------

def test_a_recipe_run_names_the_keys_that_differ_from_its_recipe(tmp_path):
    """Against its own packaged recipe; the seed and keys that leave the student as it is are no difference; the
    setting (what seeds pool by) is against the window recipe."""
    sets = ("student.window=32", "end_to_end.lr=0.001", "end_to_end.eval_every=5", "run.seed=2")
    row = runs_table.describe(fake_recipe_run(tmp_path / "long-w32", 30.0, "window-lora", sets))
    assert row["run"] == "long-w32" and row["seed"] == 2
    assert row["changed"] == {"student.window": 32, "end_to_end.lr": 0.001}
    long, default = recipes.load("window-lora").keys(), recipes.load("window").keys()
    assert row["setting"] == {k: v for k, v in {**long, "student.window": 32, "end_to_end.lr": 0.001}.items()
                              if v != default[k] and k not in ("run.seed", "end_to_end.eval_every")}
    assert "end_to_end.steps" in row["setting"] and "student.lora_rank" in row["setting"]
    assert row["vs_teacher"] == pytest.approx(1.5)
    line = runs_table.markdown([row]).splitlines()[-1]
    assert "student.window=32, end_to_end.lr=0.001" in line and "30.0 (1.50×)" in line
    plain = runs_table.describe(fake_recipe_run(tmp_path / "paper", 40.0, "paper"))
    assert plain["changed"] == {} and "(its recipe's defaults)" in runs_table.markdown([plain])
    assert plain["setting"]["student.window"] == 0


def test_recipe_runs_pool_over_seeds_and_replay_their_draws(tmp_path):
    rows = [runs_table.describe(fake_recipe_run(tmp_path / f"s{seed}", ppl, sets=(f"run.seed={seed}",
                                                                                   "end_to_end.blocks=12",
                                                                                   "end_to_end.batch_size=2"),
                                                losses=[float(step) for step in range(40)]))
            for seed, ppl in ((0, 22.0), (1, 26.0))]
    [group] = runs_table.seed_summary(rows)
    assert group["seeds"] == [0, 1] and group["vs_teacher_mean"] == pytest.approx(1.2)
    assert group["changed"] == {"end_to_end.batch_size": 2, "end_to_end.blocks": 12}
    assert (rows[1]["direct_blocks"], rows[1]["direct_batch_size"]) == (12, 2)
    folder = RunFolder(tmp_path / "s1")
    seen = set()
    for step in range(40):
        seen |= set(folder.draws(step).tolist())
    assert runs_table.fresh_and_seen(rows[1], 0, window=40)["blocks_met"] == len(seen)


def test_a_recipe_of_another_name_is_told_against_the_default(tmp_path):
    row = runs_table.describe(fake_recipe_run(tmp_path / "mine", 30.0, sets=("student.sink=0",), name="mine"))
    assert row["changed"] == {"recipe": "mine", "student.sink": 0}


def test_an_unfinished_recipe_run_and_a_foreign_file_are_refused(tmp_path):
    run = fake_recipe_run(tmp_path / "a", 30.0)
    (run / "log.json").unlink()
    proc = run_script(str(run))
    assert proc.returncode != 0 and "has no finished log.json" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    (tmp_path / "binary.json").write_bytes(b"\xff\x00")
    with pytest.raises(SystemExit, match="is not a `dofattn distill` log.json"):
        runs_table.describe(tmp_path / "binary.json")
