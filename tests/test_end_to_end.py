"""The end-to-end phase: its chunked loss against the whole block's logits, activation checkpointing, and two
processes against one on the combined batch.

Each end-to-end step draws `batch_size × processes` blocks from (seed, step); rank r trains on every other one from
the r-th, and the gradients are averaged. So one plain SGD step of two gloo processes must move every student tensor
exactly as one process does on all the step's blocks (up to float rounding): a missing all-reduce leaves each rank
with half the batch's gradient, a sum without the division doubles the step. Adam would hide both (its step does
not scale with the gradient), hence SGD here.
"""

import contextlib
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
import torch.nn.functional as F
from safetensors.torch import load_file

from dofattn.spec import Attention
from dofattn.distill.end_to_end import layers_checkpointed, loss, trainable
from dofattn.model.hf import decoder_layers
from dofattn.evaluate import head, hidden_states, teacher_mode
from dofattn.model.lora import add_lora
from dofattn.model.student import attention_modules, is_student_tensor, linearize
from tests.conftest import tiny_model
from tests.test_families import FAMILIES, tiny

SCRIPT = r"""
import sys
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from dofattn.distill.end_to_end import train
from dofattn.distill.world import join, world
from dofattn.model.hf import load_model
from dofattn.model.lora import add_lora
from dofattn.recipe import EndToEnd
from dofattn.model.student import is_student_tensor, linearize
from dofattn.spec import Attention

model_dir, out, batch_size = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
join("cpu")


def student(feature, lora=False, dtype=torch.float32, layers=None):
    torch.manual_seed(0)
    model, _ = load_model(model_dir, dtype=dtype)
    linearize(model, [8, 8, 8], Attention(feature=feature, window=4, sink=1), layers=layers, seed=0)
    if lora:
        add_lora(model, 2, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(is_student_tensor(name))
    return model


blocks = torch.randint(0, 300, (6, 24), generator=torch.Generator().manual_seed(1))
# 1. two plain SGD steps, the loss in chunks of 7 positions, each layer checkpointed; layer 1 keeps softmax
# attention, so its FSDP unit has nothing to train
model = student("hedgehog", layers=[0, 2])
if world()[0] == 0:
    save_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters() if is_student_tensor(n)},
              str(out / "start.safetensors"))
config = EndToEnd(steps=2, batch_size=batch_size, seq_len=24, lr=0.5, checkpoint_every=10, loss_chunk=7,
                  activation_checkpointing=True)
train(model, blocks, out / "sgd", config, seed=0, eval_blocks=blocks[:1], progress=False,
      optimizer_class=partial(torch.optim.SGD, lr=0.5))
# the same on a bfloat16 base model (its student tensors are float32)
train(student("hedgehog", dtype=torch.bfloat16, layers=[0, 2]), blocks, out / "sgd16", config, seed=0,
      eval_blocks=blocks[:1], progress=False, optimizer_class=partial(torch.optim.SGD, lr=0.5))
# 2. Adam on PRF features (their key shifts move) and LoRA: stopped after a step, then resumed in a new model
config = EndToEnd(steps=5, batch_size=batch_size, seq_len=24, lr=0.01, checkpoint_every=2, loss_chunk=7,
                  eval_every=2)
train(student("prf", lora=True), blocks, out / "whole", config, seed=0, eval_blocks=blocks[:1], progress=False)
stopped = train(student("prf", lora=True), blocks, out / "resumed", config, seed=0, eval_blocks=blocks[:1],
                progress=False, time_limit=1e-9)
assert stopped["steps"] == 1, stopped
train(student("prf", lora=True), blocks, out / "resumed", config, seed=0, eval_blocks=blocks[:1], progress=False)
"""


def checkpoint_files(folder: Path, step: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(folder / "end_to_end" / f"step_{step:06d}" / name))
            for name in ("features.safetensors", "optimizer.safetensors")]


