"""dofattn export: a student written as a Hugging Face model folder, loaded back by transformers in a fresh process
(the student's logits and greedy tokens, a linear state in the cache), and read by `dofattn eval` and `generate`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dofattn.cli import main
from dofattn.errors import UserError
from dofattn.model.exported import load_export
from dofattn.spec import is_export
from dofattn.jobs.export import export
from dofattn.model.hf import extend_context
from dofattn.spec import Attention, Kept, StudentSpec
from dofattn.model.student import build, fingerprint, load_student, save_student
from tests.conftest import tiny_model

IDS = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(0))      # longer than the windows
PROMPT = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
NEW_TOKENS = 8

# What the fresh process does with each export: only transformers' own API, as the model card says, in a process
# where dofattn cannot be imported (a finder refuses it, and the checkout is not on the path). The first export is
# also saved again, as transformers saves a remote-code model.
RELOAD = r"""
import json, sys


class NoDofattn:
    def find_spec(self, name, path=None, target=None):
        if name == "dofattn" or name.startswith("dofattn."):
            raise ImportError(f"{name}: dofattn is not installed here")


sys.meta_path.insert(0, NoDofattn())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

cases, out = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for name, folder in cases.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids, prompt = torch.load(folder + "/../" + name + ".inputs.pt").values()
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.float()
        gen = model.generate(prompt, max_new_tokens=%d, do_sample=False, return_dict_in_generate=True)
        chunked = model.generate(prompt, max_new_tokens=gen.sequences.shape[1] - prompt.shape[1], do_sample=False,
                                 prefill_chunk_size=5)                       # the prompt read in chunks of 5
    base = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models."))
    results[name] = {"logits": logits, "tokens": gen.sequences, "chunked": chunked,
                     "attn": model.config._attn_implementation,
                     "slots": [type(layer).__name__ for layer in gen.cache.layers],
                     "dtypes": {n: str(t.dtype) for n, t in model.state_dict().items()},
                     "classes": [(c.__module__, c.__name__) for c in (type(model), base)]}
    if len(results) == 1:
        model.save_pretrained(folder + "/../" + name + ".resaved")
        tokenizer.save_pretrained(folder + "/../" + name + ".resaved")
results["dofattn imported"] = sorted(m for m in sys.modules if m == "dofattn" or m.startswith("dofattn."))
torch.save(results, out)
""" % NEW_TOKENS


def reload_in_fresh_process(exports: dict[str, Path], tmp: Path) -> tuple[dict, str]:
    """({case: what `from_pretrained(trust_remote_code=True)` gives} for every export, in one new Python process;
    what that process wrote to stderr). transformers logs at its default level (warnings shown), without progress
    bars."""
    for name, folder in exports.items():
        torch.save({"ids": IDS, "prompt": PROMPT}, folder.parent / f"{name}.inputs.pt")
    out = tmp / "reloaded.pt"
    env = {key: value for key, value in os.environ.items() if key not in ("TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS")}
    env.pop("PYTHONPATH", None)
    env.update(HF_MODULES_CACHE=str(tmp / "hf-modules"), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    done = subprocess.run([sys.executable, "-c", RELOAD, json.dumps({k: str(v) for k, v in exports.items()}),
                           str(out)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out), done.stderr


def reference(model) -> dict:
    """The student's own logits on IDS and greedy tokens after PROMPT, in this process."""
    with torch.no_grad():
        return {"logits": model(IDS, use_cache=False).logits.float(),
                "tokens": model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)}


