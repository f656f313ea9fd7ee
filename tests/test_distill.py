"""`dofattn distill` on tiny models: layerwise and direct training lower their losses, a killed run resumes to
bit-identical weights, two gloo processes train the same layers as one, bad input is a one-line error that leaves
no run folder, and the run folder is a loadable student.

Everything runs with one torch thread: the models are tiny, and two threads on a busy 2-core machine spin against
each other (a direct step goes from 10 ms to 1 s). Subprocesses get OMP_NUM_THREADS=1 for the same reason, and
so that they compute with the same thread count as the in-process reference runs (bit-identical results).
"""

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
from dofattn.distill import LAYER_LOSSES, TeacherCache, direct_loss, layer_file
from dofattn.dof import DofResult, LayerDof
from dofattn.evaluate import perplexity, teacher_mode
from dofattn.hf import load_model
from dofattn.student import attention_modules, head_layout, is_student_tensor, linearize, load_student
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


def distill_argv(model, data, out, *extra) -> list[str]:
    """A small, fast `dofattn distill` command line; `extra` overrides the defaults (argparse keeps the last)."""
    return ["distill", "--model", str(model), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--seq-len", "32", "--train-blocks", "8", "--batch-size", "2", "--direct-batch-size", "2",
            "--eval-blocks", "2", "--eval-seq-len", "32", "--dims", "fix:8", "--then-direct-steps", "0",
            "--recipe", "paper", *map(str, extra)]


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
    ("trained-llama", "prf", "output", 0), ("trained-llama", "prf", "softmax+output", 8),
    ("trained-llama", "hedgehog", "softmax", "decay"), ("trained-llama", "prf", "l2", "decay"),
    ("trained-llama", "prf", "softmax", "8+decay"), ("trained-llama", "prf", "l2", "8+decay"),
    ("trained-llama", "prf", "softmax", "8+sink"), ("trained-llama", "prf", "l2", "8+sink"),
    ("trained-llama", "hedgehog", "softmax", "gate"), ("trained-llama", "prf", "l2", "gate"),
])
def test_layerwise_training_lowers_every_layers_loss(capsys, teachers, corpus, tmp_path, teacher, feature, loss,
                                                     window):
    out = tmp_path / "run"
    decay = "decay" in str(window)     # a learned decay, in pure linear attention or beside an 8-token window
    gate = window == "gate"            # or a decay per token (pure linear attention)
    sink = 2 if "sink" in str(window) else 0   # or the first 2 tokens exact beside an 8-token window
    window = 8 if window in ("8+decay", "8+sink") else 0 if decay or gate else window
    code, _, err = run(capsys, *distill_argv(teachers[teacher], corpus, out, "--feature", feature, "--loss", loss,
                                             "--steps", 150, "--window", window, *(["--decay"] if decay else []),
                                             *(["--gate"] if gate else []), "--sink", sink))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    assert sorted(log["layers"]) == [str(i) for i in range(LAYERS)] and log["direct"] == {}

    # the logged loss on the fixed batch (the first `batch_size` blocks) against the untrained features' loss on it
    assert not (out / "teacher").exists()  # a finished run deletes its teacher activations
    from dofattn.data import token_blocks

    model, tok = load_model(str(teachers[teacher]))
    linearize(model, [8] * LAYERS, feature, seed=0, window=window, decay=decay, sink=sink, gate=gate)   # the start
    heads = head_layout(model)
    blocks = token_blocks(str(corpus), tok, 32, 8, split="train", seed=0)  # the run's training blocks
    cache = TeacherCache(tmp_path / "teacher", LAYERS, (8, 32), heads)
    cache.build(model, blocks, batch_size=2, progress=False)
    for layer, module in enumerate(attention_modules(model)):
        entry = log["layers"][str(layer)]
        q, k, v = cache.layer(layer)
        # kv heads -> query heads, as train_layer does
        k, v = (x.repeat_interleave(heads[0] // heads[1], dim=2) for x in (k, v))
        with torch.no_grad():
            before = LAYER_LOSSES[loss](module.dofattn.eval(), q[:2], k[:2], v[:2], module.scaling).item()
        assert entry["steps"] == 150
        assert entry["fixed_batch_loss"] < 0.7 * before, (layer, entry, before)
        # a window hybrid with a scale-free map starts from a calibrated gain: a better first loss, a smaller drop
        drop = 0.8 if window and feature != "prf" else 0.7
        assert entry["last_loss"] < drop * entry["first_loss"], (layer, entry)


# --- direct training -----------------------------------------------------------------------------------------------

def test_direct_training_lowers_the_lm_loss(capsys, trained_llama, corpus, tmp_path, tokenizer):
    from dofattn.data import token_blocks

    out = tmp_path / "run"
    argv = distill_argv(trained_llama, corpus, out, "--loss", "direct", "--steps", 40, "--direct-batch-size", 4,
                        "--direct-lr", 1e-2, "--eval-blocks", 4)
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    assert log["layers"] == {} and len(log["direct"]["losses"]) == 40

    untrained, _ = load_model(str(trained_llama))
    linearize(untrained, [8] * LAYERS, "prf", seed=0)  # the run's starting point
    trained, _, _ = load_student(out)
    train = token_blocks(str(corpus), tokenizer, 32, 8, split="train", seed=0)  # the run's training blocks
    valid = token_blocks(str(corpus), tokenizer, 32, 4, split="validation", seed=0)
    with torch.no_grad():
        before, after = (direct_loss(m, train, kd_weight=1.0).item() for m in (untrained, trained))
    assert after < 0.8 * before, (before, after)  # the objective it trained on, on its own blocks
    ppl_before, ppl_after = (perplexity(m, valid, progress=False) for m in (untrained, trained))
    teacher_ppl = log["evaluation"]["teacher_ppl"]
    # held-out text: the student's excess cross-entropy over its teacher shrinks by a clear margin
    excess_before, excess_after = (math.log(p / teacher_ppl) for p in (ppl_before, ppl_after))
    assert excess_after < 0.8 * excess_before, (teacher_ppl, ppl_before, ppl_after)
    assert log["evaluation"]["student_ppl"] == ppl_after  # the saved student is the trained one, bit for bit


def test_conv_stays_the_identity_layerwise_and_trains_end_to_end(capsys, model_dirs, corpus, tmp_path):
    """The layerwise losses compare the teacher's own q and k, so the filters keep their start there; the end-to-end
    phase moves them, and the saved student carries them."""
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--conv", "3", "--steps", "3",
                                             "--then-direct-steps", "4", "--direct-lr", "1e-2", "--gate"))
    assert code == 0, err
    identity = torch.zeros(3, 1, 1)
    identity[0] = 1
    layer = load_file(str(layer_file(out, 1)))
    assert torch.equal(layer["conv_k"], identity.expand_as(layer["conv_k"]))
    config = json.loads((out / "dofattn.json").read_text())
    assert config["conv"] == 3 and json.loads((out / "log.json").read_text())["args"]["conv"] == 3
    saved = features(out)
    for i in range(LAYERS):
        for name in ("conv_q", "conv_k", "conv_v"):
            weight = saved[f"model.layers.{i}.self_attn.dofattn.{name}"]
            assert weight.shape[0] == 3 and (weight - identity).abs().max() > 1e-3, (i, name)
    student, _, _ = load_student(out)
    assert attention_modules(student)[0].dofattn.conv == 3