def test_two_processes_take_the_step_one_process_takes_on_the_combined_batch(model_dirs, tmp_path):
    """Also: FSDP with each layer checkpointed and the loss in chunks, on a float32 and on a bfloat16 base
    model (the student's float32 tensors train in float32); a two-process run stopped after a step
    (checkpointed) and resumed in new models ends with the weights and Adam state of the run never stopped."""
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    one, two = tmp_path / "one", tmp_path / "two"
    runs = [(one, [sys.executable, str(script), str(model_dirs["llama"]), str(one), "4"]),
            (two, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(script), str(model_dirs["llama"]), str(two), "2"])]
    for folder, cmd in runs:
        folder.mkdir()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (a, _), (b, _) = (checkpoint_files(f / "sgd", 2) for f in (one, two))
    start = load_file(str(one / "start.safetensors"))
    assert sorted(a) == sorted(b) == sorted(start) and a
    for name in a:
        step = (a[name] - start[name]).abs().max().item()
        differ = (b[name] - a[name]).abs().max().item()
        assert step > 0 and differ <= 1e-6 * step, (name, step, differ)   # float rounding, not a share
    (a16, _), (b16, _) = (checkpoint_files(f / "sgd16", 2) for f in (one, two))
    assert sorted(a16) == sorted(a) and all(t.dtype == torch.float32 for t in b16.values())
    for name in a16:    # bfloat16 rounds each block's forward in its own batch; a wrong share is off by 2x
        step = (a16[name] - start[name]).abs().max().item()
        assert step > 0 and (b16[name] - a16[name]).abs().max().item() <= 1e-3 * step, name
    losses = [json.loads((f / "sgd" / "end_to_end" / "state.json").read_text())["losses"] for f in (one, two)]
    assert len(losses[0]) == len(losses[1]) == 2          # the logged loss is the step's, over both shares
    assert all(abs(x / y - 1) < 1e-4 for x, y in zip(*losses)), losses
    curves = []
    for folder in (one, two):
        whole, resumed = (checkpoint_files(folder / run, 5) for run in ("whole", "resumed"))
        assert any(".lora_" in n for n in whole[0]) and any(n.endswith("key_shift") for n in whole[0])
        for x, y in zip(whole, resumed):
            assert sorted(x) == sorted(y) and all(torch.equal(x[n], y[n]) for n in x), folder.name
        curve, again = (json.loads((folder / run / "end_to_end" / "state.json").read_text())["curve"]
                        for run in ("whole", "resumed"))
        assert [c["step"] for c in curve] == [2, 4, 5] and curve == again, folder.name
        curves.append(curve)
    for a_point, b_point in zip(*curves):     # validation under FSDP: every process runs it, the weights gathered
        assert a_point["tokens"] == b_point["tokens"] and abs(a_point["ppl"] / b_point["ppl"] - 1) < 1e-4


# --- the loss: chunked over positions, against the whole block's logits ------------------------------------------

def reference_loss(model, ids: torch.Tensor, kd_weight: float) -> torch.Tensor:
    """The spec: both models' full logits over the whole block, from the model's own forward."""
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), -1)
    value = F.nll_loss(logp.reshape(-1, logp.shape[-1]), ids[:, 1:].reshape(-1))
    if kd_weight > 0:
        with torch.no_grad(), teacher_mode(model):
            teacher = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), -1)
        value = value + kd_weight * F.kl_div(logp, teacher, log_target=True, reduction="none").sum(-1).mean()
    return value


def student(family: str, lora: bool = False):
    model = tiny_model(family)
    linearize(model, [8, 8, 8], Attention(feature="prf", window=4, sink=1), seed=0)
    if lora:
        add_lora(model, 2, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(is_student_tensor(name))
    with torch.no_grad():      # adapters start at 0: move them, so that switching them off changes the teacher
        for name, p in model.named_parameters():
            if ".lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    for module in attention_modules(model):   # as the phase trains them: the PRF key shifts move
        module.dofattn.train()
    return model


def gradients(model, value: torch.Tensor) -> dict[str, torch.Tensor]:
    named = trainable(model)
    grads = torch.autograd.grad(value, [p for _, p in named])
    return {n: g for (n, _), g in zip(named, grads)}


@contextlib.contextmanager
def key_shifts_kept(model):
    """Put the PRF key shifts back as they were (training moves them): the next loss starts where this one did."""
    shifts = {n: b.clone() for n, b in model.named_buffers() if n.endswith("key_shift")}
    yield
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in shifts:
                b.copy_(shifts[n])


def assert_same(got: torch.Tensor, got_grads: dict, want: torch.Tensor, want_grads: dict) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert sorted(got_grads) == sorted(want_grads) and got_grads
    for name, g in want_grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(), msg=name)


@pytest.mark.parametrize("family", [*FAMILIES, "gemma2-capped"])
def test_head_of_the_body_is_the_models_own_logits(family):
    """For every supported family: what the chunked loss computes is the model's own logits, and its decoder layers
    (FSDP's units, what activation checkpointing replays) are found."""
    model = GEMMA2() if family == "gemma2-capped" else tiny(family)
    ids = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        got = head(model, hidden_states(model, ids))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(decoder_layers(model)) == model.config.num_hidden_layers
    if family == "gemma2-capped":              # the cap bites: the raw logits are far from the model's
        with torch.no_grad():
            assert (model.get_output_embeddings()(hidden_states(model, ids)) - want).abs().max() > 0.1