def make_student(family: str, folder: Path, base: Path, **arch):
    """A student of the tiny `family` model whose own tensors differ from a fresh build, saved in `folder`."""
    model = tiny_model(family)
    layers = arch.pop("layers", [0, 1, 2])
    kept = Kept(**arch.pop("kept", {}))
    exact = arch.pop("exact_heads", ())
    spec = StudentSpec(base_model=str(base), dims=[5, 12, 7], layers=layers, attention=Attention(**arch), kept=kept,
                       seed=4, base=fingerprint(model), exact_heads=exact)
    build(model, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".dofattn." in name or "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
        model(IDS[:1, :8], use_cache=False)                   # calibrates the key shifts
    save_student(model, folder, spec)
    return model


def distill(model_dir: Path, corpus: Path, out: Path) -> Path:
    """A tiny Llama distilled with a window and sink, LoRA rank 2, 3 end-to-end steps: a run folder with log.json."""
    sets = ("layerwise.seq_len=32", "layerwise.blocks=4", "layerwise.batch_size=2", "layerwise.steps=2",
            "end_to_end.batch_size=2", "end_to_end.seq_len=32", "end_to_end.steps=3", "end_to_end.lr=0.01",
            "eval.blocks=2", "eval.seq_len=32", "student.dims=fix:8", "student.window=8", "student.sink=2",
            "student.lora_rank=2")
    argv = ["distill", "--recipe", "window", "--model", str(model_dir), "--data", str(corpus), "--out", str(out),
            "--device", "cpu"]
    assert main(argv + [x for key in sets for x in ("--set", key)]) == 0
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, model_dirs, corpus):
    """{case: (export folder, the student's reference, the fresh process's result)}, the run folder, and what the
    fresh process wrote to stderr."""
    tmp = tmp_path_factory.mktemp("export")
    students, refs = {}, {}
    for name, family, arch in [("llama-linear", "llama", {"window": 0, "sink": 0}),
                               ("gpt2-window-sink", "gpt2", {"window": 8, "sink": 2}),
                               ("gpt_neox-window-sink-softmax", "gpt_neox", {"window": 8, "sink": 2,
                                                                             "layers": [0, 2]}),
                               ("llama-hedgehog-decay-conv", "llama", {"feature": "hedgehog", "decay": "head",
                                                                      "conv": 2, "window": 0, "sink": 0}),
                               ("llama-select", "llama", {"window": 4, "sink": 1, "layers": [0, 2], "kept": {
                                   "select": 2, "select_observe": 2, "select_pool": 1}}),
                               ("llama-exact-heads", "llama", {"window": 4, "sink": 1, "exact_heads": ((0,), (), (1,)),
                                                              "kept": {"select": 2, "select_observe": 2,
                                                                       "select_pool": 1}})]:
        students[name] = tmp / f"student-{name}"
        refs[name] = reference(make_student(family, students[name], model_dirs[family], **arch))
    wide = load_student(students["llama-select"])[0]                  # read to 1024 tokens (the base: 256)
    extend_context(wide, 1024)
    refs["llama-select-extended"] = reference(wide)
    run = distill(model_dirs["llama"], corpus, tmp / "run")
    refs["run-lora"] = refs["run-lora-merged"] = reference(load_student(run)[0])
    refs["run-lora-bfloat16"] = reference(load_student(run, dtype=torch.bfloat16)[0])
    exports = {name: tmp / "out" / name for name in refs}
    for name, folder in students.items():
        assert main(["export", "--model", str(folder), "--out", str(exports[name])]) == 0
    assert main(["export", "--model", str(students["llama-select"]), "--out", str(exports["llama-select-extended"]),
                 "--extend-to", "1024"]) == 0
    assert main(["export", "--model", str(run), "--out", str(exports["run-lora"])]) == 0
    assert main(["export", "--model", str(run), "--out", str(exports["run-lora-merged"]), "--merge-lora"]) == 0
    assert main(["export", "--model", str(run), "--out", str(exports["run-lora-bfloat16"]), "--dtype",
                 "bfloat16"]) == 0
    reloaded, stderr = reload_in_fresh_process(exports, tmp)
    assert reloaded["dofattn imported"] == []                   # the exports ran on their own copy of the code
    return {name: (exports[name], refs[name], reloaded[name]) for name in refs}, run, stderr


CASES = ["llama-linear", "gpt2-window-sink", "gpt_neox-window-sink-softmax", "llama-hedgehog-decay-conv", "llama-select",
         "llama-select-extended", "llama-exact-heads", "run-lora", "run-lora-merged", "run-lora-bfloat16"]


def test_an_extended_export_reads_with_yarn(exported, capsys, text_file, tmp_path):
    """--extend-to writes the scaled RoPE into config.json (the fresh process's logits above are the scaled
    student's), says so in the card, and `dofattn eval --extend-to` on it is refused: it is scaled already."""
    folder, ref, _ = exported[0]["llama-select-extended"]
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 1024
    assert not torch.allclose(ref["logits"], exported[0]["llama-select"][1]["logits"], atol=1e-4)
    assert "It reads to 1024 tokens" in (folder / "README.md").read_text()
    assert main(["eval", "--model", str(folder), "--data", str(text_file), "--extend-to", "2048", "--out",
                 str(tmp_path / "eval.json")]) == 2
    assert "already 'yarn'" in capsys.readouterr().err


