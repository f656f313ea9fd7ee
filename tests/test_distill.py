"""`dofattn distill` on tiny models: layerwise and end-to-end training lower their losses, a killed run resumes to
bit-identical weights, two gloo processes train the same layers as one, bad input is a one-line error that leaves
no run folder, a run folder's recipe.toml makes the same run again, and the run folder is a loadable student.

Everything runs with one torch thread: the models are tiny, and two threads on a busy 2-core machine spin against
each other (an end-to-end step goes from 10 ms to 1 s). Subprocesses get OMP_NUM_THREADS=1 for the same reason, and
so that they compute with the same thread count as the in-process reference runs (bit-identical results).
"""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dofattn.cli import main
from dofattn.distill.end_to_end import cooldown_lr, loss as end_to_end_loss
from dofattn.distill.layerwise import layer_file
from dofattn.distill.losses import LOSSES
from dofattn.distill.teacher import TeacherStream
from dofattn.dof import DofResult, LayerDof
from dofattn.evaluate import perplexity
from dofattn.model.hf import load_model
from dofattn.recipe import packaged as packaged_recipes
from dofattn.model.student import attention_modules, head_layout, linearize, load_student
from dofattn.spec import Attention
from tests.conftest import tiny_model

LAYERS = 3  # every tiny model has 3 layers, 4 heads of 16 (llama: 2 kv heads)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread in this process too (see the module docstring); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory, tokenizer, corpus) -> Path:
    """A tiny llama trained for a few seconds on the corpus: its attention matters, so the student's CE can move."""
    from dofattn.data import token_blocks

    model = tiny_model("llama")
    blocks = token_blocks(str(corpus), tokenizer, 32, 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(60):
        ids = blocks[torch.randint(len(blocks), (8,), generator=gen)]
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("trained-llama")
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


SMALL = ("layerwise.seq_len=32", "layerwise.blocks=8", "layerwise.batch_size=2", "end_to_end.batch_size=2",
         "end_to_end.seq_len=32", "eval.blocks=2", "eval.seq_len=32", "student.dims=fix:8", "end_to_end.steps=0")


def distill_argv(model, data, out, *extra) -> list[str]:
    """A small, fast `dofattn distill` command line on the paper recipe; `extra` are recipe keys (KEY=VALUE, given
    to --set; later ones win) or flags."""
    argv = ["distill", "--recipe", "paper", "--model", str(model), "--data", str(data), "--out", str(out),
            "--device", "cpu"]
    for item in (*SMALL, *map(str, extra)):
        argv += ["--set", item] if "=" in item and not item.startswith("--") else [item]
    return argv


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def features(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "features.safetensors"))


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"tensors differ: {different}"


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- layerwise training ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def teachers(model_dirs, trained_llama) -> dict[str, Path]:
    """The random tiny models (near-uniform attention, an easy target) and the trained llama (a sharp one)."""
    return {**model_dirs, "trained-llama": trained_llama}


