"""The `dofattn` command line: help, a full `dof` run on a tiny model, and one-line errors for bad input."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dofattn.cli import main
from dofattn.commands import VERBS, module
from dofattn.spec import Attention


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def help_text(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return "".join(capsys.readouterr().out.split())        # argparse wraps lines, at hyphens too: compare without spaces


@pytest.mark.parametrize("verb", VERBS)
def test_help_lists_every_option_with_its_meaning(capsys, verb):
    """Every field with help of the verb's option dataclasses (the library's config where there is one) is a flag
    (or the positional) in its --help, with its help; the verb's module docstring is the description."""
    command = module(verb)
    text = help_text(capsys, verb)
    options = [f for cls in command.options() for f in dataclasses.fields(cls) if "help" in f.metadata]
    assert options
    for f in options:
        flag = f.name if f.metadata.get("positional") else "--" + f.name.replace("_", "-")
        assert flag in text, (verb, flag)
        meaning = "".join(f.metadata["help"].split())
        assert meaning in text, (verb, flag, meaning)
    assert "".join(command.__doc__.split()) in text


def test_options_come_from_the_library_configs(capsys):
    """bench's options are `bench.BenchConfig`'s fields, eval's `eval_job.EvalConfig`'s, sample's include
    `sample.SampleSpec`'s; dof's sample defaults are a distillation run's (`choose.DOF_*`)."""
    from dofattn.jobs.bench import BenchConfig
    from dofattn.recipe import DOF_BLOCKS, DOF_POINTS, DOF_SEQ_LEN
    from dofattn.jobs.eval import EvalConfig
    from dofattn.jobs.sample import SampleSpec

    assert module("bench").options()[0] is BenchConfig and module("eval").options() == [EvalConfig]
    assert SampleSpec in module("sample").options()
    text = help_text(capsys, "dof")
    for name, value in (("--points", DOF_POINTS), ("--num-blocks", DOF_BLOCKS), ("--seq-len", DOF_SEQ_LEN)):
        assert f"{name}{name[2:].upper().replace('-', '_')}" in text and f"(default:{value})" in text