def test_conv_lr_gives_the_filters_a_learning_rate_of_their_own(capsys, model_dirs, corpus, tmp_path):
    """One end-to-end step from the same start: Adam's first step moves each weight by about its learning rate, so
    the filters move about --conv-lr while everything else moves exactly as with the filters at --direct-lr."""
    runs = {}
    for name, more in (("plain", ()), ("same", ("--conv-lr", "1e-3")), ("fast", ("--conv-lr", "0.1"))):
        runs[name] = tmp_path / name
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, runs[name], "--conv", "3", "--steps",
                                                 "2", "--then-direct-steps", "1", "--direct-lr", "1e-3", *more))
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
    assert json.loads((runs["fast"] / "log.json").read_text())["args"]["conv_lr"] == 0.1


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
    # gpt2 has dropout: the direct phase's masks must not depend on where the run was resumed
    extra = ("--steps", 150, "--then-direct-steps", 30, "--checkpoint-every", 3)
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
    assert not layer_file(out, LAYERS - 1).is_file() and not (out / "direct").exists()
    # 2. resumed, killed again during direct training, after a checkpoint
    state = out / "direct" / "state.json"
    code = kill_when(cmd, state.is_file, log_file)
    assert code == -signal.SIGKILL, f"not killed in direct training (exit {code}): {log_file.read_text()[-2000:]}"
    assert 0 < json.loads(state.read_text())["step"] < 30 and not (out / "log.json").exists()
    # 3. resumed to the end (in this process: the same command, one subprocess start less)
    code, _, err = run(capsys, *argv)
    assert code == 0, err

    assert_identical(features(out), features(reference))
    log, ref_log = (json.loads((f / "log.json").read_text()) for f in (out, reference))
    assert log["direct"]["losses"] == ref_log["direct"]["losses"]
    for layer in range(LAYERS):
        assert_identical(load_file(str(layer_file(out, layer))), load_file(str(layer_file(reference, layer))))
        for key in ("first_loss", "last_loss", "fixed_batch_loss"):
            assert log["layers"][str(layer)][key] == ref_log["layers"][str(layer)][key]


# --- two processes ------------------------------------------------------------------------------------------------

def test_two_gloo_processes_match_one(capsys, model_dirs, corpus, tmp_path):
    """Layerwise: rank 0 trains layers 0 and 2, rank 1 layer 1, bit-identical to one process. Then 3 direct steps
    with gradients all-reduced (a different batch split than one process, so only checked for sanity)."""
    one, two = tmp_path / "one", tmp_path / "two"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, one, "--steps", 40))
    assert code == 0, err
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dofattn",
           *distill_argv(model_dirs["llama"], corpus, two, "--steps", 40, "--then-direct-steps", 3,
                         "--checkpoint-every", 2)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    log_one, log_two = (json.loads((f / "log.json").read_text()) for f in (one, two))
    for layer in range(LAYERS):
        assert_identical(load_file(str(layer_file(two, layer))), load_file(str(layer_file(one, layer))))
        for key in ("first_loss", "last_loss", "fixed_batch_loss"):
            assert log_two["layers"][str(layer)][key] == log_one["layers"][str(layer)][key]

    assert len(log_two["direct"]["losses"]) == 3 and torch.isfinite(torch.tensor(log_two["direct"]["losses"])).all()
    layerwise, final = features(one), features(two)
    assert sorted(final) == sorted(layerwise)
    for name, tensor in final.items():
        assert torch.isfinite(tensor).all(), name
        if "key_shift" in name:  # each rank's running max over its own batches
            continue
        # rank 0 started direct training from every layer's layerwise result (rank 1's layer 1 included) and
        # 3 Adam steps of lr 2e-3 moved it by about 3 x lr at most
        moved = (tensor - layerwise[name]).abs().max().item()
        assert 0 < moved < 4 * 3 * 2e-3, (name, moved)


# --- bad input ---------------------------------------------------------------------------------------------------

def other_model_dims(folder: Path) -> Path:
    path = folder / "other-dof.json"
    layers = [LayerDof(layer=i, dof=10.0, head_dof=[10.0] * 4, dim=8, head_dims=[8] * 4) for i in range(LAYERS)]
    path.write_text(DofResult(model="other", samples=64, budget=8, head_dim=16, layers=layers).to_json())
    return path