@pytest.mark.parametrize("teacher,feature,loss,window", [
    ("llama", "prf", "softmax", 0), ("gpt2", "prf", "softmax", 0), ("gpt_neox", "prf", "softmax", 0),
    ("gpt2", "prf", "l2", 0),
    ("trained-llama", "prf", "softmax", 0), ("trained-llama", "prf", "l2", 0),
    ("trained-llama", "hedgehog", "softmax", 0), ("trained-llama", "dijiang", "softmax", 0),
    ("trained-llama", "prf", "softmax", 8), ("trained-llama", "prf", "l2", 8),
    ("trained-llama", "hedgehog", "softmax", 8),
    ("trained-llama", "hedgehog", "softmax", "decay"), ("trained-llama", "prf", "l2", "decay"),
    ("trained-llama", "prf", "softmax", "8+decay"), ("trained-llama", "prf", "l2", "8+decay"),
    ("trained-llama", "prf", "softmax", "8+sink"), ("trained-llama", "prf", "l2", "8+sink"),
    ("trained-llama", "prf", "softmax", "8+sink+decay"), ("trained-llama", "prf", "l2", "8+sink+decay"),
    ("trained-llama", "hedgehog", "softmax", "gate"), ("trained-llama", "prf", "l2", "gate"),
])
def test_layerwise_training_lowers_every_layers_loss(capsys, teachers, corpus, tmp_path, teacher, feature, loss,
                                                     window):
    out = tmp_path / "run"
    decay = "head" if "decay" in str(window) else "gate" if window == "gate" else "none"
    sink = 2 if "sink" in str(window) else 0   # the first 2 tokens exact beside an 8-token window
    window = 8 if window in ("8+decay", "8+sink", "8+sink+decay") else 0 if decay != "none" else window
    code, _, err = run(capsys, *distill_argv(teachers[teacher], corpus, out, f"student.feature={feature}",
                                             f"layerwise.loss={loss}", "layerwise.steps=150",
                                             f"student.window={window}", f"student.decay={decay}",
                                             f"student.sink={sink}"))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    assert sorted(log["layers"]) == [str(i) for i in range(LAYERS)] and log["end_to_end"] == {}

    # the logged loss on the fixed batch (the first `batch_size` blocks) against the untrained features' loss on it
    assert not (out / "teacher").exists()  # nothing of the teacher is written to disk
    from dofattn.data import token_blocks

    model, tok = load_model(str(teachers[teacher]))
    linearize(model, [8] * LAYERS, Attention(feature=feature, window=window, sink=sink, decay=decay),
              seed=0)   # the start
    heads = head_layout(model)
    blocks = token_blocks(str(corpus), tok, 32, 8, split="train", seed=0)  # the run's training blocks
    modules = attention_modules(model)
    for layer, (q, k, v) in TeacherStream(model, blocks, batch_size=2, progress=False).walk(list(range(LAYERS))):
        module, entry = modules[layer], log["layers"][str(layer)]
        # kv heads -> query heads, as train_layer does
        k, v = (x.repeat_interleave(heads[0] // heads[1], dim=2) for x in (k, v))
        with torch.no_grad():
            before = LOSSES[loss](module.dofattn.eval(), q[:2], k[:2], v[:2], module.scaling).item()
        assert entry["steps"] == 150
        assert entry["fixed_batch_loss"] < 0.7 * before, (layer, entry, before)
        # a window hybrid with a scale-free map starts from a calibrated gain: a better first loss, a smaller drop
        drop = 0.8 if window and feature != "prf" else 0.7
        assert entry["last_loss"] < drop * entry["first_loss"], (layer, entry)


# --- end-to-end training -------------------------------------------------------------------------------------------

def test_end_to_end_training_lowers_the_lm_loss(capsys, trained_llama, corpus, tmp_path, tokenizer):
    """layerwise.steps = 0: the end-to-end phase alone, from untrained features."""
    from dofattn.data import token_blocks

    out = tmp_path / "run"
    argv = distill_argv(trained_llama, corpus, out, "layerwise.steps=0", "end_to_end.steps=40",
                        "end_to_end.batch_size=4", "end_to_end.lr=1e-2", "eval.blocks=4")
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    assert log["layers"] == {} and len(log["end_to_end"]["losses"]) == 40

    untrained, _ = load_model(str(trained_llama))
    linearize(untrained, [8] * LAYERS, Attention(feature="prf", window=0, sink=0), seed=0)  # the run's starting point
    trained, _, _ = load_student(out)
    train = token_blocks(str(corpus), tokenizer, 32, 8, split="train", seed=0)  # the run's training blocks
    valid = token_blocks(str(corpus), tokenizer, 32, 4, split="validation", seed=0)
    with torch.no_grad():
        before, after = (end_to_end_loss(m, train, kd_weight=1.0).item() for m in (untrained, trained))
    assert after < 0.8 * before, (before, after)  # the objective it trained on, on its own blocks
    ppl_before, ppl_after = (perplexity(m, valid, progress=False) for m in (untrained, trained))
    teacher_ppl = log["evaluation"]["teacher_ppl"]
    # held-out text: the student's excess cross-entropy over its teacher shrinks by a clear margin
    excess_before, excess_after = (math.log(p / teacher_ppl) for p in (ppl_before, ppl_after))
    assert excess_after < 0.8 * excess_before, (teacher_ppl, ppl_before, ppl_after)
    assert log["evaluation"]["student_ppl"] == ppl_after  # the saved student is the trained one, bit for bit


@pytest.mark.parametrize("kd_weight", [0.0, 1.0, 0.5])
def test_end_to_end_loss_is_cross_entropy_plus_kl_to_the_teacher(kd_weight):
    """The end-to-end objective written out: the mean next-token cross-entropy of the student, plus kd_weight × the
    mean over positions of Σ_v p_teacher (log p_teacher − log p_student), the teacher being the model before
    linearizing."""
    teacher, student = tiny_model("llama"), tiny_model("llama")
    for model in (teacher, student):  # attention that matters and sharp logits: the two differ by a clear KL
        with torch.no_grad():
            model.model.norm.weight.mul_(30)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(20)
    linearize(student, [8] * LAYERS, Attention(feature="prf", window=0, sink=0), seed=0)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        log_s = torch.log_softmax(student(input_ids=ids).logits[:, :-1].double(), -1)
        log_t = torch.log_softmax(teacher(input_ids=ids).logits[:, :-1].double(), -1)
        ce = -log_s.gather(-1, ids[:, 1:, None]).mean()
        kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean()
        reverse = (log_s.exp() * (log_s - log_t)).sum(-1).mean()
        assert kl > 0.01 and abs(kl - reverse) > 1e-4 * ce  # the KL term and its direction show above rel=1e-5
        got = end_to_end_loss(student, ids, kd_weight).item()
    assert got == pytest.approx((ce + kd_weight * kl).item(), rel=1e-5)


def test_conv_stays_the_identity_layerwise_and_trains_end_to_end(capsys, model_dirs, corpus, tmp_path):
    """The layerwise losses compare the teacher's own q and k, so the filters keep their start there; the end-to-end
    phase moves them, and the saved student carries them."""
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "student.conv=3", "layerwise.steps=3",
                                             "end_to_end.steps=4", "end_to_end.lr=1e-2", "student.decay=gate"))
    assert code == 0, err
    identity = torch.zeros(3, 1, 1)
    identity[0] = 1
    layer = load_file(str(layer_file(out, 1)))
    assert torch.equal(layer["conv.conv_k"], identity.expand_as(layer["conv.conv_k"]))
    spec = json.loads((out / "dofattn.json").read_text())
    assert spec["attention"]["conv"] == 3 and json.loads((out / "log.json").read_text())["recipe"]["student.conv"] == 3
    saved = features(out)
    for i in range(LAYERS):
        for name in ("conv_q", "conv_k", "conv_v"):
            weight = saved[f"model.layers.{i}.self_attn.dofattn.conv.{name}"]
            assert weight.shape[0] == 3 and (weight - identity).abs().max() > 1e-3, (i, name)
    student, _, _ = load_student(out)
    assert attention_modules(student)[0].dofattn.attention.conv == 3