def test_top_level_help_lists_the_verbs_without_loading_them():
    """`dofattn --help` reads the command modules' docstrings alone: no library module (nor torch) is imported."""
    code = ("import sys; from dofattn.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('LOADED', [m for m in ('torch', 'dofattn.evaluate', 'dofattn.jobs.bench') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout
    for verb in VERBS:
        assert module(verb).__doc__.strip().splitlines()[0][:40] in " ".join(proc.stdout.split())


def test_distill_help_fits_one_screen_and_lists_the_recipes(capsys):
    from dofattn import recipe as recipes

    with pytest.raises(SystemExit):
        main(["distill", "--help"])
    out = capsys.readouterr().out
    options = [line for line in out.splitlines() if line.lstrip().startswith("--") or line.startswith("  -h")]
    assert len(options) <= 20 and len(out.splitlines()) <= 60, out
    names = recipes.packaged()
    assert {"window", "window-lora", "paper", "paper-fix", "pure-linear", "keep-softmax", "recall",
            "long-context"} <= set(names)
    for name, line in names.items():          # one line each, with what it is; the default says so
        label = [name, "(default)"] if name == recipes.DEFAULT else [name]
        assert any(row.split() == [*label, *line.split()] for row in out.splitlines()), name


def test_recipes_verb_lists_prints_and_explains(capsys, tmp_path):
    """`dofattn recipes` lists the recipes; `dofattn recipes NAME` prints one resolved, a file that loads back to the
    same recipe; `--keys` explains every key with its type and default."""
    from dofattn import recipe as recipes

    code, out, _ = run(capsys, "recipes")
    assert code == 0 and all(name in out for name in recipes.packaged())
    for name in recipes.packaged():
        code, out, _ = run(capsys, "recipes", name)
        assert code == 0
        path = tmp_path / f"{name}.toml"
        path.write_text(out)
        assert recipes.load(str(path)) == recipes.load(name)
    code, out, _ = run(capsys, "recipes", "--keys")
    lines = out.splitlines()
    for key, (kind, default, meaning, _) in recipes.key_fields().items():
        table, name = key.split(".")
        row = next(line for line in lines[lines.index(f"[{table}]"):] if line.split()[:1] == [name])
        shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else None
        assert recipes.type_name(kind) in row.split() and meaning in row, (key, row)
        if shown:
            assert shown in row.split(), (key, row)
    code, _, err = run(capsys, "recipes", "nonesuch")
    assert code == 2 and err.startswith("dofattn: error: unknown recipe 'nonesuch'")


def test_dof_on_tiny_model(capsys, model_dirs, text_file, tmp_path):
    out_json, out_png = tmp_path / "dof.json", tmp_path / "dof.png"
    code, out, err = run(capsys, "dof", "--model", str(model_dirs["llama"]), "--data", str(text_file),
                         "--split", "all", "--points", "64", "--num-blocks", "4", "--seq-len", "32",
                         "--out", str(out_json), "--plot", str(out_png))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    assert result["samples"] == 64 and result["budget"] == 16  # default budget: the head size
    assert [layer["layer"] for layer in result["layers"]] == [0, 1, 2]
    assert sum(layer["dim"] for layer in result["layers"]) == 3 * 16
    assert all(len(layer["head_dof"]) == 4 for layer in result["layers"])
    assert out_png.stat().st_size > 1000
    assert "layer" in out and "DoF max" in out


def test_dof_with_the_attention_dof(capsys, model_dirs, text_file, tmp_path):
    """--attention: each layer's mean attention DoF over its heads and the same blocks, in the JSON and the table."""
    from dofattn.data import token_blocks
    from dofattn.dof import attention_dofs
    from dofattn.model.hf import load_model

    out_json = tmp_path / "dof.json"
    code, out, err = run(capsys, "dof", "--model", str(model_dirs["llama"]), "--data", str(text_file),
                         "--split", "all", "--points", "32", "--num-blocks", "3", "--seq-len", "24", "--attention",
                         "--out", str(out_json))
    assert code == 0, err
    model, tokenizer = load_model(str(model_dirs["llama"]))[:2]
    blocks = token_blocks(str(text_file), tokenizer, 24, 3, split="all", seed=0)
    expected = [sum(h) / len(h) for h in attention_dofs(model, blocks, progress=False)]
    got = [layer["attention_dof"] for layer in json.loads(out_json.read_text())["layers"]]
    assert got == pytest.approx(expected, rel=1e-9)
    top = sorted(range(3), key=lambda i: (-got[i], i))
    assert "attn DoF" in out
    assert f"largest attention DoF (what student.keep_softmax = K keeps): layers {', '.join(map(str, top))}" in out


def test_clip_and_budget(capsys, model_dirs, text_file, tmp_path):
    out_json = tmp_path / "dof.json"
    code, _, err = run(capsys, "dof", "--model", str(model_dirs["gpt_neox"]), "--data", str(text_file),
                       "--split", "all", "--points", "32", "--num-blocks", "2", "--seq-len", "32",
                       "--budget", "40", "--clip", "--out", str(out_json))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    assert result["clip"] and all(layer["dim"] <= 16 for layer in result["layers"])


def test_repeats_pool_and_show_the_spread(capsys, model_dirs, text_file, tmp_path):
    out_json = tmp_path / "dof.json"
    code, out, err = run(capsys, "dof", "--model", str(model_dirs["llama"]), "--data", str(text_file),
                         "--split", "all", "--points", "32", "--repeats", "3", "--num-blocks", "4", "--seq-len", "32",
                         "--out", str(out_json))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    assert result["samples"] == 32 and result["repeats"] == 3
    assert all(layer["dof_std"] > 0 for layer in result["layers"]) and "± std" in out


def test_lam_auto(capsys, model_dirs, text_file, tmp_path):
    out_json = tmp_path / "dof.json"
    code, out, err = run(capsys, "dof", "--model", str(model_dirs["gpt2"]), "--data", str(text_file),
                         "--split", "all", "--points", "32", "--lam-auto", "--num-blocks", "4", "--seq-len", "128",
                         "--out", str(out_json))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    assert len(result["lam_search"]) == 8 and result["lam"] in [row["lam"] for row in result["lam_search"]]
    assert "<- chosen" in out and "uniform" in out


def test_dof_makes_the_folders_of_its_out_and_plot(capsys, tmp_path, model_dirs, text_file):
    """As export makes its --out, dof, eval and bench make a missing folder for their files (only a file in the way,
    or a folder that cannot be written, is refused)."""
    out, plot = tmp_path / "new" / "deep" / "dof.json", tmp_path / "figures" / "dof.png"
    code, _, err = run(capsys, "dof", "--model", str(model_dirs["llama"]), "--data", str(text_file), "--split", "all",
                       "--points", "32", "--num-blocks", "2", "--seq-len", "32", "--out", str(out), "--plot", str(plot))
    assert code == 0, err
    assert out.is_file() and plot.is_file() and plot.read_bytes()[:4] == b"\x89PNG"
    assert not list(out.parent.glob("*.partial")) and not list(plot.parent.glob("*.partial"))


@pytest.mark.parametrize("args,message", [
    (["--model", "{tmp}/no-such-model"], "does not exist"),
    (["--lam-auto", "--lam-scale", "raw"], "--lam-auto searches trace-relative"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--repeats", "1000"], "more than the"),
    (["--model", "{bert}"], "does not support"),
    (["--data", "{tmp}/missing.txt"], "neither 'wiki-sample'"),
    (["--points", "100000"], "more than the"),
    (["--samples", "64"], "dof --samples is now --points"),
    (["--budget", "0"], "--budget"),
    (["--lam", "-1"], "--lam must be positive"),
    (["--out", "{tmp}/afile/dof.json"], "afile is a file, not a folder"),
    (["--out", "/proc/dof.json"], "--out: cannot write in /proc"),
    (["--plot", "{tmp}/dof.jpg"], "--plot"),
    (["--device", "tpu"], "unknown device"),
    (["--seq-len", "0"], "give at least 1 block of at least 2 tokens"),
])
def test_bad_input_is_one_line_error(capsys, tmp_path, model_dirs, text_file, args, message):
    from transformers import BertConfig

    bert = tmp_path / "bert"
    (tmp_path / "afile").write_text("x")
    BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(bert)
    base = ["dof", "--model", str(model_dirs["llama"]), "--data", str(text_file), "--split", "all",
            "--points", "32", "--num-blocks", "2", "--seq-len", "32", "--out", str(tmp_path / "dof.json")]
    argv = base + [a.format(tmp=tmp_path, bert=bert) for a in args]
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
    assert len(lines) == 1 and message in lines[0]
    assert not (tmp_path / "dof.json").exists()


def test_console_script_exit_code(tmp_path, model_dirs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "dofattn", "dof", "--model", "no-such-org/no-such-model",
                           "--out", str(tmp_path / "x.json")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("dofattn: error: cannot load model")


def test_generate_help(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for option in ("--model", "--prompt", "--max-new-tokens", "--dims", "--student"):
        assert option in out


def greedy(model, ids, steps: int) -> list[int]:
    """`steps` greedy tokens after `ids` [1, T], each from a full forward pass (no cache)."""
    import torch

    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    return ids[0, -steps:].tolist()


def test_generate_linearized_tiny_model(capsys, tmp_path, tokenizer):
    """--dims linearizes the model (pure linear attention, untrained PRF features of --seed): the text is the
    linearized model's greedy continuation, computed here by full forward passes, not the softmax model's. (The
    tiny model's attention weights are scaled up, so that its attention, and so linearizing it, moves its
    predictions: at their initial size the residual stream alone decides them.)"""
    import torch

    from dofattn.model.hf import load_model
    from dofattn.model.student import linearize
    from tests.conftest import tiny_model

    folder = tmp_path / "loud"
    model = tiny_model("gpt_neox")
    with torch.no_grad():
        for layer in model.gpt_neox.layers:
            layer.attention.query_key_value.weight.mul_(8)
            layer.attention.dense.weight.mul_(8)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompt, steps = "The quick brown", 6
    code, out, err = run(capsys, "generate", "--model", str(folder), "--student", "paper", "--dims", "fix:8",
                         "--prompt", prompt, "--max-new-tokens", str(steps))
    assert code == 0, err
    assert "recipe paper's student, untrained" in err and "`prf` features" in err
    model, tokenizer = load_model(str(folder))
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    teacher = greedy(model, ids, steps)
    linearize(model, [8, 8, 8], Attention(feature="prf", window=0, sink=0), seed=0)
    student = greedy(model, ids, steps)
    assert student != teacher                                # the check below can tell them apart
    assert out == prompt + tokenizer.decode(student, skip_special_tokens=True) + "\n"


def test_generate_static_matches_hf(capsys, model_dirs):
    args = ("generate", "--model", str(model_dirs["llama"]), "--student", "paper", "--dims", "fix:8", "--prompt",
            "The quick brown", "--max-new-tokens", "6")
    code, out, err = run(capsys, *args)
    assert code == 0, err
    code, static_out, err = run(capsys, *args, "--static")
    assert code == 0 and "static decoding" in err, err
    assert static_out == out
    code, wide, err = run(capsys, *args, "--extend-to", "1024")                # YaRN: both ways the same tokens
    assert code == 0 and "read to 1024 tokens (YaRN)" in err, err
    code, static_wide, err = run(capsys, *args, "--extend-to", "1024", "--static")
    assert code == 0 and static_wide == wide, err
    code, _, err = run(capsys, "generate", "--model", str(model_dirs["llama"]), "--static")
    assert code == 2 and "--static decodes a linearized student" in err       # before the model loads


def test_generate_from_student_folder(capsys, model_dirs, tmp_path):
    from dofattn.model.hf import load_model
    from dofattn.spec import StudentSpec
    from dofattn.model.student import fingerprint, linearize, save_student

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [4, 4, 4], Attention(feature="hedgehog", window=0, sink=0))
    spec = StudentSpec(base_model=str(model_dirs["llama"]), dims=[4, 4, 4], layers=[0, 1, 2], base=fingerprint(model),
                       attention=Attention(feature="hedgehog", window=0, sink=0))
    folder = save_student(model, tmp_path / "run", spec)
    code, out, err = run(capsys, "generate", "--model", str(folder), "--max-new-tokens", "3", "--prompt", "fox")
    assert code == 0, err
    assert "student of" in err and "hedgehog" in err
    code, _, err = run(capsys, "generate", "--model", str(folder), "--student", "paper")
    assert code == 2 and "already a student" in err
    weights = folder / "features.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])                  # a truncated copy
    code, _, err = run(capsys, "generate", "--model", str(folder), "--max-new-tokens", "3", "--prompt", "fox")
    assert code == 2 and f"{weights} is damaged" in err and "Traceback" not in err
    assert len(err.strip().splitlines()[-1]) < 300


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--static", "--temperature", "0.7"], "--static decodes greedily"),
    (["--compile"], "--compile compiles the static decoder's step; add --static"),
    (["--student", "paper", "--dims", "fix:0"], "bad --dims"),
    (["--dims", "fix:4"], "add --student RECIPE"),
    (["--student", "nothere"], "unknown recipe 'nothere'"),
    (["--student", "recall"], "distill it, then use the run folder"),
    (["--extend-to", "0"], "--extend-to 0"),
    (["--extend-to", "128"], "within the model's context of 256 tokens"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "the cat sat " * 100, "--max-new-tokens", "4"], "run past the model's context of 256 tokens"),
])
def test_generate_bad_input(capsys, model_dirs, args, message):
    code, _, err = run(capsys, "generate", "--model", str(model_dirs["llama"]), *args)
    assert code == 2 and message in err