@pytest.mark.parametrize("args,message", [
    (["--loss", "kl"], "unknown --loss 'kl'"),
    (["--feature", "cosine"], "unknown feature map 'cosine'"),
    (["--loss", "l2", "--feature", "hedgehog"], "--loss l2 compares kernel values"),
    (["--dims", "{other_dims}"], "was computed for model 'other'"),
    (["--dims", "fix:0"], "bad --dims"),
    (["--cooldown-steps", "-1"], "--cooldown-steps must be >= 0"),
    (["--hidden-weight", "-1"], "--hidden-weight must be >= 0"),
    (["--hidden-weight", "nan"], "--hidden-weight must be >= 0"),
    (["--lm-weight", "-0.5"], "--lm-weight must be >= 0"),
    (["--lm-weight", "0", "--kd-weight", "0"], "nothing to learn from"),
    (["--then-direct-steps", "2", "--cooldown-steps", "3"], "longer than the end-to-end phase"),
    (["--dims", "{tmp}/missing.json"], "does not exist"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--window", "-1"], "--window must be >= 0"),
    (["--window", "8", "--sink", "-1"], "--sink must be >= 0"),
    (["--sink", "4"], "give --window W >= 1 too"),
    (["--window", "8", "--sink", "4", "--decay"], "--sink and --decay do not combine"),
    (["--window", "8", "--gate"], "--gate is for pure linear attention: add --window 0"),
    (["--window", "8", "--delta"], "--delta is for pure linear attention: add --window 0"),
    (["--conv", "1"], "--conv is a filter width of at least 2 tokens"),
    (["--conv", "-4"], "--conv is a filter width of at least 2 tokens"),
    (["--conv-lr", "0.1"], "--conv-lr is the learning rate of the --conv filters: give --conv K"),
    (["--conv", "4", "--conv-lr", "0"], "--conv-lr must be a learning rate > 0"),
    (["--delta-lr", "0.1"], "--delta-lr is the learning rate of the --delta rule's parameters: give --delta"),
    (["--window", "0", "--delta", "--delta-lr", "-1"], "--delta-lr must be a learning rate > 0"),
    (["--time-limit", "-1"], "--time-limit must be >= 0 minutes"),
    (["--dof-repeats", "0"], "--dof-repeats must be between 1 and 8"),
    (["--direct-seq-len", "1"], "--direct-seq-len must be at least 2"),
    (["--loss", "direct", "--direct-blocks", "100000"], "100000 blocks of 32 tokens were asked for"),
    (["--lam-auto"], "--lam-auto chooses the λ of a DoF estimate made here"),
    (["--direct-blocks", "0"], "--direct-blocks must be at least 1"),
    (["--loss", "direct", "--tokens", "40"], "less than one step's batch (64 tokens)"),
    (["--keep-softmax", "3"], "--keep-softmax 3 leaves no layer to linearize"),
    (["--keep-softmax", "-1"], "--keep-softmax must be >= 0"),
    (["--keep-softmax", "1", "--keep-by", "gain", "--loss", "direct"], "--keep-by gain measures the layers"),
    (["--keep-softmax", "1", "--keep-by", "gain", "--progressive"], "--keep-by gain measures the layers"),
    (["--loss", "l2", "--window", "32"], "needs --seq-len > 32"),
    (["--data", "{tmp}/missing.txt"], "neither 'wiki-sample'"),
    (["--model", "{tmp}/no-such-model"], "does not exist"),
])
def test_bad_input_is_one_line_error(capsys, model_dirs, corpus, tmp_path, args, message):
    other_dims = other_model_dims(tmp_path)
    out = tmp_path / "run"
    argv = distill_argv(model_dirs["llama"], corpus, out, *[a.format(tmp=tmp_path, other_dims=other_dims)
                                                             for a in args])
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert not out.exists(), "a rejected command left a run folder behind"


def test_run_folder_with_other_arguments_is_refused_and_untouched(capsys, model_dirs, corpus, tmp_path):
    out = tmp_path / "run"
    argv = distill_argv(model_dirs["gpt_neox"], corpus, out, "--steps", 5, "--then-direct-steps", 2)
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    before = snapshot(out)
    code, _, err = run(capsys, *argv, "--steps", "6")
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
    assert len(lines) == 1 and "other arguments (steps)" in lines[0], err
    assert snapshot(out) == before
    # the same arguments again: a finished run resumes to the same student
    reference = features(out)
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert_identical(features(out), reference)
    # a folder written before --window existed resumes as a window-0 run, and only as one
    record = json.loads((out / "run.json").read_text())
    del record["window"]
    (out / "run.json").write_text(json.dumps(record))
    assert run(capsys, *argv)[0] == 0
    assert run(capsys, *argv, "--window", "4")[0] == 2
    # --keep-by chooses nothing without softmax layers: a folder from when its default was dof still resumes
    record = json.loads((out / "run.json").read_text())
    assert record["keep_softmax"] == 0 and record["keep_by"] == "attn-dof"
    (out / "run.json").write_text(json.dumps({**record, "keep_by": "dof"}))
    assert run(capsys, *argv)[0] == 0
    (out / "run.json").write_text(json.dumps({**record, "keep_by": "dof", "keep_softmax": 1}))
    code, _, err = run(capsys, *argv, "--keep-softmax", "1")       # beside softmax layers it is the choice
    assert code == 2 and "other arguments (keep_by)" in err, err
    (out / "run.json").write_text(json.dumps(record))
    # a decay run records where its decay started; one from before that (another start) is refused
    record = json.loads((out / "run.json").read_text())
    assert record["decay_start"] is None
    (out / "run.json").write_text(json.dumps({**record, "decay": True}))
    code, _, err = run(capsys, *argv, "--decay", "--window", "0")
    assert code == 2 and "other arguments (decay_start)" in err, err


def test_out_folder_that_is_not_a_run_is_refused(capsys, model_dirs, corpus, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out)
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--steps", 5))
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dofattn: error:")]
    assert len(lines) == 1 and "is not a dofattn run folder" in lines[0], err
    assert snapshot(out) == before


# --- the run folder as a student -----------------------------------------------------------------------------------

def test_run_folder_is_a_loadable_student(capsys, model_dirs, corpus, tmp_path, tokenizer):
    from dofattn.data import token_blocks

    out = tmp_path / "run"
    code, out_text, err = run(capsys, *distill_argv(model_dirs["gpt2"], corpus, out, "--dims", "dof", "--steps", 10,
                                                    "--then-direct-steps", 2))
    assert code == 0, err
    assert "validation perplexity" in out_text and f"dofattn generate --model {out}" in out_text
    log = json.loads((out / "log.json").read_text())
    dof = DofResult.from_json((out / "dof.json").read_text())
    assert dof.model == str(model_dirs["gpt2"]) and log["dims"] == dof.dims and sum(dof.dims) == LAYERS * 16

    student, _, config = load_student(out)
    assert config.dims == dof.dims and config.feature == "prf" and config.layers == list(range(LAYERS))
    valid = token_blocks(str(corpus), tokenizer, 32, 2, split="validation", seed=0)
    assert perplexity(student, valid, progress=False) == log["evaluation"]["student_ppl"]  # the very same model

    code, text, err = run(capsys, "generate", "--model", str(out), "--max-new-tokens", "3", "--prompt", "The fox")
    assert code == 0, err
    assert text.startswith("The fox") and "student of" in err


@pytest.mark.parametrize("keep_by", ["dof", None, "first", "random", "gain"])
def test_keep_softmax_leaves_the_chosen_layers_exact(capsys, model_dirs, corpus, tmp_path, keep_by):
    """None: the default, attn-dof."""
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["gpt2"], corpus, out, "--steps", 3, "--keep-softmax", 2,
                                             *(["--keep-by", keep_by] if keep_by else [])))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    kept = log["softmax_layers"]
    assert len(kept) == 2 and sorted(log["layers"]) == [str(i) for i in range(LAYERS) if i not in kept]
    if keep_by == "first":
        assert kept == [0, 1]
    if keep_by == "dof":  # the two layers with the largest DoF in the run's own estimate
        dof = [layer["dof"] for layer in json.loads((out / "dof.json").read_text())["layers"]]
        assert sorted(kept) == sorted(sorted(range(LAYERS), key=lambda i: -dof[i])[:2])
        assert log["dims"] == [8] * LAYERS  # --dims fix:8 still gives the dims; the estimate only chooses layers
    if keep_by is None:  # the two layers whose teacher attention has the largest DoF, kept in the run
        record = json.loads((out / "attention_dof.json").read_text())
        assert len(record["layers"]) == LAYERS and record["blocks"] == 8 and not (out / "dof.json").exists()
        assert kept == sorted(sorted(range(LAYERS), key=lambda i: -record["layers"][i])[:2])
    if keep_by == "gain":  # the two largest measured gains, all layers measured after layerwise training
        gains = json.loads((out / "keep.json").read_text())["kl_gain"]
        assert len(gains) == LAYERS and all(isinstance(g, float) for g in gains)
        assert kept == sorted(sorted(range(LAYERS), key=lambda i: -gains[i])[:2])
    student, _, config = load_student(out)
    assert config.layers == [i for i in range(LAYERS) if i not in kept]
    modules = attention_modules(student)
    assert [hasattr(m, "dofattn") for m in modules] == [i not in kept for i in range(LAYERS)]