def test_conv_lr_gives_the_filters_a_learning_rate_of_their_own(capsys, model_dirs, corpus, tmp_path):
    """One end-to-end step from the same start: Adam's first step moves each weight by about its learning rate, so
    the filters move about conv_lr while everything else moves exactly as with the filters at lr."""
    runs = {}
    for name, more in (("plain", ()), ("same", ("end_to_end.conv_lr=1e-3",)), ("fast", ("end_to_end.conv_lr=0.1",))):
        runs[name] = tmp_path / name
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, runs[name], "student.conv=3",
                                                 "layerwise.steps=2", "end_to_end.steps=1", "end_to_end.lr=1e-3",
                                                 *more))
        assert code == 0, err
    plain, same, fast = (features(runs[n]) for n in ("plain", "same", "fast"))
    identity = torch.zeros(3, 1, 1)
    identity[0] = 1
    for name, tensor in plain.items():
        torch.testing.assert_close(same[name], tensor, rtol=0, atol=1e-7)
        if name.endswith(("conv_q", "conv_k", "conv_v")):
            moved = (fast[name] - identity).abs().max().item()
            assert 0.05 < moved < 0.15 and (tensor - identity).abs().max().item() < 2e-3, (name, moved)
        else:
            torch.testing.assert_close(fast[name], tensor, rtol=0, atol=1e-7)


# --- resuming -----------------------------------------------------------------------------------------------------

def kill_when(cmd: list[str], ready, log: Path, timeout: float = 120.0) -> int:
    """Start `cmd` (output to `log`), SIGKILL it as soon as `ready()` holds; its exit code, -SIGKILL if killed."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=ENV, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if ready():
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.002)
            return proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_killed_run_resumes_to_identical_weights(capsys, model_dirs, corpus, tmp_path):
    # gpt2 has dropout: the end-to-end phase's masks must not depend on where the run was resumed
    extra = ("layerwise.steps=150", "end_to_end.steps=30", "end_to_end.checkpoint_every=3")
    reference = tmp_path / "reference"
    code, _, err = run(capsys, *distill_argv(model_dirs["gpt2"], corpus, reference, *extra))
    assert code == 0, err

    out = tmp_path / "resumed"
    argv = distill_argv(model_dirs["gpt2"], corpus, out, *extra)
    cmd = [sys.executable, "-m", "dofattn", *argv]
    # 1. killed during layerwise training: layer 0 saved, layer 1 in training, layer 2 not started
    log_file = tmp_path / "output.txt"
    code = kill_when(cmd, lambda: layer_file(out, 0).is_file(), log_file)
    assert code == -signal.SIGKILL, f"not killed in layerwise training (exit {code}): {log_file.read_text()[-2000:]}"
    assert not layer_file(out, LAYERS - 1).is_file() and not (out / "end_to_end").exists()
    # 2. resumed, killed again during end-to-end training, after a checkpoint
    state = out / "end_to_end" / "state.json"
    code = kill_when(cmd, state.is_file, log_file)
    assert code == -signal.SIGKILL, f"not killed in end-to-end training (exit {code}): {log_file.read_text()[-2000:]}"
    assert 0 < json.loads(state.read_text())["step"] < 30 and not (out / "log.json").exists()
    # 3. resumed to the end (in this process: the same command, one subprocess start less)
    code, _, err = run(capsys, *argv)
    assert code == 0, err

    assert_identical(features(out), features(reference))
    log, ref_log = (json.loads((f / "log.json").read_text()) for f in (out, reference))
    assert log["end_to_end"]["losses"] == ref_log["end_to_end"]["losses"]
    for layer in range(LAYERS):
        assert_identical(load_file(str(layer_file(out, layer))), load_file(str(layer_file(reference, layer))))
        for key in ("first_loss", "last_loss", "fixed_batch_loss"):
            assert log["layers"][str(layer)][key] == ref_log["layers"][str(layer)][key]


def test_two_gloo_processes_train_the_same_layers_as_one(capsys, model_dirs, corpus, tmp_path):
    """Layerwise: rank 0 trains layers 0 and 2, rank 1 layer 1, bit-identical to one process. (The end-to-end
    phase's two processes: tests/test_end_to_end.py.)"""
    one, two = tmp_path / "one", tmp_path / "two"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, one, "layerwise.steps=40"))
    assert code == 0, err
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dofattn",
           *distill_argv(model_dirs["llama"], corpus, two, "layerwise.steps=40")]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log_one, log_two = (json.loads((f / "log.json").read_text()) for f in (one, two))
    for layer in range(LAYERS):
        assert_identical(load_file(str(layer_file(two, layer))), load_file(str(layer_file(one, layer))))
        for key in ("first_loss", "last_loss", "fixed_batch_loss"):
            assert log_two["layers"][str(layer)][key] == log_one["layers"][str(layer)][key]
    assert_identical(features(two), features(one))


