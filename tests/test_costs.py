"""What each stage of a run costs before it runs (`distill.costs`): the counts against real runs of the same
computations on small shapes, the stage table of `distill --dry-run`, and `distill` refusing a plan this machine
has no room for."""

import pytest
import torch

from dofattn import recipe as recipes
from dofattn.cli import main
from dofattn.distill import costs
from dofattn.distill.costs import forward_counts, layerwise_step_counts
from dofattn.distill.losses import LOSSES, sample_rows
from dofattn.distill.plan import make_plan
from dofattn.memory import LiveBytes
from dofattn.ops.softmax import expand_kv
from dofattn.model.student import attention_modules, linearize
from tests.conftest import tiny_model
from tests.test_distill import distill_argv


@pytest.mark.parametrize("name,sets", [("window", ["layerwise.seq_len=40", "layerwise.batch_size=3"]),
                                       ("long-context", ["layerwise.seq_len=300", "layerwise.rows=16"])])
def test_a_layerwise_step_holds_what_is_counted(name, sets):
    """The fake step's peak (no memory, no arithmetic) against the same step on real tensors, at the mean dim."""
    model = tiny_model("llama")
    recipe = recipes.load(name, sets + ["student.keep_softmax=0", "student.select=0"])
    plan = make_plan(recipe, 1, config=model.config)
    counted = layerwise_step_counts(recipe, plan)[0]

    L, lw = plan.layers, recipe.layerwise
    linearize(model, [round(L.mean_dim)] * L.count, recipe.student.attention, layers=[0])
    linear = attention_modules(model)[0].dofattn.train()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(lw.batch_size, lw.seq_len, L.heads, L.head_dim, generator=gen)
    k, v = (expand_kv(torch.randn(lw.batch_size, lw.seq_len, L.kv_heads, L.head_dim, generator=gen), L.heads)
            for _ in range(2))
    rows = {}
    if 0 < lw.rows < lw.seq_len:
        rows["at"] = sample_rows(lw.seq_len, lw.rows, torch.Generator().manual_seed(0),
                                 exact=recipe.student.attention.window)
    live = LiveBytes([*linear.parameters(), *linear.buffers(), q, k, v, *rows.values()])
    with live:
        LOSSES[lw.loss](linear, q, k, v, L.head_dim ** -0.5, **rows).backward()
    # the fake step counts q, k and v among its arrays; the real one was given them
    inputs = q.nbytes + k.nbytes + v.nbytes
    assert abs((counted - inputs) / live.peak - 1) < 0.05, (counted, inputs, live.peak)


def test_forward_counts_grow_with_the_tokens():
    """FLOPs of the body: linear in the batch, more than linear in the length (attention, the CPU's flash kernel
    counted); the LM head adds its matrix product, 2 x tokens x hidden x vocabulary."""
    config = tiny_model("llama").config
    live, flops = forward_counts(config, torch.float32, 2, 64)
    live_body, flops_body = forward_counts(config, torch.float32, 2, 64, logits=False)
    _, flops_twice = forward_counts(config, torch.float32, 4, 64)
    _, flops_long = forward_counts(config, torch.float32, 2, 128, logits=False)
    assert flops_twice == 2 * flops
    assert flops_long > 2 * flops_body
    assert flops - flops_body == 2 * (2 * 64) * config.hidden_size * config.vocab_size and live >= live_body


def test_dry_run_prints_each_stage_with_its_memory_disk_and_time(capsys, model_dirs, corpus, monkeypatch):
    monkeypatch.setenv("DOFATTN_PLAN_CACHE", "off")          # timed now, whatever a subprocess's plan kept
    code = main(["distill", "--dry-run", "--recipe", "window", "--model", str(model_dirs["llama"]),
                 "--device", "cpu", "--set", "layerwise.seq_len=32", "--set", "layerwise.blocks=4"])
    out = capsys.readouterr().out
    assert code == 0
    stages = [line.split()[0] for line in out[out.index("stages on cpu"):].splitlines()[2:]]
    assert stages == ["setup", "dof", "layerwise", "layerwise_eval", "end_to_end", "evaluate", "whole"]
    assert "measured now on cpu" in out