def test_generate_dims_with_a_student_says_its_dims_are_its_own(capsys, tmp_path):
    """--dims sizes an untrained student; given a trained one it is refused as such (not "add --student", which
    would then say "already a student"), before anything loads."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "dofattn.json").write_text("{}")
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "s"), "--dims", "fix:32")
    assert code == 2 and "is a trained student whose feature dims are its own: drop --dims" in err


def test_commands_look_for_the_default_run_and_write_into_run_folders(capsys, tmp_path, monkeypatch, model_dirs):
    """Without --model, generate, eval and export look in runs/long-context and say what to do when it is not
    there; distill's default folder is runs/<recipe>; eval of a student run folder writes its eval.json there."""
    from dofattn.jobs.eval import EvalConfig, check

    monkeypatch.chdir(tmp_path)
    for argv in (["generate"], ["eval"], ["export", "--out", "x"]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "no student in runs/long-context yet: train it with `dofattn distill`" in err, err
        assert ("smollm2-135m" in err) is (argv[0] != "export"), err      # export takes no base model
    (tmp_path / "runs" / "w").mkdir(parents=True)
    (tmp_path / "runs" / "w" / "dofattn.json").write_text("{}")
    assert check(EvalConfig(model="runs/w"))["out"] == Path("runs/w/eval.json")
    assert check(EvalConfig(model=str(model_dirs["llama"])))["out"] == Path("eval.json")
    (tmp_path / "runs" / "w" / "eval.json").write_text("{}")           # an earlier result is never replaced unasked
    (tmp_path / "runs" / "w" / "eval-2.json").write_text("{}")
    assert check(EvalConfig(model="runs/w"))["out"] == Path("runs/w/eval-3.json")
    assert check(EvalConfig(model="runs/w", out="runs/w/eval.json"))["out"] == Path("runs/w/eval.json")


@pytest.mark.parametrize("argv,verb", [
    (["eval", "--model", "{cfg}", "--num-blocks", "1"], "eval"),
    (["generate", "--model", "{cfg}", "--prompt", "hi"], "generate"),
    (["dof", "--model", "{cfg}", "--out", "{tmp}/d.json"], "dof"),
    (["distill", "--model", "{cfg}", "--out", "{tmp}/run"], "distill"),
    (["sample", "--model", "{cfg}", "--out", "{tmp}/s.jsonl"], "sample"),
])
def test_a_config_alone_is_refused_where_weights_matter(capsys, model_dirs, tmp_path, argv, verb):
    """A folder holding only a config.json plans (`distill --dry-run`) and times (`bench`); every command that
    needs trained weights refuses it in one line, before anything loads, and writes nothing."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text((model_dirs["llama"] / "config.json").read_text())
    argv = [a.format(cfg=folder, tmp=tmp_path) for a in argv]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{folder} is a model's config without weights: {verb}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config-only"]


@pytest.mark.parametrize("verb", ["generate", "eval", "bench", "dof", "sample"])
def test_machine_options_are_refused_before_torch_loads_a_model(verb):
    """--threads 0 and an unknown --device are answered from the options alone: transformers is never imported."""
    import subprocess
    import sys

    script = ("import sys\nfrom dofattn.cli import main\n"
              f"assert main([{verb!r}, '--threads', '0']) == 2 and main([{verb!r}, '--device', 'gpu']) == 2\n"
              "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--threads must be at least 1, got 0" in done.stderr and "unknown device 'gpu'" in done.stderr


# A value the options alone rule out, one per command: (argv, the error's text). Refused in a fraction of a second,
# before torch or transformers is imported (issue 69: 2-10 s before, each importing both).
VALUE_ONLY = [
    (["dof", "--lam", "nan"], "--lam: 'nan' is not a finite number"),
    (["dof", "--points", "0"], "--points must be at least 2, got 0"),
    (["dof", "--out", "/proc/x.json"], "--out: cannot write in /proc"),
    (["distill", "--set", "dof.lam=inf"], "dof.lam = inf is not a finite number"),
    (["distill", "--set", "student.dims=bogus"], "student.dims = 'bogus'"),
    (["distill", "--dry-run", "--time-limit", "nan"], "--time-limit: 'nan' is not a finite number"),
    (["distill", "--recalibrate"], "--world-size, --json and --recalibrate go with --dry-run"),
    (["eval", "--model", "smollm2-135m", "--seq-len", "0"], "--seq-len must be at least 2, got 0"),
    (["eval", "--model", "smollm2-135m", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["eval", "--model", "smollm2-135m", "--split", "bogus"], "unknown --split 'bogus'; use one of train, validation, all"),
    (["eval", "--model", "smollm2-135m", "--out", "/proc/x.json"], "--out: cannot write in /proc"),
    (["generate", "--model", "smollm2-135m", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["generate", "--temperature", "nan"], "--temperature: 'nan' is not a finite number"),
    (["generate", "--model", "smollm2-135m", "--student", "paper", "--dims", "0"], "bad --dims '0'; use C or fix:C"),
    (["generate", "--model", "smollm2-135m", "--static"], "--static decodes a linearized student"),
    (["generate"], "no student in runs/long-context yet"),
    (["bench", "--model", "smollm2-135m", "--seq-lens", "0"], "--seq-lens (or auto) takes positive token counts"),
    (["bench", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["sample", "--temperature", "nan"], "--temperature: 'nan' is not a finite number"),
    (["export", "--model", "no-such-run", "--out", "x"], "--model no-such-run is not a folder"),
    (["export", "--out", "/proc/x"], "no student in runs/long-context yet"),
    (["sample", "--samples", "0", "--out", "s.jsonl"], "--samples, --prompt-tokens, --new-tokens and --batch-size"),
]


def test_value_only_refusals_import_neither_torch_nor_transformers(tmp_path):
    """Every case of VALUE_ONLY in one fresh interpreter: exit 2, its one line, nothing written, and neither torch
    nor transformers in sys.modules afterwards (the job modules import them inside their functions)."""
    script = ("import json, sys\nfrom dofattn.cli import main\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    print('@@', file=sys.stderr, flush=True)\n"
              "    try:\n        code = main(argv)\n    except SystemExit as stop:\n        code = stop.code\n"
              "    print('exit', code, file=sys.stderr, flush=True)\n"
              "print('LOADED', [m for m in ('torch', 'transformers') if m in sys.modules])\n")
    done = subprocess.run([sys.executable, "-c", script, json.dumps([argv for argv, _ in VALUE_ONLY])],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "LOADED []" in done.stdout, done.stdout + done.stderr[-2000:]
    answers = done.stderr.split("@@\n")[1:]
    assert len(answers) == len(VALUE_ONLY), done.stderr[-2000:]
    for (argv, message), answer in zip(VALUE_ONLY, answers):
        *said, code = answer.strip().splitlines()
        errors = [line for line in said if "error:" in line]      # argparse's own print their usage first
        assert code == "exit 2" and errors == said[-1:] and message in errors[0], (argv, answer)
    assert list(tmp_path.iterdir()) == []


def test_paths_that_cannot_be_what_they_name_are_refused(capsys, tmp_path, monkeypatch):
    """--out that is a file (distill, the dry run too); a model under runs/ that is not there is a missing folder,
    not a hub id to fetch (bench)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run(capsys, "distill", "--out", str(afile), "--dry-run")
    assert code == 2 and "is a file: give a folder for the run" in err and afile.read_text() == "x"
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "bench", "--model", "runs/long-context", "--parts", "generation")
    assert code == 2 and "model path runs/long-context does not exist" in err