# --- bad input ---------------------------------------------------------------------------------------------------

def other_model_dims(folder: Path) -> Path:
    path = folder / "other-dof.json"
    layers = [LayerDof(layer=i, dof=10.0, head_dof=[10.0] * 4, dim=8) for i in range(LAYERS)]
    path.write_text(DofResult(model="other", samples=64, budget=8, head_dim=16, layers=layers).to_json())
    return path


@pytest.mark.parametrize("args,message", [
    (["layerwise.loss=kl"], "layerwise.loss = 'kl'; use one of softmax, l2"),
    (["student.feature=cosine"], "student.feature = 'cosine'; use one of prf, performer, hedgehog, dijiang"),
    (["layerwise.loss=l2", "student.feature=hedgehog"], "layerwise.loss = 'l2' compares kernel values"),
    (["student.dims={other_dims}"], "was computed for model 'other'"),
    (["student.dims=fix:0"], "bad student.dims 'fix:0'"),
    (["student.dims=linear-dof"], "student.dims = 'linear-dof'; use dof, clip, fix, fix:C or a dof.json file"),
    (["student.dims={tmp}/missing.json"], "does not exist"),
    (["end_to_end.cooldown_steps=-1"], "end_to_end.cooldown_steps = -1: give >= 0"),
    (["end_to_end.steps=2", "end_to_end.cooldown_steps=3"], "longer than the phase (end_to_end.steps = 2)"),
    (["layerwise.steps=0"], "layerwise.steps and end_to_end.steps are both 0"),
    (["layerwise.steps=-1"], "layerwise.steps = -1: give >= 0"),
    (["layerwise.steps=2.5"], "layerwise.steps = 2.5 is not an integer"),
    (["end_to_end.lr=0"], "end_to_end.lr = 0.0: give a value > 0"),
    (["end_to_end.kd_weight=nan"], "end_to_end.kd_weight = nan is not a finite number"),
    (["student.window=-1"], "student.window = -1: give >= 0 tokens"),
    (["student.window=8", "student.sink=-1"], "student.sink = -1: give >= 0 tokens"),
    (["student.sink=4"], "student.sink = 4 sits beside a softmax window"),
    (["student.window=8", "student.decay=gate"], "student.decay = 'gate' is for pure linear attention"),
    (["student.decay=fast"], "student.decay = 'fast'; use one of none, head, gate"),
    (["student.delta=true"], "student.delta = true measured worse or flat, no recipe used it, and it left dofattn"),
    (["end_to_end.carry=64"], "end_to_end.carry = 64 measured worse or flat"),
    (["student.conv=1"], "student.conv = 1: a filter is at least 2 tokens wide"),
    (["student.conv=-4"], "student.conv = -4: a filter is at least 2 tokens wide"),
    (["end_to_end.conv_lr=0.1"], "end_to_end.conv_lr is the learning rate of the convolution filters"),
    (["student.conv=4", "end_to_end.conv_lr=0"], "end_to_end.conv_lr = 0.0: give a learning rate > 0"),
    (["student.lora_targets=all"], "student.lora_targets = 'all' needs adapters"),
    (["student.lora_rank=2"], "student.lora_rank: adapters train in the end-to-end phase"),
    (["end_to_end.seq_len=1"], "end_to_end.seq_len = 1: give >= 2"),
    (["end_to_end.blocks=0"], "end_to_end.blocks = 0: give >= 1"),
    (["layerwise.steps=0", "end_to_end.steps=1", "end_to_end.blocks=100000"],
     "100000 blocks of 32 tokens were asked for"),
    (["student.keep_softmax=3"], "student.keep_softmax = 3 leaves no layer to linearize"),
    (["student.keep_softmax=-1"], "student.keep_softmax = -1: give a count of layers >= 1, a share"),
    (["student.keep_softmax=2.5"], "student.keep_softmax = 2.5: give a count of layers >= 1, a share"),
    (["layerwise.loss=l2", "student.window=32"], "set layerwise.seq_len > student.window (32)"),
    (["student.windw=3"], "unknown recipe key 'student.windw'; did you mean student.window?"),
    (["steps=3"], "recipe key 'steps' is in several tables: say which, layerwise.steps or end_to_end.steps"),
    (["--set", "window"], "--set 'window': give KEY=VALUE"),
    (["--recipe", "fast"], "unknown recipe 'fast'; use one of long-context"),
    (["--recipe", "{tmp}/missing.toml"], "recipe file {tmp}/missing.toml does not exist"),
    (["--recipe", "{bad_toml}"], "is not valid TOML"),
    (["--recipe", "{bad_table}"], "unknown table [training]"),
    (["--time-limit", "-1"], "--time-limit must be >= 0 minutes"),
    (["--dtype", "float16"], "run.dtype = 'float16'; use one of float32, bfloat16"),
    (["--data", "{tmp}/missing.txt"], "neither 'wiki-sample'"),
    (["--model", "{tmp}/no-such-model"], "does not exist"),
    (["--model", "{tmp}/run-folder"], "is a dofattn student, not a base model: give its base model"),
    (["--continue-from", "{tmp}"], "is not a finished (or time-limited) dofattn distill run folder: it needs recipe.toml"),
])
def test_bad_input_is_one_line_error(capsys, model_dirs, corpus, tmp_path, args, message):
    other_dims = other_model_dims(tmp_path)
    (tmp_path / "run-folder").mkdir()
    (tmp_path / "run-folder" / "dofattn.json").write_text("{}")
    bad_toml, bad_table = tmp_path / "bad.toml", tmp_path / "table.toml"
    bad_toml.write_text("[student\nwindow = 3\n")
    bad_table.write_text("[training]\nsteps = 3\n")
    out = tmp_path / "run"
    values = dict(tmp=tmp_path, other_dims=other_dims, bad_toml=bad_toml, bad_table=bad_table)
    argv = distill_argv(model_dirs["llama"], corpus, out, *[a.format(**values) for a in args])
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
    assert len(lines) == 1 and message.format(**values) in lines[0], err
    assert not out.exists(), "a rejected command left a run folder behind"