def test_dry_run_json_carries_the_stages(capsys, model_dirs):
    import json

    code = main(["distill", "--dry-run", "--json", "--recipe", "window", "--model", str(model_dirs["llama"]),
                 "--device", "cpu", "--set", "layerwise.seq_len=32"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    peaks = [s["peak"] for s in plan["stages"]]
    assert peaks == sorted(peaks) and plan["peak"] == peaks[-1]          # freed heap memory stays: never lower
    assert plan["disk"] == sum(s["disk"] for s in plan["stages"]) > 0
    assert plan["seconds"] == pytest.approx(sum(s["seconds"] for s in plan["stages"]))
    rates = plan["calibration"]["rates"]      # FLOP/s of one layer at each stage's length
    assert sorted(map(int, rates)) == sorted(set(costs.stage_lengths(recipes.load("window", ["layerwise.seq_len=32"]),
                                                                     tiny_model("llama").config).values()))
    assert all(rate > 0 for rate in rates.values()) and plan["calibration"]["layerwise_step"] > 0


def test_the_evaluations_score_each_position_at_the_heads_own_cost():
    """The evaluation's time is its bodies at the layer's rate plus each scored position's LM head (three: teacher,
    student, Performer) and tally at what `scoring_seconds` measured: a vocabulary 100x larger costs its head, not
    a decoder layer's rate. Counted on a fixed calibration (nothing timed)."""
    from dataclasses import replace

    model = tiny_model("llama")
    recipe = recipes.load("window", ["layerwise.seq_len=32"])
    plan = make_plan(recipe, 1, config=model.config, device="cpu", timed=False)
    lengths = costs.stage_lengths(recipe, model.config)
    calibration = replace(plan.calibration, rates={n: 1e9 for n in lengths.values()}, layerwise_step=0.01,
                          scoring={"head": 1e-3, "tally": 5e-4})
    stages = {s.name: s for s in costs.stage_costs(recipe, plan, model.config, calibration)}
    blocks, length = recipe.eval.blocks, recipe.eval.seq_len
    _, flops = costs.forward_counts(model.config, torch.float32, 4, length, logits=False)
    body = flops * blocks / 4 / (1e9 * costs.EFFICIENCY["evaluate"])
    assert stages["evaluate"].seconds == pytest.approx(3 * body + blocks * (length - 1) * (3e-3 + 5e-4))
    slower = replace(calibration, scoring={"head": 2e-3, "tally": 5e-4})
    again = {s.name: s for s in costs.stage_costs(recipe, plan, model.config, slower)}
    assert again["evaluate"].seconds - stages["evaluate"].seconds == pytest.approx(blocks * (length - 1) * 3e-3)
    assert again["dof"].seconds == stages["dof"].seconds          # a capture scores nothing


def test_scoring_is_timed_on_the_vocabulary_it_is_given():
    config = tiny_model("llama").config
    seconds = costs.scoring_seconds(config, torch.float32, "cpu", hidden=32, vocab=3000)
    assert set(seconds) == {"head", "tally"} and all(0 < s < 1 for s in seconds.values())


@pytest.mark.parametrize("short", ["memory", "disk"])
def test_distill_refuses_a_plan_with_no_room_unless_forced(capsys, model_dirs, corpus, tmp_path, monkeypatch, short):
    if short == "memory":
        from dofattn.distill import plan

        monkeypatch.setattr(plan, "available_memory", lambda: 1 << 20)
    else:
        import shutil
        from collections import namedtuple

        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 1024))
    out = tmp_path / "run"
    code = main(distill_argv(model_dirs["llama"], corpus, out, "layerwise.steps=2", "end_to_end.steps=0"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--force starts anyway" in err, err
    assert ("of memory at its peak" if short == "memory" else "free some disk") in err
    assert not out.exists()
    code = main(distill_argv(model_dirs["llama"], corpus, out, "layerwise.steps=2", "end_to_end.steps=0", "--force"))
    assert code == 0 and (out / "log.json").is_file()


def test_a_plan_of_features_with_nothing_to_learn():
    """A Performer student's layerwise stage only scores its loss: the plan counts the step without a backward
    (it raised: nothing required a gradient)."""
    model = tiny_model("llama")
    recipe = recipes.load("paper", ["student.feature=performer", "layerwise.seq_len=40"])
    plan = make_plan(recipe, 1, config=model.config, device="cpu", timed=False)
    assert [s.name for s in plan.stages][:2] == ["setup", "dof"] and plan.peak > 0
    assert all(s.seconds != s.seconds for s in plan.stages if s.name != "setup")   # not timed: NaN, never a guess


def test_weights_stored_in_another_dtype_pass_through_the_setup_stage():
    """Float32 weights loaded into bfloat16 are read whole and converted: the set-up stage holds the stored bytes
    beside the model (measured: 1.47 GiB for SmolLM2-135M, planned 1.45); the pages go back, later stages start
    lower, and the plan's peak is the largest stage's. Stored as run, nothing passes through."""
    model = tiny_model("llama")
    model.config.dtype = torch.float32                               # as a saved folder's config.json says
    plans = {dtype: make_plan(recipes.load("window", [f"run.dtype={dtype}", "layerwise.seq_len=32"]), 1,
                              config=model.config, device="cpu", timed=False) for dtype in ("float32", "bfloat16")}
    assert plans["float32"].stages[0].arrays == 0
    setup = plans["bfloat16"].stages[0]
    assert setup.arrays == plans["bfloat16"].parameters * 4 and "float32 weights converted to bfloat16" in setup.how
    assert plans["bfloat16"].peak == max(s.peak for s in plans["bfloat16"].stages) >= setup.peak
    assert model.config.dtype == torch.float32                       # the plan leaves the caller's config as it was


@pytest.fixture
def keeping(tmp_path, monkeypatch):
    """Plans keep what they measure, in a cache of this test's own; the cores taken as idle."""
    monkeypatch.setenv("DOFATTN_PLAN_CACHE", "on")
    monkeypatch.setenv("DOFATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(costs, "_idle", lambda device: True)
    return tmp_path / "cache" / "plans"


def dry_json(capsys, model_dirs, *extra):
    import json

    code = main(["distill", "--dry-run", "--json", "--recipe", "window", "--model", str(model_dirs["llama"]),
                 "--device", "cpu", "--set", "layerwise.seq_len=32", *extra])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_a_second_plan_reads_what_the_first_measured(capsys, model_dirs, keeping, monkeypatch):
    """The second dry run reads the steps, counts and timings the first kept: the same plan, nothing measured."""
    first = dry_json(capsys, model_dirs)
    kinds = sorted({p.name.split("-")[0] for p in keeping.iterdir()})
    assert kinds == ["forward", "layerwise_counts", "layerwise_step", "rates", "scoring", "step"]
    assert "measured now on cpu" in first["calibration"]["note"]
    from dofattn.distill import plan as plans

    def measured(*args, **kwargs):
        raise AssertionError("measured again")
    for module, name in [(plans, "measure_step"), (costs, "forward_rates"), (costs, "layerwise_step_seconds"),
                         (costs, "scoring_seconds"), (costs, "_forward_counts"), (costs, "_layerwise_step_counts")]:
        monkeypatch.setattr(module, name, measured)
    second = dry_json(capsys, model_dirs)
    assert "and kept (--recalibrate measures again)" in second["calibration"]["note"]
    for key in ("memory", "disk", "seconds", "end_to_end_flops"):
        assert second[key] == first[key], key
    same = ("name", "arrays", "disk", "seconds")          # a peak starts from this process's memory now
    assert [[s[k] for k in same] for s in second["stages"]] == [[s[k] for k in same] for s in first["stages"]]


def test_recalibrate_times_the_machine_again_and_other_shapes_are_measured(capsys, model_dirs, keeping,
                                                                           monkeypatch):
    dry_json(capsys, model_dirs)
    calls = []
    real = costs.forward_rates
    monkeypatch.setattr(costs, "forward_rates", lambda *a: calls.append(a) or real(*a))
    assert "measured now" in dry_json(capsys, model_dirs, "--recalibrate")["calibration"]["note"]
    assert len(calls) == 1
    dry_json(capsys, model_dirs, "--set", "layerwise.seq_len=48")            # another shape: a new key
    assert len(calls) == 2


def test_timings_made_beside_other_work_are_not_kept(capsys, model_dirs, keeping, monkeypatch):
    monkeypatch.setattr(costs, "_idle", lambda device: False)
    note = dry_json(capsys, model_dirs)["calibration"]["note"]
    assert "with other work on the cores (not kept)" in note
    kinds = {p.name.split("-")[0] for p in keeping.iterdir()}
    assert not kinds & {"rates", "scoring", "layerwise_step"} and "step" in kinds     # counts are kept


def test_a_damaged_kept_answer_is_measured_again(capsys, model_dirs, keeping):
    first = dry_json(capsys, model_dirs)
    for path in keeping.iterdir():
        path.write_text("{not json")
    second = dry_json(capsys, model_dirs)
    assert second["memory"] == first["memory"] and "measured now" in second["calibration"]["note"]


def test_a_change_of_code_is_a_new_key(monkeypatch, keeping):
    from dofattn import kept

    assert kept.kept("probe", {"a": 1}, lambda: 1) == 1
    assert kept.kept("probe", {"a": 1}, lambda: 2) == 1            # kept
    monkeypatch.setattr(kept, "_CODE", "another version")
    assert kept.kept("probe", {"a": 1}, lambda: 3) == 3            # new code: measured again
    monkeypatch.setenv("DOFATTN_PLAN_CACHE", "off")
    assert kept.kept("probe", {"a": 1}, lambda: 4) == 4


def test_a_plan_says_what_is_absurd_for_its_data_and_its_machine(capsys, model_dirs, monkeypatch):
    """--world-size 100000 reads the end-to-end data thousands of times over; a plan of months; a plan beyond the
    free memory: the dry run still prints the plan, with a warning line for each (the run refuses the last)."""
    from dofattn.distill import plan as plans

    code = main(["distill", "--dry-run", "--recipe", "window", "--model", str(model_dirs["llama"]), "--device", "cpu",
                 "--set", "layerwise.seq_len=32", "--world-size", "100000"])
    out = capsys.readouterr().out
    assert code == 0
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "times over (more than 20)" in warnings[0], out
    monkeypatch.setattr(plans, "MAX_DAYS", 0)
    monkeypatch.setattr(plans, "available_memory", lambda: 1 << 20)
    plan = dry_json(capsys, model_dirs)
    assert [w.split(" ")[:3] for w in plan["warnings"]] == [["the", "plan", "takes"], ["the", "plan", "needs"]]
    assert "of memory at its peak" in plan["warnings"][1] and "--force" not in plan["warnings"][1]


def test_an_ordinary_plan_warns_of_nothing(capsys, model_dirs):
    assert dry_json(capsys, model_dirs)["warnings"] == []


def test_a_folder_in_the_variable_keeps_the_answers_there(monkeypatch, tmp_path):
    """DOFATTN_PLAN_CACHE=FOLDER: kept in FOLDER/plans (the tests' session keeps so), not in the user's cache."""
    from dofattn import kept

    monkeypatch.setenv("DOFATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DOFATTN_PLAN_CACHE", str(tmp_path / "elsewhere"))
    assert kept.kept("probe", {"a": 1}, lambda: 1) == 1 and kept.kept("probe", {"a": 1}, lambda: 2) == 1
    assert [p.parent for p in (tmp_path / "elsewhere").rglob("probe-*.json")] == [tmp_path / "elsewhere" / "plans"]
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv("DOFATTN_PLAN_CACHE", "on")
    assert kept.folder() == tmp_path / "cache" / "plans" and kept.folder("lm-eval") == tmp_path / "cache" / "lm-eval"