def test_direct_phase_curve_of_perplexity_against_tokens(capsys, model_dirs, corpus, tmp_path):
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--loss", "direct", "--steps", 4,
                                             "--eval-every", 2, "--checkpoint-every", 3))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    curve = log["direct"]["curve"]
    assert [(c["step"], c["tokens"]) for c in curve] == [(2, 2 * 2 * 32), (4, 4 * 2 * 32)]
    # the last point is the finished student on the same validation blocks as the final evaluation
    assert math.isclose(curve[-1]["ppl"], log["evaluation"]["student_ppl"], rel_tol=1e-5)


def test_direct_phase_reads_its_own_blocks(capsys, model_dirs, corpus, tmp_path):
    """--direct-seq-len / --direct-blocks shape the end-to-end phase's text, not the layerwise stage's, and
    --tokens with --loss direct counts end-to-end tokens."""
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--steps", 2, "--then-direct-steps",
                                             3, "--direct-seq-len", 48, "--direct-blocks", 5, "--eval-every", 3))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    assert log["direct"]["curve"][-1]["tokens"] == 3 * 2 * 48
    assert all(layer["steps"] == 2 for layer in log["layers"].values())
    out = tmp_path / "direct"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--loss", "direct", "--tokens",
                                             500, "--direct-seq-len", 40, "--eval-every", 1))
    assert code == 0, err
    curve = json.loads((out / "log.json").read_text())["direct"]["curve"]
    assert [c["tokens"] for c in curve] == [80 * i for i in range(1, 8)]   # ceil(500 / (2 × 40)) = 7 steps