def test_run_folder_with_another_recipe_is_refused_and_untouched(capsys, model_dirs, corpus, tmp_path):
    out = tmp_path / "run"
    base = ("layerwise.steps=5", "end_to_end.steps=2")
    argv = distill_argv(model_dirs["gpt_neox"], corpus, out, *base)
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    before = snapshot(out)
    for extra, changed in ((("layerwise.steps=6",), "layerwise.steps"), (("--seed", "1"), "run.seed"),
                           (("student.window=4",), "student.window")):
        code, _, err = run(capsys, *distill_argv(model_dirs["gpt_neox"], corpus, out, *base, *extra))
        assert code == 2
        lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
        assert len(lines) == 1 and f"another recipe ({changed})" in lines[0], err
        assert snapshot(out) == before
        code, _, err = run(capsys, *distill_argv(model_dirs["gpt_neox"], corpus, out, *base, *extra), "--dry-run")
        assert code == 2 and f"another recipe ({changed})" in err, err          # the plan refuses it as the run
        assert snapshot(out) == before
    # the same recipe again: a finished run resumes to the same student; so does its own recipe.toml
    reference = features(out)
    for again in (argv, ["distill", "--recipe", str(out / "recipe.toml"), "--out", str(out), "--device", "cpu"]):
        code, printed, err = run(capsys, *again)
        assert code == 0 and "holds a finished run with this recipe" in printed, err
        assert_identical(features(out), reference)
    # a run folder of an older dofattn (run.json) is refused, not resumed
    old = tmp_path / "old"
    old.mkdir()
    (old / "run.json").write_text("{}")
    code, _, err = run(capsys, *distill_argv(model_dirs["gpt_neox"], corpus, old, "layerwise.steps=5"))
    assert code == 2 and "holds a run of an older dofattn (run.json" in err, err
    mine = tmp_path / "mine"                         # a folder of the user's own: refused by the plan and the run
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for dry in ((), ("--dry-run",)):
        code, _, err = run(capsys, *distill_argv(model_dirs["gpt_neox"], corpus, mine, *base), *dry)
        assert code == 2 and "exists and is not a dofattn run folder" in err, err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_out_folder_that_is_not_a_run_is_refused(capsys, model_dirs, corpus, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out)
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "layerwise.steps=5"))
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
    assert len(lines) == 1 and "is not a dofattn run folder" in lines[0], err
    assert snapshot(out) == before


# --- recipes ------------------------------------------------------------------------------------------------------

def test_a_run_folders_recipe_makes_the_same_run_again(capsys, model_dirs, corpus, tmp_path):
    """recipe.toml holds every key resolved, the [run] table included: passed back with only --out and --device it
    trains a bit-identical student, and it says what the command line set (a window, a seed, the model)."""
    first, again = tmp_path / "first", tmp_path / "again"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, first, "layerwise.steps=4",
                                             "end_to_end.steps=2", "student.window=8", "student.sink=2",
                                             "--seed", "3"))
    assert code == 0, err
    text = (first / "recipe.toml").read_text()
    for line in ("window = 8", "sink = 2", "seed = 3", f'model = "{model_dirs["llama"]}"', 'name = "paper"'):
        assert line in text.splitlines(), line
    code, _, err = run(capsys, "distill", "--recipe", str(first / "recipe.toml"), "--out", str(again),
                       "--device", "cpu")
    assert code == 0, err
    assert_identical(features(again), features(first))
    assert (again / "recipe.toml").read_text() == text
    spec = json.loads((again / "dofattn.json").read_text())
    assert (spec["attention"]["window"], spec["attention"]["sink"], spec["seed"], spec["schema"]) == (8, 2, 3, 4)