@pytest.mark.parametrize("case", CASES)
def test_a_fresh_process_loads_the_student(exported, case):
    folder, ref, got = exported[0][case]
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-5, rtol=0)
    assert torch.equal(got["tokens"], ref["tokens"]) and torch.equal(got["chunked"], ref["tokens"])
    assert got["attn"] == "dofattn"
    # a kept softmax layer keeps its KV cache, or bounds it after the prompt to its selected keys
    kept = "BoundedKVLayer" if case.startswith("llama-select") else "DynamicLayer"
    softmax = [1] if "softmax" in case or kept != "DynamicLayer" else []
    assert got["slots"] == [kept if i in softmax else "LinearStateLayer" for i in range(3)]
    assert sorted(p.name for p in folder.parent.iterdir() if ".partial" in p.name or ".old" in p.name) == []


def test_lora_adapters_survive_or_are_merged(exported):
    cases = exported[0]
    kept, merged = cases["run-lora"][2]["dtypes"], cases["run-lora-merged"][2]["dtypes"]
    assert sum(".lora_B." in n for n in kept) == 3 * 4
    assert not any(".lora_" in n or ".base_layer." in n for n in merged)      # the base architecture's names again
    configs = {case: json.loads((cases[case][0] / "config.json").read_text())
               for case in ("run-lora", "run-lora-merged")}
    assert configs["run-lora"]["dofattn"]["lora_rank"] == 2 and configs["run-lora-merged"]["dofattn"]["lora_rank"] == 0
    assert [configs[c]["dofattn_export"]["lora"] for c in configs] == ["adapters", "merged"]


def test_16_bit_export_keeps_the_students_tensors_in_float32(exported):
    folder, _, got = exported[0]["run-lora-bfloat16"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    for dtypes in (stored, got["dtypes"]):
        student = {n: d for n, d in dtypes.items() if ".dofattn." in n or ".lora_" in n}
        base = {n: d for n, d in dtypes.items() if n not in student and "inv_freq" not in n}
        assert student and set(map(str, student.values())) <= {"F32", "torch.float32", "BOOL", "torch.bool"}
        assert set(map(str, base.values())) == ({"BF16"} if dtypes is stored else {"torch.bfloat16"})


def test_large_weights_are_written_in_shards(exported, tmp_path):
    folder, ref, _ = exported[0]["llama-linear"]
    out = export(folder.parent.parent / "student-llama-linear", tmp_path / "sharded", max_shard=100_000)
    files = sorted(p.name for p in out.iterdir() if p.name.startswith("model") and "safetensors" in p.name)
    assert len(files) > 3 and files[-1] == "model.safetensors.index.json" and "model.safetensors" not in files
    model, _, _ = load_export(out)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, use_cache=False).logits, ref["logits"], atol=1e-5, rtol=0)


def test_the_card_states_base_recipe_and_evaluation(exported):
    cases, run = exported[:2]
    folder = cases["run-lora"][0]
    card, log = (folder / "README.md").read_text(), json.loads((run / "log.json").read_text())
    ev = log["evaluation"]
    assert f"`{json.loads((folder / 'config.json').read_text())['dofattn']['base_model']}`" in card
    assert "Recipe `window`" in card and (folder / "recipe.toml").read_text() == (run / "recipe.toml").read_text()
    assert "`student.window = 8`" in card and "`end_to_end.steps = 3`" in card        # what the run changed
    assert f"**{ev['student_ppl']:.2f}** | **{ev['student_vs_teacher']:.3f}**" in card
    assert f"{ev['teacher_ppl']:.2f}" in card and "trust_remote_code=True" in card
    bare = (cases["llama-linear"][0] / "README.md").read_text()
    assert "No evaluation numbers" in bare and "Recipe `" not in bare
    for text, lora in ((card, True), (bare, False)):                  # what loading needs, and only that
        assert "Needs Python 3.11 or later, torch and transformers 5" in text and "; not dofattn" in text
        assert ("peft for the LoRA adapters" in text) is lora and "pip install dofattn" not in text


def test_without_trust_remote_code_transformers_refuses_it(exported):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(exported[0]["llama-linear"][0], trust_remote_code=False)