@pytest.mark.parametrize("keep", [(), ("--keep-softmax", 1, "--keep-by", "gain")])
def test_time_limit_stops_evaluates_and_the_same_command_goes_on(capsys, model_dirs, corpus, tmp_path, keep):
    """A tiny --time-limit stops the direct phase after its first step with a saved, evaluated student; the same
    command (any limit) goes on from the checkpoint, and the finished run equals one that never stopped (with
    --keep-by gain: the same layers kept, measured once)."""
    extra = ("--steps", 3, "--then-direct-steps", 4, "--checkpoint-every", 10, *keep)
    reference = tmp_path / "reference"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, reference, *extra))
    assert code == 0, err
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "--time-limit", 1e-9))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    assert (log["direct"]["steps"], log["direct"]["target_steps"], log["direct"]["stopped"]) == (1, 4, "time limit")
    assert (out / "features.safetensors").is_file() and log["evaluation"]["student_ppl"] > 0
    code, printed, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "--time-limit", 1e-9))
    assert code == 0 and "stopped at its time limit after 1 of 4 steps" in printed, err
    assert json.loads((out / "log.json").read_text())["direct"]["steps"] == 2
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra))
    assert code == 0, err
    log, ref_log = (json.loads((f / "log.json").read_text()) for f in (out, reference))
    assert log["direct"]["steps"] == 4 and "stopped" not in log["direct"]
    assert log["direct"]["losses"] == ref_log["direct"]["losses"]
    untimed = [{n: {k: v for k, v in layer.items() if k != "seconds"} for n, layer in x["layers"].items()}
               for x in (log, ref_log)]
    assert untimed[0] == untimed[1]                   # the layerwise results, not their wall time
    assert log["evaluation"]["layerwise_student_ppl"] == ref_log["evaluation"]["layerwise_student_ppl"]
    assert log["softmax_layers"] == ref_log["softmax_layers"] and len(log["softmax_layers"]) == len(keep) // 4
    assert_identical(features(out), features(reference))


@pytest.mark.parametrize("first,keep", [(2, ()), (0, ()), (0, ("--keep-softmax", 1, "--keep-by", "gain"))])
def test_more_end_to_end_steps_go_on_from_a_finished_run(capsys, model_dirs, corpus, tmp_path, first, keep):
    """A finished run asked again with more --then-direct-steps goes on from where it ended (its end-to-end
    checkpoint, or its saved layerwise student if it had no end-to-end phase, measured softmax layers kept) and
    equals the run made with that many steps at once; fewer steps than before are refused."""
    extra = ("--steps", 3, "--checkpoint-every", 10, *keep)
    reference = tmp_path / "reference"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, reference, *extra, "--then-direct-steps", 4))
    assert code == 0, err
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "--then-direct-steps", first))
    assert code == 0, err
    code, printed, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "--then-direct-steps", 4))
    assert code == 0 and f"is asked for more after {first} of 4 steps; going on" in printed, err
    log, ref_log = (json.loads((f / "log.json").read_text()) for f in (out, reference))
    assert log["direct"]["steps"] == 4 and log["direct"]["losses"] == ref_log["direct"]["losses"]
    assert log["evaluation"]["layerwise_student_ppl"] == pytest.approx(ref_log["evaluation"]["layerwise_student_ppl"])
    assert json.loads((out / "run.json").read_text())["then_direct_steps"] == 4
    assert_identical(features(out), features(reference))
    before = snapshot(out)
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "--then-direct-steps", 3))
    assert code != 0 and "--then-direct-steps can only grow" in err
    assert snapshot(out) == before


def test_cooldown_lowers_the_learning_rate_at_the_end_and_resumes_exactly(capsys, model_dirs, corpus, tmp_path):
    from dofattn.distill import cooldown_lr

    assert [cooldown_lr(0.1, step, 5, 2) for step in range(5)] == [0.1, 0.1, 0.1, 0.1, 0.05]
    assert [cooldown_lr(0.1, step, 3, 0) for step in range(3)] == [0.1] * 3
    extra = ("--steps", 3, "--checkpoint-every", 10, "--then-direct-steps", 4)
    constant, cooled, resumed = tmp_path / "constant", tmp_path / "cooled", tmp_path / "resumed"
    for folder, more in ((constant, ()), (cooled, ("--cooldown-steps", 3)),
                         (resumed, ("--cooldown-steps", 3, "--time-limit", 1e-9)), (resumed, ("--cooldown-steps", 3))):
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, folder, *extra, *more))
        assert code == 0, err
    logs = [json.loads((f / "log.json").read_text())["direct"]["losses"] for f in (constant, cooled, resumed)]
    assert logs[0][:2] == logs[1][:2] and logs[0][2:] != logs[1][2:]   # the first two steps are at the full rate
    assert logs[1] == logs[2]
    assert_identical(features(resumed), features(cooled))


def test_continue_from_copies_a_run_and_goes_on_with_more_text(capsys, model_dirs, corpus, tmp_path):
    """--continue-from on the same text equals the longer run made at once; on pooled text (--data A+B, scored on
    --eval-data A) it trains on the pool, scores the same validation blocks, and leaves the source run untouched.
    Changes that would make another student are refused before anything is copied."""
    extra = ("--steps", 3, "--checkpoint-every", 10)
    source, reference = tmp_path / "source", tmp_path / "reference"
    for folder, steps in ((source, 2), (reference, 4)):
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, folder, *extra,
                                                 "--then-direct-steps", steps))
        assert code == 0, err
    (source / "eval.json").write_text("{}")            # written into the folder later, by someone else
    before = snapshot(source)
    same = tmp_path / "same"
    code, printed, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, same, *extra, "--then-direct-steps",
                                                   4, "--continue-from", source))
    assert code == 0 and f"a copy of {source}; its end-to-end phase goes on from step 2 to 4" in printed, err
    assert not (same / "eval.json").exists()
    log, ref_log = (json.loads((f / "log.json").read_text()) for f in (same, reference))
    assert log["direct"]["losses"] == ref_log["direct"]["losses"]
    assert_identical(features(same), features(reference))
    assert json.loads((same / "run.json").read_text())["continue_from"] == str(source)

    teacher_only = tmp_path / "teacher-only"     # the end-to-end loss may change: here to the teacher's logits alone
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, teacher_only, *extra,
                                             "--then-direct-steps", 4, "--lm-weight", 0, "--continue-from", source))
    assert code == 0, err
    log = json.loads((teacher_only / "log.json").read_text())
    assert log["args"]["lm_weight"] == 0 and log["direct"]["losses"][:2] == ref_log["direct"]["losses"][:2]
    # from step 3 on the loss is the KL alone: below the reference's cross-entropy + KL
    assert all(a < b for a, b in zip(log["direct"]["losses"][2:], ref_log["direct"]["losses"][2:], strict=True))

    more = tmp_path / "more.jsonl"      # many documents: the pool's shuffle puts some in the first blocks
    more.write_text("".join(json.dumps({"text": f"Other words entirely, number {i}, in another order."}) + "\n"
                            for i in range(300)))
    pooled = tmp_path / "pooled"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], f"{corpus}+{more}", pooled, *extra,
                                             "--then-direct-steps", 4, "--eval-data", corpus,
                                             "--continue-from", source))
    assert code == 0, err
    log = json.loads((pooled / "log.json").read_text())
    assert log["direct"]["losses"][:2] == ref_log["direct"]["losses"][:2]      # the copied steps
    assert log["direct"]["losses"][2:] != ref_log["direct"]["losses"][2:]      # new text from step 3 on
    assert log["evaluation"]["teacher_ppl"] == ref_log["evaluation"]["teacher_ppl"]   # the same validation text
    assert snapshot(source) == before

    bad = [(("--lr", 0.05), "was run with other --lr"),
           (("--data", f"{corpus}+{more}"), f"give --eval-data {corpus}"),
           (("--then-direct-steps", 1), "--then-direct-steps 1 is fewer than the 2 end-to-end steps"),
           (("--continue-from", tmp_path), "is not a finished (or time-limited) dofattn distill run folder")]
    for flags, message in bad:
        out = tmp_path / "refused"
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, *extra, "--then-direct-steps", 4,
                                                 "--continue-from", source, *flags))
        assert code == 2 and message in err and err.count("\n") == 1, (flags, err)
        assert not out.exists()