@pytest.mark.parametrize("name", sorted(packaged_recipes()))      # a new recipe is tested by being packaged
def test_every_packaged_recipe_builds_its_student(capsys, model_dirs, corpus, tmp_path, name):
    """Each packaged recipe, shrunk to a tiny model and a step or two, runs end to end, and the saved student is
    the architecture its file asks for."""
    from dofattn import recipe as recipes

    recipe = recipes.load(name)
    if recipe.student.lora_rank:                  # only a recipe with adapters needs peft
        pytest.importorskip("peft")
    out = tmp_path / name
    argv = distill_argv(model_dirs["llama"], corpus, out, "--recipe", name, "layerwise.steps=2",
                        "end_to_end.steps=1", "end_to_end.eval_every=0", "end_to_end.blocks=8",
                        "end_to_end.cooldown_steps=0", f"student.keep_softmax={min(recipe.student.keep_softmax, 1):g}",
                        f"student.window={min(recipe.student.attention.window, 8)}",
                        f"student.dims={recipe.student.dims}",
                        "--dtype", "float32")
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    _, _, spec = load_student(out)
    s = recipe.student
    assert spec.attention == dataclasses.replace(s.attention, window=min(s.attention.window, 8))   # all of it
    assert spec.kept == s.kept
    assert (spec.lora_rank, spec.lora_targets) == (s.lora_rank, s.lora_targets)
    assert len(spec.layers) == LAYERS - bool(s.keep_softmax)          # 1 kept, or a share of 3 layers: 1
    assert (out / {"dof": "attention_dof.json", "copy": "copy_scores.json"}[s.keep_softmax_by]).is_file() == \
        bool(s.keep_softmax)
    if s.dims == "fix":
        assert spec.dims == (16,) * LAYERS                           # the head size
    else:
        assert sum(spec.dims) == 16 * LAYERS and (out / "dof.json").is_file()   # DoF-allocated, mean = head size


def test_lora_without_peft_fails_before_training(capsys, model_dirs, corpus, tmp_path, monkeypatch):
    """Without peft, a LoRA run stops at once with how to install it, and leaves no run folder."""
    monkeypatch.setitem(sys.modules, "peft", None)        # `import peft` raises ImportError
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["gpt2"], corpus, out, "student.lora_rank=2",
                                             "end_to_end.steps=1"))
    assert code != 0 and "LoRA needs peft, dofattn's [lora] extra: pip install" in err
    assert not out.exists()


# --- the run folder as a student -----------------------------------------------------------------------------------

def test_run_folder_is_a_loadable_student(capsys, model_dirs, corpus, tmp_path, tokenizer):
    from dofattn.data import token_blocks

    out = tmp_path / "run"
    code, out_text, err = run(capsys, *distill_argv(model_dirs["gpt2"], corpus, out, "student.dims=dof",
                                                    "layerwise.steps=10", "end_to_end.steps=2"))
    assert code == 0, err
    assert "validation perplexity" in out_text and f"dofattn generate --model {out}" in out_text
    log = json.loads((out / "log.json").read_text())
    dof = DofResult.from_json((out / "dof.json").read_text())
    assert dof.model == str(model_dirs["gpt2"]) and log["dims"] == dof.dims and sum(dof.dims) == LAYERS * 16

    student, _, spec = load_student(out)
    assert list(spec.dims) == dof.dims and spec.attention.feature == "prf" and spec.layers == tuple(range(LAYERS))
    valid = token_blocks(str(corpus), tokenizer, 32, 2, split="validation", seed=0)
    assert perplexity(student, valid, progress=False) == log["evaluation"]["student_ppl"]  # the very same model

    code, text, err = run(capsys, "generate", "--model", str(out), "--max-new-tokens", "3", "--prompt", "The fox")
    assert code == 0, err
    assert text.startswith("The fox") and "student of" in err


def test_keep_softmax_leaves_the_layers_with_the_largest_attention_dof_exact(capsys, model_dirs, corpus, tmp_path):
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["gpt2"], corpus, out, "layerwise.steps=3",
                                             "student.keep_softmax=2"))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    kept = log["softmax_layers"]
    assert len(kept) == 2 and sorted(log["layers"]) == [str(i) for i in range(LAYERS) if i not in kept]
    record = json.loads((out / "attention_dof.json").read_text())   # measured once, kept in the run folder
    assert len(record["layers"]) == LAYERS and record["blocks"] == 8 and not (out / "dof.json").exists()
    assert kept == sorted(sorted(range(LAYERS), key=lambda i: -record["layers"][i])[:2])
    student, _, spec = load_student(out)
    assert list(spec.layers) == [i for i in range(LAYERS) if i not in kept] and spec.softmax_layers == kept
    modules = attention_modules(student)
    assert [hasattr(m, "dofattn") for m in modules] == [i not in kept for i in range(LAYERS)]