def test_threads_wait_passively_when_other_work_uses_the_cpu():
    """`cli.wait_passively_when_busy`, in a fresh process (torch not loaded yet): with a load of 2 on the cores the
    OpenMP wait policy becomes passive, with a line that says why; idle, or with the policy already set, or once
    torch is loaded (too late: the library has read it), nothing changes."""
    import subprocess

    script = (
        "import json, sys\n"
        "from dofattn.cli import wait_passively_when_busy as passive\n"
        "out = {}\n"
        "busy = {}; out['busy'] = [passive(busy, 2.0), busy]\n"
        "idle = {}; out['idle'] = [passive(idle, 0.2), idle]\n"
        "chosen = {'OMP_WAIT_POLICY': 'ACTIVE'}; out['chosen'] = [passive(chosen, 2.0), chosen]\n"
        "import torch\n"
        "late = {}; out['late'] = [passive(late, 2.0), late]\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    line, env = out["busy"]
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and "other work is using the CPU (load 2.0)" in line
    assert out["idle"] == [None, {}] and out["late"] == [None, {}]
    assert out["chosen"] == [None, {"OMP_WAIT_POLICY": "ACTIVE"}]


@pytest.mark.parametrize("argv", [["recipes", "--keys"], ["recipes", "long-context"], ["--help"]])
def test_output_into_a_closed_pipe_is_no_traceback(argv):
    """`dofattn recipes --keys | head`: the reader has gone before dofattn writes; it stops without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "dofattn", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("argv", [["dof", "--lam", "nan"], ["dof", "--lam", "inf"], ["generate", "--temperature", "nan"],
                                  ["sample", "--temperature=-inf"], ["distill", "--dry-run", "--time-limit", "nan"],
                                  ["distill", "--dry-run", "--set", "dof.lam=inf"],
                                  ["distill", "--dry-run", "--set", "end_to_end.lr=nan"]])
def test_a_number_that_is_not_finite_is_refused_in_one_line(capsys, tmp_path, argv):
    """nan and infinity, as an option or a recipe key, are refused before anything runs, and nothing is written."""
    try:
        code = main([*argv, "--out", str(tmp_path / "out")])
    except SystemExit as exit:                       # argparse's own error: usage, then one line
        code = exit.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "is not a finite number" in err[-1], err
    assert not list(tmp_path.iterdir())


def test_eval_of_a_base_model_says_it_is_its_own_teacher(capsys, tmp_path, model_dirs, text_file):
    """A model that is not a student is scored once, not against itself a second time: ratio 1, KL exactly 0."""
    out = tmp_path / "eval.json"
    code, printed, err = run(capsys, "eval", "--model", str(model_dirs["llama"]), "--data", str(text_file),
                             "--num-blocks", "2", "--seq-len", "32", "--layer-blocks", "0", "--out", str(out))
    assert code == 0, err
    assert "is not a student: its teacher is itself" in printed + err
    result = json.loads(out.read_text())
    assert result["ppl"] == result["teacher_ppl"] and result["kl"] == 0 and result["top1_agreement"] == 1


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--seq-len", "1000"], "--seq-len 1000 is past the model's context of 256 tokens"),
    (["--out", "{tmp}/afile/eval.json"], "afile is a file, not a folder"),
    (["--out", "/proc/eval.json"], "--out: cannot write in /proc"),
])
def test_eval_bad_input_is_one_line_error(capsys, tmp_path, model_dirs, args, message):
    (tmp_path / "afile").write_text("x")
    code, _, err = run(capsys, "eval", "--model", str(model_dirs["llama"]), *[a.format(tmp=tmp_path) for a in args])
    lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