def test_delta_trains_end_to_end_and_continue_from_can_add_it(capsys, model_dirs, corpus, tmp_path):
    """--delta: the layerwise stage leaves the erase strengths at their start (its losses score the kernel's rows),
    the end-to-end phase moves them, and the student saves and loads with them. --continue-from may add --delta to
    a trained student: the copied features go on, the delta rule starts at its start values."""
    from dofattn.attention import DELTA_START

    extra = ("--steps", 3, "--gate", "--direct-lr", 1e-2)
    plain, delta, added = tmp_path / "plain", tmp_path / "delta", tmp_path / "added"
    for folder, flags in ((plain, ()), (delta, ("--delta",))):
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, folder, *extra, *flags,
                                                 "--then-direct-steps", 2))
        assert code == 0, err
    layer = load_file(str(layer_file(delta, 1)))                         # layerwise: the delta rule as it started
    assert torch.equal(layer["delta_bias"], torch.full_like(layer["delta_bias"], DELTA_START))
    assert torch.equal(layer["delta_weight"], torch.zeros_like(layer["delta_weight"]))
    saved = features(delta)
    for i in range(LAYERS):
        bias = saved[f"model.layers.{i}.self_attn.dofattn.delta_bias"]
        assert (bias - DELTA_START).abs().max() > 1e-3, i
    assert json.loads((delta / "dofattn.json").read_text())["delta"]
    student, _, _ = load_student(delta)
    assert all(m.dofattn.delta for m in attention_modules(student))
    assert not json.loads((plain / "dofattn.json").read_text())["delta"]

    code, printed, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, added, *extra, "--delta",
                                                   "--delta-lr", 0.5, "--then-direct-steps", 4, "--continue-from",
                                                   plain))
    assert code == 0 and "delta-rule tensors not in the checkpoint start from their start values" in printed, err
    log, source_log = (json.loads((f / "log.json").read_text()) for f in (added, plain))
    assert log["direct"]["losses"][:2] == source_log["direct"]["losses"] and len(log["direct"]["losses"]) == 4
    assert log["args"]["delta"] and json.loads((added / "dofattn.json").read_text())["delta"]
    # two Adam steps at --delta-lr 0.5 move the biases about 1, against about 0.02 at --direct-lr 1e-2
    fast = [features(added)[f"model.layers.{i}.self_attn.dofattn.delta_bias"] for i in range(LAYERS)]
    assert all((b - DELTA_START).abs().max() > 0.5 for b in fast), fast


def test_progressive_layers_train_on_the_students_own_inputs(capsys, trained_llama, corpus, tmp_path, tokenizer):
    from dofattn.data import token_blocks
    from dofattn.distill import student_activations

    model, tok = load_model(str(trained_llama))
    blocks = token_blocks(str(corpus), tok, 32, 4, split="train", seed=0)
    teacher = TeacherCache(tmp_path / "teacher", LAYERS, (4, 32), head_layout(model))
    teacher.build(model, blocks, batch_size=2, progress=False)
    linearize(model, [8] * LAYERS, seed=0, layers=[0])
    first = student_activations(model, blocks, 0, batch_size=2, progress=False)
    second = student_activations(model, blocks, 1, batch_size=2, progress=False)
    for mine, theirs in zip(first, teacher.layer(0)):   # layer 0's inputs do not depend on any attention
        torch.testing.assert_close(mine, theirs)
    assert not torch.allclose(second[0], teacher.layer(1)[0], atol=1e-3)   # layer 1 sees a linear layer 0

    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(trained_llama, corpus, out, "--progressive", "--steps", 40))
    assert code == 0, err
    log = json.loads((out / "log.json").read_text())
    assert not (out / "teacher").exists() and sorted(log["layers"]) == ["0", "1", "2"]
    assert all(entry["last_loss"] < entry["first_loss"] for entry in log["layers"].values())
    code, _, err = run(capsys, *distill_argv(trained_llama, corpus, tmp_path / "r2", "--progressive", "--loss",
                                             "direct"))
    assert code == 2 and "--progressive is a layerwise mode" in err