def test_keep_softmax_by_copy_keeps_the_layers_whose_heads_copy_most(capsys, model_dirs, corpus, tmp_path):
    """keep_softmax_by = copy: the layers of the best copy scores (`choose.copy_scores`) stay softmax; the scores
    are measured once and kept in the run folder."""
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "layerwise.steps=2",
                                             "student.keep_softmax=1", "student.keep_softmax_by=copy"))
    assert code == 0, err
    kept = json.loads((out / "log.json").read_text())["softmax_layers"]
    record = json.loads((out / "copy_scores.json").read_text())
    assert len(record["heads"]) == LAYERS and record["layers"] == [max(h) for h in record["heads"]]
    assert kept == [max(range(LAYERS), key=lambda i: record["layers"][i])]
    assert not (out / "attention_dof.json").exists()
    assert load_student(out)[2].softmax_layers == kept


def test_end_to_end_curve_of_perplexity_against_tokens(capsys, model_dirs, corpus, tmp_path):
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "layerwise.steps=0",
                                             "end_to_end.steps=4", "end_to_end.eval_every=2",
                                             "end_to_end.checkpoint_every=3"))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    curve = log["end_to_end"]["curve"]
    assert [(c["step"], c["tokens"]) for c in curve] == [(2, 2 * 2 * 32), (4, 4 * 2 * 32)]
    # the last point is the finished student on the same validation blocks as the final evaluation
    assert math.isclose(curve[-1]["ppl"], log["evaluation"]["student_ppl"], rel_tol=1e-5)


def test_end_to_end_reads_its_own_blocks(capsys, model_dirs, corpus, tmp_path):
    """end_to_end.seq_len / blocks shape the end-to-end phase's text, not the layerwise stage's."""
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "layerwise.steps=2",
                                             "end_to_end.steps=3", "end_to_end.seq_len=48", "end_to_end.blocks=5",
                                             "end_to_end.eval_every=3"))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    assert log["end_to_end"]["curve"][-1]["tokens"] == 3 * 2 * 48
    assert all(layer["steps"] == 2 for layer in log["layers"].values())


@pytest.mark.parametrize("keep", [(), ("student.keep_softmax=1",)])
def test_time_limit_stops_evaluates_and_the_same_command_goes_on(capsys, model_dirs, corpus, tmp_path, keep):
    """A tiny --time-limit stops the end-to-end phase after its first step with a saved, evaluated student; the same
    command (any limit) goes on from the checkpoint, and the finished run equals one that never stopped (with
    softmax layers: the same layers kept, measured once)."""
    extra = ("layerwise.steps=3", "end_to_end.steps=4", "end_to_end.checkpoint_every=10", *keep)
    reference = tmp_path / "reference"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, reference, *extra))
    assert code == 0, err
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "--time-limit", 1e-9))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    e2e = log["end_to_end"]
    assert (e2e["steps"], e2e["target_steps"], e2e["stopped"]) == (1, 4, "time limit")
    assert (out / "features.safetensors").is_file() and log["evaluation"]["student_ppl"] > 0
    code, printed, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "--time-limit", 1e-9))
    assert code == 0 and "stopped at its time limit; going on from step 1 to 4" in printed, err
    assert json.loads((out / "log.json").read_text())["end_to_end"]["steps"] == 2
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra))
    assert code == 0, err
    log, ref_log = (json.loads((f / "log.json").read_text()) for f in (out, reference))
    assert log["end_to_end"]["steps"] == 4 and "stopped" not in log["end_to_end"]
    assert log["end_to_end"]["losses"] == ref_log["end_to_end"]["losses"]
    untimed = [{n: {k: v for k, v in layer.items() if k != "seconds"} for n, layer in x["layers"].items()}
               for x in (log, ref_log)]
    assert untimed[0] == untimed[1]                   # the layerwise results, not their wall time
    assert log["evaluation"]["layerwise_student_ppl"] == ref_log["evaluation"]["layerwise_student_ppl"]
    assert log["softmax_layers"] == ref_log["softmax_layers"] and len(log["softmax_layers"]) == len(keep)
    assert_identical(features(out), features(reference))


@pytest.mark.parametrize("first,keep", [(2, ()), (0, ()), (0, ("student.keep_softmax=1",))])
def test_more_end_to_end_steps_go_on_from_a_finished_run(capsys, model_dirs, corpus, tmp_path, first, keep):
    """A finished run asked again with more end_to_end.steps goes on from where it ended (its end-to-end
    checkpoint, or its saved layerwise student if it had no end-to-end phase) and equals the run made with that
    many steps at once; fewer steps than before are refused."""
    extra = ("layerwise.steps=3", "end_to_end.checkpoint_every=10", *keep)
    reference = tmp_path / "reference"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, reference, *extra, "end_to_end.steps=4"))
    assert code == 0, err
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, f"end_to_end.steps={first}"))
    assert code == 0, err
    code, printed, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "end_to_end.steps=4"))
    assert code == 0 and f"asked for more steps; going on from step {first} to 4" in printed, err
    log, ref_log = (json.loads((f / "log.json").read_text()) for f in (out, reference))
    assert log["end_to_end"]["steps"] == 4 and log["end_to_end"]["losses"] == ref_log["end_to_end"]["losses"]
    assert log["evaluation"]["layerwise_student_ppl"] == pytest.approx(ref_log["evaluation"]["layerwise_student_ppl"])
    assert "steps = 4" in (out / "recipe.toml").read_text().split("[end_to_end]")[1].splitlines()[1]
    assert_identical(features(out), features(reference))
    before = snapshot(out)
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "end_to_end.steps=3"))
    assert code != 0 and "end_to_end.steps can only grow" in err
    assert snapshot(out) == before