def test_the_modeling_file_only_binds_dofattns_classes(exported):
    """The classes are defined once, in dofattn (`student_classes`): the folder's file binds them for transformers
    from its copy of dofattn's code (`dofattn_code.py`, the package's modules as they are), which loads them under
    the file's module name (so that saving the model again copies both files), as subclasses of the base family's
    own class; `load_export` gets dofattn's own classes without either file."""
    from dofattn.model.bundle import bundle_text
    from dofattn.model.exported import student_classes
    cases = exported[0]
    for case, (folder, _, got) in cases.items():
        source = (folder / "modeling_dofattn.py").read_text()
        assert "class " not in source and "student_classes(" in source and "from .dofattn_code import" in source
        assert (folder / "dofattn_code.py").read_text() == bundle_text(), case      # the package's code, unchanged
        base = json.loads((folder / "config.json").read_text())["dofattn_export"]["base_architecture"]
        (module, name), (base_module, base_name) = got["classes"]
        assert name == "DofattnForCausalLM" and module.endswith(".modeling_dofattn"), case
        assert base_name == base and base_module.startswith("transformers.models."), case
    first, second = (load_export(cases[case][0])[0] for case in ("llama-linear", "llama-hedgehog-decay-conv"))
    assert type(first) is type(second) is student_classes("LlamaForCausalLM")[1]
    assert type(first.config) is student_classes("LlamaForCausalLM")[0]


def test_a_loaded_export_saves_again_as_an_export(exported):
    folder, ref, _ = exported[0]["llama-linear"]
    again = folder.parent / "llama-linear.resaved"
    for name in ("modeling_dofattn.py", "dofattn_code.py"):
        assert (again / name).read_text() == (folder / name).read_text()
    config, original = (json.loads((f / "config.json").read_text()) for f in (again, folder))
    assert config["model_type"] == "dofattn" and config["auto_map"] == original["auto_map"]
    assert config["dofattn"] == original["dofattn"]
    model, _, _ = load_export(again)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, use_cache=False).logits, ref["logits"], atol=1e-5, rtol=0)


def test_loading_an_export_prints_no_warning(exported):
    """The fresh process loads every export as the model card says (model and tokenizer with trust_remote_code),
    runs and generates from it at transformers' default log level: nothing on stderr, in particular not
    transformers' "You are using a model of type `dofattn` to instantiate a model of type ``"."""
    stderr = exported[2]
    assert "You are using a model of type" not in stderr
    assert stderr.strip() == "", stderr[-3000:]


def test_load_export_logs_no_warning(exported, capsys):
    """dofattn's own loader (`dofattn eval` / `generate` on an export): no transformers warning (its warn-once
    memory cleared first), no Python warning, nothing printed."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger, verbosity, bars = hf_logging.get_logger(), hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_warning()
    hf_logging.disable_progress_bar()
    hf_logging.warning_once.cache_clear()
    logger.addHandler(handler)
    capsys.readouterr()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for folder, _, _ in exported[0].values():
                load_export(folder)
    finally:
        logger.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    assert [record.getMessage() for record in records] == []
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in caught] == []
    assert capsys.readouterr() == ("", "")

# --- the command line ------------------------------------------------------------------------------------------

def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("dofattn: error: ") and "\n" not in err, err
    return err


def test_export_refuses_a_bad_model_in_one_line(tmp_path, capsys, exported):
    out = tmp_path / "out"
    assert main(["export", "--model", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "is not a folder" in one_line_error(capsys)
    assert main(["export", "--model", str(exported[0]["llama-linear"][0]), "--out", str(out)]) == 2
    assert "is a dofattn export already" in one_line_error(capsys)
    with pytest.raises(SystemExit) as exit:                          # argparse: --out is required
        main(["export", "--model", str(tmp_path)])
    assert exit.value.code == 2 and "the following arguments are required: --out" in capsys.readouterr().err
    student = exported[0]["llama-linear"][0].parent.parent / "student-llama-linear"
    assert main(["export", "--model", str(student), "--out", str(out), "--merge-lora"]) == 2
    assert "has no LoRA adapters to fold; drop --merge-lora" in one_line_error(capsys)
    assert not out.exists()


def test_export_refuses_a_run_that_is_going_on(tmp_path, capsys, exported):
    """A run asked for more end-to-end steps than its log has made (a --continue-from copy, say): its student and
    numbers are not its recipe's."""
    import dataclasses
    import shutil

    from dofattn import recipe as recipes

    run = tmp_path / "run"
    shutil.copytree(exported[1], run)
    recipe = recipes.load(str(run / "recipe.toml"))
    longer = dataclasses.replace(recipe, end_to_end=dataclasses.replace(recipe.end_to_end, steps=5))
    (run / "recipe.toml").write_text(longer.to_toml())
    assert main(["export", "--model", str(run), "--out", str(tmp_path / "out")]) == 2
    assert "going on (3 of 5 end-to-end steps)" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_folder_that_is_not_an_export(tmp_path, capsys, exported):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    student = exported[0]["llama-linear"][0].parent.parent / "student-llama-linear"
    assert main(["export", "--model", str(student), "--out", str(out)]) == 2
    assert "not empty and holds no dofattn export" in one_line_error(capsys)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]              # no staging left behind