def test_per_head_dims_from_the_dof_allocation(capsys, model_dirs, corpus, tmp_path):
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--steps", 3, "--dims", "dof",
                                             "--per-head"))
    assert code == 0, err
    dof = json.loads((out / "dof.json").read_text())
    student, _, config = load_student(out)
    assert config.head_dims == [layer["head_dims"] for layer in dof["layers"]]
    assert config.dims == [max(h) for h in config.head_dims]
    assert sum(map(sum, config.head_dims)) == 16 * 4 * LAYERS   # mean budget (the head size) over every head
    fmap = attention_modules(student)[0].dofattn.feature_map
    assert fmap.head_dims == config.head_dims[0]
    for extra, message in ((["--dims", "fix"], "--per-head takes its per-head dims"),
                           (["--feature", "hedgehog"], "--per-head needs --feature prf")):
        code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, tmp_path / "bad", "--dims", "dof",
                                                 "--per-head", *extra))
        assert code == 2 and message in err and not (tmp_path / "bad").exists()


def test_dims_from_the_attention_dof(capsys, model_dirs, corpus, tmp_path, monkeypatch):
    """--dims attn-dof: dims ∝ the teacher's attention DoF per layer, the same total as fix (head size per layer),
    the estimate kept in the run folder; the kernel's DoF is not estimated."""
    from dofattn import dof

    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--steps", 2, "--dims", "attn-dof"))
    assert code == 0, err
    record = json.loads((out / "attention_dof.json").read_text())
    assert load_student(out)[2].dims == dof.allocate(record["layers"], 16 * LAYERS)
    assert not (out / "dof.json").exists()
    # the tiny model's attention DoF is flat (dims 16 each); a skewed estimate gives skewed dims, same total
    monkeypatch.setattr(dof, "attention_dofs", lambda *a, **k: [[1.0] * 4, [2.0] * 4, [5.0] * 4])
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, tmp_path / "skewed", "--steps", 2,
                                             "--dims", "attn-dof"))
    assert code == 0, err
    assert load_student(tmp_path / "skewed")[2].dims == [6, 12, 30]
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, tmp_path / "bad", "--dims", "attn-dof",
                                             "--per-head"))
    assert code == 2 and "--per-head takes its per-head dims" in err and not (tmp_path / "bad").exists()


def test_dims_from_the_dof_of_the_linear_part(capsys, model_dirs, corpus, tmp_path, monkeypatch):
    """--dims linear-dof: dims ∝ the DoF of the attention beyond the window and the sink, measured with the run's
    --window and --sink and kept in linear_dof.json; it needs a window."""
    from dofattn import dof

    calls = []

    def fake(model, blocks, lam, progress=True, window=0, sink=0):
        calls.append((window, sink))
        return [[1.0] * 4, [2.0] * 4, [5.0] * 4]

    monkeypatch.setattr(dof, "attention_dofs", fake)
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--steps", 2, "--dims", "linear-dof",
                                             "--window", 8, "--sink", 2))
    assert code == 0, err
    assert calls == [(8, 2)] and load_student(out)[2].dims == [6, 12, 30]
    record = json.loads((out / "linear_dof.json").read_text())
    assert (record["window"], record["sink"], record["layers"]) == (8, 2, [1.0, 2.0, 5.0])
    assert not (out / "attention_dof.json").exists() and not (out / "dof.json").exists()
    code, _, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, tmp_path / "bad", "--dims", "linear-dof"))
    assert code == 2 and "--dims linear-dof counts the attention beyond a softmax window" in err
    assert not (tmp_path / "bad").exists()


def test_lam_auto_chooses_and_records_the_dof_lambda(capsys, model_dirs, corpus, tmp_path):
    from dofattn.dof import LAM_GRID

    out = tmp_path / "run"
    code, printed, err = run(capsys, *distill_argv(model_dirs["llama"], corpus, out, "--steps", 2, "--dims", "dof",
                                                   "--lam-auto"))
    assert code == 0, err
    dof = json.loads((out / "dof.json").read_text())
    assert dof["lam"] in LAM_GRID and f"--lam-auto chose λ = 2^{math.log2(dof['lam']):.0f}" in printed
    errors = {row["lam"]: row["attention_error"] for row in dof["lam_search"]}
    assert set(errors) == {*LAM_GRID, None}                            # every λ tried, and uniform dims
    assert errors[dof["lam"]] == min(v for lam, v in errors.items() if lam is not None)
    assert load_student(out)[2].dims == [layer["dim"] for layer in dof["layers"]]


@pytest.mark.parametrize("extra,window,direct,lora,sink", [
    ([], 64, (32, 1), 0, 4),
    (["--recipe", "dofattn"], 64, (32, 1), 0, 4),
    (["--recipe", "paper"], 0, (None, 2), 0, 0),
    (["--recipe", "dofattn", "--window", "8", "--direct-seq-len", "24", "--direct-batch-size", "3"], 8, (24, 3), 0,
     4),
    (["--recipe", "dofattn", "--window", "0"], 0, (32, 1), 0, 0),
    (["--recipe", "dofattn", "--decay"], 64, (32, 1), 0, 0),
    (["--recipe", "dofattn", "--sink", "2"], 64, (32, 1), 0, 2),
    (["--recipe", "paper", "--direct-seq-len", "48"], 0, (48, 2), 0, 0),
    (["--recipe", "long", "--then-direct-steps", "1", "--direct-blocks", "4"], 64, (32, 2), 8, 4),
])
def test_recipe_sets_what_is_not_given(capsys, model_dirs, corpus, tmp_path, extra, window, direct, lora, sink):
    """--recipe fills the window, the sink (beside a window without a decay), the end-to-end phase's block length
    (dofattn and long: the evaluation length, 32 here) and batch, and the LoRA rank; options given on the command
    line win."""
    out = tmp_path / "run"
    argv = distill_argv(model_dirs["gpt2"], corpus, out, "--steps", 2)
    for option in ("--recipe", "--direct-batch-size"):
        at = argv.index(option)
        del argv[at:at + 2]
    if lora:
        pytest.importorskip("peft")
    code, _, err = run(capsys, *argv, *extra)
    assert code == 0, err
    recorded = json.loads((out / "run.json").read_text())
    assert (recorded["window"], (recorded["direct_seq_len"], recorded["direct_batch_size"])) == (window, direct)
    assert recorded["lora_rank"] == lora and recorded["sink"] == sink
    assert load_student(out)[2].window == window and load_student(out)[2].sink == sink
    assert load_student(out)[2].lora_rank == lora