def test_cooldown_lowers_the_learning_rate_at_the_end_and_resumes_exactly(capsys, model_dirs, corpus, tmp_path):
    assert [cooldown_lr(0.1, step, 5, 2) for step in range(5)] == [0.1, 0.1, 0.1, 0.1, 0.05]
    assert [cooldown_lr(0.1, step, 3, 0) for step in range(3)] == [0.1] * 3
    extra = ("layerwise.steps=3", "end_to_end.checkpoint_every=10", "end_to_end.steps=4")
    constant, cooled, resumed = tmp_path / "constant", tmp_path / "cooled", tmp_path / "resumed"
    for folder, more in ((constant, ()), (cooled, ("end_to_end.cooldown_steps=3",)),
                         (resumed, ("end_to_end.cooldown_steps=3", "--time-limit", 1e-9)),
                         (resumed, ("end_to_end.cooldown_steps=3",))):
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, folder, *extra, *more))
        assert code == 0, err
    logs = [json.loads((f / "log.json").read_text())["end_to_end"]["losses"] for f in (constant, cooled, resumed)]
    assert logs[0][:2] == logs[1][:2] and logs[0][2:] != logs[1][2:]   # the first two steps are at the full rate
    assert logs[1] == logs[2]
    assert_identical(features(resumed), features(cooled))


def test_continue_from_copies_a_run_and_goes_on_with_more_text(capsys, model_dirs, corpus, tmp_path):
    """--continue-from on the same text equals the longer run made at once; on pooled text (--data A+B, scored on
    --eval-data A) it trains on the pool, scores the same validation blocks, and leaves the source run untouched.
    Changes that would make another student are refused before anything is copied."""
    extra = ("layerwise.steps=3", "end_to_end.checkpoint_every=10")
    source, reference = tmp_path / "source", tmp_path / "reference"
    for folder, steps in ((source, 2), (reference, 4)):
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, folder, *extra,
                                                 f"end_to_end.steps={steps}"))
        assert code == 0, err
    (source / "eval.json").write_text("{}")            # written into the folder later, by someone else
    before = snapshot(source)
    same = tmp_path / "same"           # no --recipe: the source's recipe.toml, here with more steps
    code, printed, err = run(capsys, "distill", "--continue-from", str(source), "--set", "end_to_end.steps=4",
                             "--out", str(same), "--device", "cpu")
    assert code == 0 and f"a copy of {source}; its end-to-end phase goes on from step 2 to 4" in printed, err
    assert not (same / "eval.json").exists()
    log, ref_log = (json.loads((f / "log.json").read_text()) for f in (same, reference))
    assert log["end_to_end"]["losses"] == ref_log["end_to_end"]["losses"]
    assert_identical(features(same), features(reference))

    more = tmp_path / "more.jsonl"      # many documents: the pool's shuffle puts some in the first blocks
    more.write_text("".join(json.dumps({"text": f"Other words entirely, number {i}, in another order."}) + "\n"
                            for i in range(300)))
    pooled = tmp_path / "pooled"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], f"{corpus}+{more}", pooled, *extra,
                                             "end_to_end.steps=4", "--eval-data", corpus, "--continue-from", source))
    assert code == 0, err
    log = json.loads((pooled / "log.json").read_text())
    assert log["end_to_end"]["losses"][:2] == ref_log["end_to_end"]["losses"][:2]      # the copied steps
    assert log["end_to_end"]["losses"][2:] != ref_log["end_to_end"]["losses"][2:]      # new text from step 3 on
    assert log["evaluation"]["teacher_ppl"] == ref_log["evaluation"]["teacher_ppl"]   # the same validation text
    assert snapshot(source) == before

    bad = [(("layerwise.lr=0.05",), "was run with other layerwise.lr"),
           (("student.conv=4", "student.decay=gate"), "was run with other student.conv, student.decay"),
           (("--data", f"{corpus}+{more}"), f"give --eval-data {corpus}"),
           (("end_to_end.steps=1",), "end_to_end.steps = 1 is fewer than the 2 end-to-end steps"),
           (("--continue-from", tmp_path), "is not a finished (or time-limited) dofattn distill run folder")]
    for flags, message in bad:
        out = tmp_path / "refused"
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "end_to_end.steps=4",
                                                 "--continue-from", source, *flags))
        assert code == 2 and message in err and err.count("\n") == 1, (flags, err)
        assert not out.exists()