def GEMMA2():
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=0.5,
                          max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("chunk", [0, 5, 22, 64])
@pytest.mark.parametrize("family,lora,kd_weight", [("llama", True, 0.7), ("gpt2", False, 0.7), ("llama", False, 0)])
def test_chunked_loss_and_gradients_equal_the_whole_blocks(family, lora, kd_weight, chunk):
    """T = 23: 22 predicted positions, which a chunk of 5 does not divide (the last chunk holds 2)."""
    model = student(family, lora)
    ids = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(1))
    with key_shifts_kept(model):
        want = reference_loss(model, ids, kd_weight)
        want_grads = gradients(model, want)
    got = loss(model, ids, kd_weight, chunk=chunk)
    assert_same(got, gradients(model, got), want, want_grads)


def test_a_chunk_keeps_no_logits_for_the_backward_pass():
    """What the chunks are for: autograd keeps no tensor of the vocabulary's width (each chunk's logits are
    recomputed in the backward pass); the whole block's loss keeps the student's [B, T-1, vocab]."""
    model = student("llama")
    ids = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(3))

    def widths(chunk: int) -> set[int]:
        seen = set()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.add(t.shape[-1] if t.dim() else 0) or t,
                                                      lambda t: t):
            loss(model, ids, 0.7, chunk=chunk).backward()
        return seen

    assert 300 in widths(0) and 300 not in widths(8)


def test_a_large_vocabulary_makes_the_chunks_smaller_and_the_loss_stays(monkeypatch):
    """`loss_positions`: a chunk holds at most LOSS_VALUES logits over the batch (Gemma 3's 262,144-token
    vocabulary: 192 positions of a 1,024 chunk); the loss and its gradients are the whole block's."""
    from dofattn.distill import end_to_end

    assert end_to_end.loss_positions(1024, 511, 49_152) == 511 and end_to_end.loss_positions(1024, 511, 262_144) == 192
    assert end_to_end.loss_positions(1024, 511, 262_144, batch=4) == 48 and end_to_end.loss_positions(0, 511, 1) == 511
    assert end_to_end.loss_positions(1024, 511, 10 ** 9) == 1
    model = student("llama")
    ids = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(5))
    with key_shifts_kept(model):
        want = reference_loss(model, ids, 0.7)
        want_grads = gradients(model, want)
    monkeypatch.setattr(end_to_end, "LOSS_VALUES", 2 * 3 * 300)     # 3 positions of 2 blocks a chunk
    made, head = [], end_to_end.head
    monkeypatch.setattr(end_to_end, "head", lambda model, hidden: made.append(hidden.shape[:2].numel()) or
                        head(model, hidden))
    got = loss(model, ids, 0.7, chunk=1024)
    assert max(made) == 6 and len(made) >= 2 * 8              # 8 chunks of 22 positions, each model's head
    assert_same(got, gradients(model, got), want, want_grads)


@pytest.mark.parametrize("family,lora", [("llama", True), ("gpt_neox", False)])
def test_activation_checkpointing_keeps_the_gradients_and_replays_each_layer(family, lora):
    model = student(family, lora)
    ids = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(4))
    with key_shifts_kept(model):
        want = loss(model, ids, 0.7, chunk=6)
        want_grads = gradients(model, want)
    calls = []
    for module in attention_modules(model):      # the student's cache hooks sit on these: they run in the replay
        module.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    with layers_checkpointed(model):
        got = loss(model, ids, 0.7, chunk=6)
        forward = len(calls)
        got_grads = gradients(model, got)
    layers = len(attention_modules(model))
    assert forward == 2 * layers and calls[layers:] == [True] * 2 * layers     # the teacher's, without autograd
    assert_same(got, got_grads, want, want_grads)
    assert not any(layer.training for layer in decoder_layers(model)) and not model.is_activation_checkpointing


# --- two processes, killed and resumed ---------------------------------------------------------------------------