def test_recipe_long_is_the_long_lora_run():
    """--recipe long resolves to the long LoRA configuration with the 4-token sink (docs/RESULTS.md: 1.047x without
    the sink after 400 steps; 1.042x with it after 40)."""
    from dofattn.cli import DistillArgs
    from dofattn.distill import resolve_recipe

    args = DistillArgs(recipe="long")
    resolve_recipe(args)
    assert (args.window, args.sink, args.lora_rank, args.then_direct_steps, args.direct_batch_size,
            args.direct_seq_len, args.direct_blocks) == (64, 4, 8, 400, 2, args.eval_seq_len, 1200)
    for recipe in ("dofattn", "paper"):
        args = DistillArgs(recipe=recipe)
        resolve_recipe(args)
        assert (args.lora_rank, args.then_direct_steps, args.direct_blocks) == (0, 30, None)


def test_lora_without_peft_fails_before_training(capsys, model_dirs, corpus, tmp_path, monkeypatch):
    """Without peft, a LoRA run stops at once with how to install it, and leaves no run folder."""
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)        # `import peft` raises ImportError
    out = tmp_path / "run"
    code, _, err = run(capsys, *distill_argv(model_dirs["gpt2"], corpus, out, "--lora-rank", 2,
                                             "--then-direct-steps", 1))
    assert code != 0 and "LoRA needs peft: pip install" in err
    assert not out.exists()


@pytest.mark.parametrize("kd_weight,lm_weight", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.0), (0.5, 2.0)])
def test_direct_loss_is_cross_entropy_plus_kl_to_the_teacher(kd_weight, lm_weight):
    """The end-to-end objective written out: lm_weight × the mean next-token cross-entropy of the student, plus
    kd_weight × the mean over positions of Σ_v p_teacher (log p_teacher − log p_student), the teacher being the
    model before linearizing."""
    teacher, student = tiny_model("llama"), tiny_model("llama")
    for model in (teacher, student):  # attention that matters and sharp logits: the two differ by a clear KL
        with torch.no_grad():
            model.model.norm.weight.mul_(30)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(20)
    linearize(student, [8] * LAYERS, "prf", seed=0)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        log_s = torch.log_softmax(student(input_ids=ids).logits[:, :-1].double(), -1)
        log_t = torch.log_softmax(teacher(input_ids=ids).logits[:, :-1].double(), -1)
        ce = -log_s.gather(-1, ids[:, 1:, None]).mean()
        kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean()
        reverse = (log_s.exp() * (log_s - log_t)).sum(-1).mean()
        assert kl > 0.01 and abs(kl - reverse) > 1e-4 * ce  # the KL term and its direction show above rel=1e-5
        got = direct_loss(student, ids, kd_weight, lm_weight=lm_weight).item()
    assert got == pytest.approx((lm_weight * ce + kd_weight * kl).item(), rel=1e-5)


def test_hidden_weight_adds_the_residual_streams_relative_error_layer_by_layer():
    """--hidden-weight written out: after every layer (and the final norm, where the model reports it), each token's
    |h_student − h_teacher|² / |h_teacher|², averaged over tokens, then over layers; the embeddings are left out
    (they are the same in both). The teacher is the model before linearizing, as for the KL term."""
    teacher, student = tiny_model("llama"), tiny_model("llama")
    linearize(student, [8] * LAYERS, "prf", seed=0)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = student(input_ids=ids, output_hidden_states=True).hidden_states
        ht = teacher(input_ids=ids, output_hidden_states=True).hidden_states
        assert len(hs) == LAYERS + 1 and torch.equal(hs[0], ht[0])
        by_hand = sum(((s.double() - t.double()).norm(dim=-1) ** 2 / t.double().norm(dim=-1) ** 2).mean()
                      for s, t in zip(hs[1:], ht[1:])) / LAYERS
        assert by_hand > 1e-3                                   # the term shows above rel=1e-5
        base = direct_loss(student, ids, kd_weight=1.0).item()
        got = direct_loss(student, ids, kd_weight=1.0, hidden_weight=2.5).item()
    assert got - base == pytest.approx(2.5 * by_hand.item(), rel=1e-4)


def test_hidden_weight_trains_the_student_towards_the_teachers_streams():
    """Fifteen steps with the hidden term (weight 20, no KL) leave the student's streams closer to the teacher's than
    the same steps without it."""
    from dofattn.distill import hidden_error

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    errors = {}
    for weight in (0.0, 20.0):
        student = tiny_model("llama")
        linearize(student, [8] * LAYERS, "hedgehog", seed=0)
        for name, p in student.named_parameters():
            p.requires_grad_(is_student_tensor(name))
        opt = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(15):
            opt.zero_grad()
            direct_loss(student, ids, kd_weight=0.0, hidden_weight=weight).backward()
            opt.step()
        with torch.no_grad():
            hs = student(input_ids=ids, output_hidden_states=True).hidden_states
            with teacher_mode(student):
                ht = student(input_ids=ids, output_hidden_states=True).hidden_states
            errors[weight] = hidden_error(hs[1:], ht[1:]).item()
    assert errors[20.0] < 0.8 * errors[0.0]


def test_inert_options_are_those_that_change_nothing():
    from dofattn.distill import inert_options

    assert inert_options({"keep_softmax": 0, "window": 64}) == {"keep_by"}
    assert inert_options({"keep_softmax": 3, "window": 64}) == set()
    assert inert_options({"keep_softmax": 3, "window": 0}) == {"sink"}      # no sink without a window
    assert inert_options({}) == {"keep_by", "sink"}                         # a record from before either option