def test_export_replaces_a_previous_export(tmp_path, exported):
    cases = exported[0]
    out = tmp_path / "again"
    student = cases["llama-linear"][0].parent.parent / "student-gpt2-window-sink"
    assert main(["export", "--model", str(cases["llama-linear"][0].parent.parent / "student-llama-linear"),
                 "--out", str(out)]) == 0
    assert main(["export", "--model", str(student), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["dofattn_export"]["base_model_type"] == "gpt2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_export_keeps_what_the_user_put_beside_an_earlier_export(tmp_path, capsys, exported):
    """An earlier export with the user's notes and evaluations beside it is refused, not replaced with them, by the
    files it recorded and, for an export made before they were recorded, by the names exports write; with them
    moved out it is replaced."""
    cases = exported[0]
    out = tmp_path / "again"
    student = cases["llama-linear"][0].parent.parent / "student-llama-linear"
    assert main(["export", "--model", str(student), "--out", str(out)]) == 0
    capsys.readouterr()
    config = json.loads((out / "config.json").read_text())
    assert {"config.json", "model.safetensors", "README.md"} <= set(config["dofattn_export"]["files"])
    (out / "notes.md").write_text("mine")
    (out / "evals").mkdir()
    (out / "evals" / "eval.json").write_text("{}")
    for recorded in (True, False):
        if not recorded:
            del config["dofattn_export"]["files"]
            (out / "config.json").write_text(json.dumps(config))
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert main(["export", "--model", str(student), "--out", str(out)]) == 2
        assert "holds evals/, notes.md beside an earlier export" in one_line_error(capsys), recorded
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]
    (out / "notes.md").unlink()
    shutil.rmtree(out / "evals")
    assert main(["export", "--model", str(student), "--out", str(out)]) == 0


def test_a_damaged_export_is_refused_in_one_line(tmp_path, capsys, exported):
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(exported[0]["llama-linear"][0], out)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(UserError, match="model.safetensors is damaged"):
        load_export(out)
    assert main(["generate", "--model", str(out), "--device", "cpu"]) == 2
    assert "model.safetensors is damaged" in one_line_error(capsys)
    shutil.copy2(exported[0]["llama-linear"][0] / "model.safetensors", weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
    assert main(["generate", "--model", str(out), "--device", "cpu"]) == 2
    assert "has no usable tokenizer" in one_line_error(capsys)


def test_an_export_without_its_weights_is_refused_by_every_command(tmp_path, capsys, exported, text_file):
    """Without model.safetensors an export's folder is not taken for a config alone (which asked transformers for the
    folder's custom code, and its prompt waited 15 s): eval, generate and bench name the missing file, bench before
    it times anything."""
    out = tmp_path / "no-weights"
    shutil.copytree(exported[0]["llama-linear"][0], out)
    (out / "model.safetensors").unlink()
    for argv in (["generate", "--model", str(out)],
                 ["eval", "--model", str(out), "--data", str(text_file), "--out", str(tmp_path / "e.json")],
                 ["bench", "--model", str(out), "--out", str(tmp_path / "b.json")]):
        assert main(argv + ["--device", "cpu"]) == 2, argv
        assert "model.safetensors is missing" in one_line_error(capsys), argv
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "b.json").exists()


def test_generate_takes_an_export(exported, capsys):
    cases, run = exported[:2]
    argv = ["generate", "--prompt", "The quick brown fox", "--max-new-tokens", "6", "--device", "cpu"]
    texts = []
    for model in (run, cases["run-lora"][0], cases["run-lora-merged"][0]):
        assert is_export(model) == (model != run)
        assert main(argv + ["--model", str(model)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2]


def test_eval_takes_an_export_and_finds_its_teacher(exported, text_file, tmp_path, capsys):
    cases, run = exported[:2]
    results = {}
    for name, model in (("run", run), ("kept", cases["run-lora"][0]), ("merged", cases["run-lora-merged"][0])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--model", str(model), "--data", str(text_file), "--num-blocks", "2", "--seq-len", "32",
                     "--layer-blocks", "0", "--device", "cpu", "--out", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    capsys.readouterr()
    for name in ("kept", "merged"):           # the merged export's teacher is its base model, loaded beside it
        assert results[name]["ppl"] == pytest.approx(results["run"]["ppl"], rel=1e-5)
        assert results[name]["teacher_ppl"] == pytest.approx(results["run"]["teacher_ppl"], rel=1e-5)
    assert results["merged"]["teacher"] != "base model"


# --- the built-in model ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_builtin_model_exports_and_reloads(tmp_path):
    from dofattn.model.hf import load_model
    from dofattn.distill.choose import resolve_dims

    model, tokenizer = load_model("smollm2-135m")
    spec = StudentSpec(base_model="smollm2-135m", dims=resolve_dims("fix:16", model), layers=range(30),
                       attention=Attention(window=8, sink=4), base=fingerprint(model))
    build(model, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".dofattn." in name:
                p.add_(0.01 * torch.randn_like(p))
        model(IDS[:1], use_cache=False)
    save_student(model, tmp_path / "student", spec)
    ref = reference(model)
    assert main(["export", "--model", str(tmp_path / "student"), "--out", str(tmp_path / "out" / "smollm2")]) == 0
    got = reload_in_fresh_process({"smollm2": tmp_path / "out" / "smollm2"}, tmp_path)[0]["smollm2"]
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-5, rtol=0)
    assert torch.equal(got["tokens"], ref["tokens"]) and set(got["slots"]) == {"LinearStateLayer"}


@pytest.mark.slow
def test_every_family_exports_to_the_same_logits(tmp_path, tokenizer):
    """All ten families (tests/test_families.py's tiny models, window + sink students, a model's own sliding-window
    layers kept exact), loaded back by `load_export`: the same classes as the folder's modeling file. 20-30 s."""
    from dataclasses import replace

    from dofattn.model.hf import local_layers
    from tests.test_families import FAMILIES, ids, make_student as family_student, tiny

    for family in FAMILIES:
        model, spec = family_student(family)
        base = tmp_path / family / "base"
        tiny(family).save_pretrained(base)
        tokenizer.save_pretrained(base)
        save_student(model, tmp_path / family / "student", replace(spec, base_model=str(base)))
        assert main(["export", "--model", str(tmp_path / family / "student"), "--out", str(tmp_path / family / "out")
                     ]) == 0
        loaded, _, _ = load_export(tmp_path / family / "out")
        card = (tmp_path / family / "out" / "README.md").read_text()
        assert ("own sliding-window layer" in card) == bool(set(local_layers(model.config)) - set(spec.layers)), family
        x = ids(2, 11, seed=2)
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits, atol=1e-5, rtol=0,
                                       msg=lambda m: f"{family}: {m}")
            assert torch.equal(loaded.generate(x[:1], max_new_tokens=6, do_sample=False),
                               model.generate(x[:1], max_new_tokens=6, do_sample=False)), family


def test_a_card_names_the_models_own_sliding_window_layers_apart_from_kept_ones():
    """`StudentSpec.describe(local=...)`: a Gemma-like student's own sliding-window layers are named as they are,
    not as kept layers bounded by selection (which holds sink, window and chosen keys)."""
    from dofattn.spec import Attention, Kept, StudentSpec

    spec = StudentSpec(base_model="x", dims=(8,) * 6, layers=(5,), attention=Attention(window=4, sink=1),
                       kept=Kept(select=16))
    kept, local = spec.describe(), spec.describe(local=[0, 1, 3, 4])
    assert "softmax attention kept in layers 0, 1, 2, 3, 4 (after the prompt" in kept[1]
    assert "own sliding-window layers 0, 1, 3, 4 as they are" in local[1]
    assert local[2].startswith("softmax attention kept in layer 2 (after the prompt")