@pytest.mark.slow
def test_two_process_run_killed_after_a_checkpoint_resumes_to_identical_weights(model_dirs, corpus, tmp_path):
    """`torchrun -m dofattn distill` with FSDP (three two-process starts, ~70 s on 2 cores): killed, all its
    processes, after an end-to-end checkpoint and run again, it ends with the weights, Adam state and losses of a
    run never stopped. PRF key shifts move in training (each process raises them on its own blocks, then they take
    the largest), LoRA adapters train beside the feature maps, and the student rank 0 builds whole from the last
    checkpoint is the one saved and evaluated."""
    from tests.test_distill import ENV, assert_identical, distill_argv

    extra = ("layerwise.steps=0", "end_to_end.steps=10", "end_to_end.checkpoint_every=2", "student.lora_rank=2",
             "end_to_end.seq_len=24", "end_to_end.loss_chunk=7")

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                "dofattn", *distill_argv(model_dirs["llama"], corpus, out, *extra)]

    reference, out = tmp_path / "reference", tmp_path / "resumed"
    proc = subprocess.run(command(reference), env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    state = out / "end_to_end" / "state.json"
    with open(tmp_path / "killed.log", "w") as sink:    # its own session: the kill reaches the workers too
        killed = subprocess.Popen(command(out), env=ENV, stdout=sink, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        deadline = time.monotonic() + 200
        while killed.poll() is None and not state.is_file() and time.monotonic() < deadline:
            time.sleep(0.002)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
    stopped_at = json.loads(state.read_text())["step"]
    assert 0 < stopped_at < 10 and not (out / "log.json").exists(), (tmp_path / "killed.log").read_text()[-2000:]

    proc = subprocess.run(command(out), env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = [f / "end_to_end" / "step_000010" for f in (reference, out)]
    for name in ("features.safetensors", "optimizer.safetensors"):
        assert_identical(*(load_file(str(folder / name)) for folder in last))
    saved = load_file(str(reference / "features.safetensors"))       # the student the run saved and evaluated
    assert_identical(saved, {n: t for n, t in load_file(str(last[0] / "features.safetensors")).items()
                             if n in saved})
    assert any(".lora_" in n for n in saved) and any(n.endswith("key_shift") for n in saved)
    logs = [json.loads((f / "log.json").read_text()) for f in (reference, out)]
    assert logs[0]["end_to_end"]["losses"] == logs[1]["end_to_end"]["losses"]
    assert logs[0]["evaluation"]["student_ppl"] == logs[1]["evaluation"]["student_ppl"]


def test_a_step_with_a_nan_gradient_is_skipped_logged_and_resumed_past(tmp_path):
    """A NaN in one step's gradients (float32 range: keys far below their shift) must not make the student NaN: that
    step is skipped, `skipped_steps` names it (also after a resume), the other steps train."""
    from functools import partial

    from dofattn.distill.end_to_end import train
    from dofattn.recipe import EndToEnd

    def student():
        torch.manual_seed(0)
        model = tiny_model("llama")
        linearize(model, [8, 8, 8], Attention(feature="hedgehog", window=4, sink=1), seed=0)
        for name, p in model.named_parameters():
            p.requires_grad_(is_student_tensor(name))
        return model

    blocks = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(1))
    config = EndToEnd(steps=4, batch_size=1, seq_len=16, lr=0.1, checkpoint_every=2)
    sgd = partial(torch.optim.SGD, lr=0.1)

    def poisoned(model):
        calls = iter(range(100))
        first = next(p for _, p in trainable(model))
        first.register_hook(lambda g: g * float("nan") if next(calls) == 2 else g)    # the third backward
        return model

    start = {n: p.detach().clone() for n, p in trainable(student())}
    log = train(poisoned(student()), blocks, tmp_path / "a", config, seed=0, eval_blocks=blocks[:1], progress=False,
                optimizer_class=sgd)
    assert log["skipped_steps"] == [2] and log["steps"] == 4 and all(map(math.isfinite, log["losses"]))
    saved = load_file(str(tmp_path / "a" / "end_to_end" / "step_000004" / "features.safetensors"))
    assert all(torch.isfinite(t).all() for t in saved.values())
    assert any(not torch.equal(saved[n], t) for n, t in start.items() if n in saved)     # the other steps moved it
    stopped = train(poisoned(student()), blocks, tmp_path / "b", config, seed=0, eval_blocks=blocks[:1],
                    progress=False, optimizer_class=sgd, time_limit=1e-9)
    assert stopped["steps"] == 1 and "skipped_steps" not in stopped
    resumed = train(student(), blocks, tmp_path / "b", config, seed=0, eval_blocks=blocks[:1], progress=False,
                    optimizer_class=sgd)
    assert "skipped_steps" not in resumed        # the hook was in the first model only: nothing skipped
    once = train(poisoned(student()), blocks, tmp_path / "c", EndToEnd(**{**vars(config), "steps": 3}), seed=0,
                 eval_blocks=blocks[:1], progress=False, optimizer_class=sgd)
    again = train(student(), blocks, tmp_path / "c", config, seed=0, eval_blocks=blocks[:1], progress=False,
                  optimizer_class=sgd)
    assert once["skipped_steps"] == [2] and again["skipped_steps"] == [2]     # kept in the checkpoint
