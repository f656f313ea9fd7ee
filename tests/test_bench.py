"""`dofattn bench` at toy sizes: every measurement runs and is reported with its shapes; bad input is one line."""

import json
import sys

import pytest

from dofattn.cli import main


STEP_S, PREFILL_S = 0.02, 0.1      # what each student attention layer waits per call, and more in a prefill


def slow_students(monkeypatch):
    """Every attention layer of a model `linearize` made waits STEP_S per call, and PREFILL_S more per call on more
    than one token: a student's decode step then takes at least 3 STEP_S (3 layers), its prefill 3 (STEP_S +
    PREFILL_S), while the teacher runs at full speed."""
    import time

    from dofattn.model import student

    linearize = student.linearize

    def wait(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        time.sleep(STEP_S + (PREFILL_S if hidden.shape[1] > 1 else 0.0))

    def slow(model, *args, **kwargs):
        linearize(model, *args, **kwargs)
        for module in student.attention_modules(model):
            module.register_forward_pre_hook(wait, with_kwargs=True)
        return model

    monkeypatch.setattr(student, "linearize", slow)


def window_recipe(tmp_path) -> str:
    """A recipe file whose student has a window of 16 and the default sink of 4."""
    path = tmp_path / "w16.toml"
    path.write_text('name = "w16"\n[student]\nwindow = 16\n')
    return str(path)


def test_bench_writes_every_measurement(capsys, model_dirs, tmp_path, monkeypatch):
    """Every measurement, with its shapes; the generation rows' times are those of the steps they name: students
    made to wait a known time per layer call decode no faster, and prefill no sooner, than that allows, while the
    decode rate leaves the prefill out, and their rate against the teacher's is below 1."""
    slow_students(monkeypatch)
    out = tmp_path / "bench.json"
    code = main(["bench", "--device", "cpu", "--seq-lens", "33,70", "--heads", "2", "--head-dim", "8",
                 "--dims", "5", "--student", window_recipe(tmp_path), "--repeats", "1", "--model",
                 str(model_dirs["llama"]), "--gen-contexts", "12", "--new-tokens", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["T"] for r in result["prefill"]] == [33, 70] and [r["T"] for r in result["decode"]] == [33, 70]
    assert "recipe w16" in result["student"] and "student: recipe w16" in printed
    for row in result["prefill"]:
        assert min(row["sdpa_ms"], row["linear_op_ms"], row["linear_ms"], row["student_ms"]) > 0
        assert row["backend"] == "chunk" and row["student"] == "window=16, sink=4"
    state = 1 * 2 * 5 * 9 * 4                                   # [1, 2, 5, 8 + 1] float32
    assert all(r["state_bytes"] == state for r in result["decode"])
    # the student's step: its state, the window's 16 keys and values [1, 16, 2, 8] and flags, the sink's 4 and flags
    assert all(r["student_cache_bytes"] == state + 2 * 16 * 2 * 8 * 4 + 16 + 2 * 4 * 2 * 8 * 4 + 4
               for r in result["decode"])
    assert result["decode"][1]["kv_cache_bytes"] == 2 * 1 * 2 * 70 * 8 * 4
    for row in result["prefill"]:
        assert set(row["op_ms"]) == {"chunk"} and row["op_ms"]["chunk"] > 0
    assert all(r["op_ms"] > 0 and r["student_ms"] > 0 and r["linear_ms"] > 0 for r in result["decode"])
    gen = {(r["student"], r["engine"]): r for r in result["generation"]}
    assert set(gen) == {(False, "hf"), (True, "hf"), (True, "static")}
    assert all(r["decode_tokens_per_s"] > 0 for r in gen.values())
    teacher = gen[False, "hf"]["decode_tokens_per_s"]
    assert "vs_teacher" not in gen[False, "hf"] and teacher > 1 / (3 * STEP_S)
    for key, r in gen.items():
        if key[0]:
            assert r["prefill_ms"] >= 3 * (STEP_S + PREFILL_S) * 1e3, key       # the prefill's own time
            assert r["decode_tokens_per_s"] <= 1 / (3 * STEP_S), key            # the decode steps' own rate,
            assert 2 / r["decode_tokens_per_s"] < 3 * (STEP_S + PREFILL_S), key  # its 2 steps not the prefill's
            assert r["vs_teacher"] < 1 and r["vs_teacher"] == pytest.approx(r["decode_tokens_per_s"] / teacher)
    assert "x teacher" in printed
    # per layer a state [1, 4, 5, 16 + 1] float32, the 14 (< 16) window keys and values [1, 14, 2, 16] fed so far
    # (12 of the prompt, 2 generated) and their flags, and the sink's 4 keys and values [1, 4, 2, 16] and flags
    sink = 2 * 4 * 2 * 16 * 4 + 4
    assert gen[True, "hf"]["cache_bytes"] == 3 * (4 * 5 * 17 * 4 + 2 * 14 * 2 * 16 * 4 + 14 + sink)
    ring = 8              # a static slot's position [1] int64, per layer (the Triton ring step adds its count)
    assert gen[True, "static"]["cache_bytes"] == 3 * (4 * 5 * 17 * 4 + 2 * 16 * 2 * 16 * 4 + 16 + sink + ring)
    assert result["hardware"]["device"] == "cpu" and "prefill (one layer, ms)" in printed


def test_bench_runs_only_the_parts_asked_for(capsys, model_dirs, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--device", "cpu", "--seq-lens", "20", "--heads", "2", "--head-dim", "8", "--dims", "5",
                 "--repeats", "1", "--model", str(model_dirs["gpt2"]), "--gen-contexts", "9", "--new-tokens", "2",
                 "--parts", "decode,generation", "--out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0 and result["prefill"] == [] and "prefill (one layer" not in printed
    assert [r["T"] for r in result["decode"]] == [20] and len(result["generation"]) == 3


def test_bench_compile_adds_a_compiled_static_row(capsys, model_dirs, tmp_path, monkeypatch):
    """--compile: a static+compile row per student and prompt length; the decoder's first warm-up compiles, its
    first step reported apart (torch.compile stubbed out here: the engine's test compiles for real)."""
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    out = tmp_path / "bench.json"
    code = main(["bench", "--device", "cpu", "--dims", "5", "--student", window_recipe(tmp_path), "--model",
                 str(model_dirs["llama"]), "--gen-contexts", "12,20", "--new-tokens", "3", "--parts", "generation",
                 "--compile", "--out", str(out)])
    assert code == 0
    rows = [r for r in json.loads(out.read_text())["generation"] if r["engine"] == "static+compile"]
    assert [r["context"] for r in rows] == [12, 20]
    assert [r.get("compile_ms", 0) > 0 for r in rows] == [True, False]   # a decoder compiles once
    assert all(r["decode_tokens_per_s"] > 0 and r["vs_teacher"] > 0 for r in rows)
    assert "static+compile" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--parts", "prefill,train"], "--parts takes some of prefill,decode,generation,serve"),
    (["--parts", "prefill,serve"], "--parts serve times an export in vLLM beside its teacher"),   # before prefill
    (["--serve-batch", "0"], "--serve-batch takes positive"),
    (["--seq-lens", "0"], "positive token counts"),
    (["--seq-lens", "1k"], "comma-separated token counts"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--out", "bench.txt"], "--out"),
    (["--student", "nothere"], "unknown recipe 'nothere'"),
    (["--features", "8"], "bench --features is now --dims"),
])
def test_bench_bad_input(capsys, tmp_path, args, message):
    code = main(["bench", "--device", "cpu", "--model", "none", "--out", str(tmp_path / "b.json"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and not (tmp_path / "b.json").exists()


def test_bench_serve_names_the_missing_serving_python(capsys, model_dirs, tmp_path):
    """--parts serve on an export with a serving python that is not there: one line, before anything runs (the
    part itself runs in the serving environment's tests, tests/test_serve.py)."""
    from dofattn.jobs.export import export
    from dofattn.spec import StudentSpec
    from dofattn.model.student import build, fingerprint, save_student
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    spec = StudentSpec(base_model=str(model_dirs["llama"]), dims=(5, 5, 5), layers=(0, 2), base=fingerprint(model))
    save_student(build(model, spec), tmp_path / "run", spec)
    folder = export(tmp_path / "run", tmp_path / "export")
    code = main(["bench", "--device", "cpu", "--parts", "serve", "--student", str(folder), "--serve-python",
                 "/no/python", "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert code == 2 and "--serve-python /no/python does not exist" in err and not (tmp_path / "b.json").exists()


def test_bench_writes_the_result_after_each_row(tmp_path, monkeypatch):
    """A long run cut short keeps what it measured: the JSON is rewritten with the result so far after every row
    (and part)."""
    from dofattn import io
    from dofattn.jobs.bench import BenchConfig, run

    saved, write = [], io.write_atomic
    monkeypatch.setattr(io, "write_atomic", lambda path, text: saved.append(json.loads(text)) or write(path, text))
    cfg = BenchConfig(seq_lens=[16, 24], heads=1, head_dim=4, dims=3, student="paper", repeats=1, model=None,
                      out=str(tmp_path / "b.json"))
    result = run(cfg)
    counts = [(len(s["prefill"]), len(s["decode"])) for s in saved]
    assert sorted(set(counts)) == [(1, 0), (2, 0), (2, 1), (2, 2)] and counts == sorted(counts)
    assert saved[-1] == json.loads(json.dumps(result))


def test_generation_rates_come_from_the_decode_steps_own_clock(monkeypatch):
    """The token clock turns the times each token came out into the prefill's time and the steps' rate; a run that
    made other than the tokens asked for, or no measurable time, is refused rather than reported."""
    from dofattn.jobs import bench

    stamps = iter([9.0, 10.0, 10.5, 10.6, 10.8, 11.0])      # the clock made, the prompt in, then 4 new tokens out
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(stamps))
    clock = bench.TokenClock("cpu")
    for _ in range(5):
        clock.put(None)
    timings = clock.timings()
    assert timings["decode_steps"] == 3
    assert timings["prefill_s"] == pytest.approx(0.5) and timings["decode_s"] == pytest.approx(0.5)
    cfg = bench.BenchConfig(device="cpu", new_tokens=4)
    row = bench._generation_row(cfg, "m", True, 64, "hf", timings, cache=None)
    assert row["prefill_ms"] == pytest.approx(500) and row["decode_tokens_per_s"] == pytest.approx(6.0)
    with pytest.raises(RuntimeError, match="made 3 tokens, not the 4"):
        bench._generation_row(cfg, "m", True, 64, "hf", {**timings, "decode_steps": 2}, cache=None)
    with pytest.raises(RuntimeError, match="no rate to report"):
        bench._generation_row(cfg, "m", True, 64, "hf", {**timings, "decode_s": 0.0}, cache=None)


def test_bench_times_a_trained_student_against_its_base_model(capsys, model_dirs, tmp_path):
    """--student RUN: the ops take its spec's attention whole, generation its trained tensors against its base."""
    from dofattn.spec import Attention, Kept, StudentSpec
    from dofattn.model.student import build, fingerprint, save_student
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    spec = StudentSpec(base_model=str(model_dirs["llama"]), dims=(5, 5, 5), layers=(0, 2),
                       attention=Attention(window=4, sink=2, decay="head"), kept=Kept(select=3, select_observe=2),
                       base=fingerprint(model))
    save_student(build(model, spec), tmp_path / "run", spec)
    out = tmp_path / "run" / "bench.json"              # --out auto: beside the student it times, a figure with it
    code = main(["bench", "--device", "cpu", "--seq-lens", "20", "--heads", "2", "--head-dim", "8", "--dims", "3",
                 "--repeats", "1", "--model", str(tmp_path / "run"), "--gen-contexts", "16,40", "--new-tokens", "2"])
    assert code == 0, capsys.readouterr().err
    assert out.with_suffix(".png").stat().st_size > 0
    result = json.loads(out.read_text())
    from dofattn.jobs.bench import BenchConfig

    again = BenchConfig(model=str(tmp_path / "run")).resolved().out     # the next run's: beside, not over it
    assert again == str(tmp_path / "run" / "bench-2.json")
    peaks = [r["peak_above_model_bytes"] for r in result["generation"]]
    assert all(isinstance(p, int) for p in peaks) or sys.platform != "linux"
    assert "the 3 keys per kv head" in result["student"] and result["prefill"][0]["student"] == "window=4, sink=2, decay=head"
    gen = {(r["student"], r["engine"]): r for r in result["generation"]}
    assert gen[False, "hf"]["model"] == str(model_dirs["llama"]) and gen[True, "hf"]["model"] == str(tmp_path / "run")
    assert {"static"} == {engine for student, engine in gen if student and engine != "hf"}


@pytest.mark.parametrize("as_file", [False, True])
def test_bench_times_a_config_alone_with_random_weights_and_says_so(capsys, model_dirs, tmp_path, as_file):
    """A model given by its config.json alone (a folder holding only it, or the file) is built with random weights:
    every row and the student line name it so."""
    folder = tmp_path / "llama-config"
    folder.mkdir()
    (folder / "config.json").write_text((model_dirs["llama"] / "config.json").read_text())
    model = folder / "config.json" if as_file else folder
    out = tmp_path / "bench.json"
    code = main(["bench", "--device", "cpu", "--dims", "5", "--repeats", "1", "--model", str(model),
                 "--gen-contexts", "9", "--new-tokens", "2", "--parts", "generation", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    rows = json.loads(out.read_text())["generation"]
    assert len(rows) == 3 and all("(random weights)" in r["model"] for r in rows)
    assert all("random weights" in line for line in printed.splitlines() if line.startswith("  model="))


def test_bench_times_a_recipe_that_keeps_layers_with_its_last_ones_standing_in(capsys, model_dirs, tmp_path):
    """A recipe whose kept softmax layers a run chooses (long-context: 12, here all but one of 3 would be too many:
    a .toml keeping 1) is timed untrained with its last K layers kept, said in its student line."""
    recipe = tmp_path / "keep.toml"
    recipe.write_text('format = 1\nname = "keep"\n[student]\nkeep_softmax = 1\nkeep_softmax_by = "copy"\n')
    out = tmp_path / "bench.json"
    code = main(["bench", "--device", "cpu", "--dims", "5", "--repeats", "1", "--model", str(model_dirs["llama"]),
                 "--student", str(recipe), "--gen-contexts", "9", "--new-tokens", "2", "--parts", "generation",
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "its last layers kept (student.keep_softmax = 1), standing in for those a run chooses" in printed
    rows = json.loads(out.read_text())["generation"]
    assert {r["student"] for r in rows} == {False, True}
