"""The paths that run differently on CUDA, each against its CPU reference: what `scripts/gpu_checks.sh` runs first.

Skipped without a GPU. `DOFATTN_GPU_TEST_DEVICE=cpu pytest tests/test_gpu.py` runs them with the CPU standing in
for the GPU, which checks the tests themselves (both sides then run the same code) but nothing of CUDA.

    the ring kernel with a decay and a sink, replayed in a CUDA graph     test_ring_kernel_with_decay_and_sink_...
    a bounded kept layer's static slots under capture                    test_bounded_kept_layers_...
    prefill and training steps with a decay and a sink (Triton hybrid)   test_prefill_and_training_steps_...
    the prompt's selection of keys                                       test_selection_...
    a `long-context` distill of a tiny model, float32 and bfloat16       test_long_context_distill_...
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dofattn.engine import StaticDecoder
from dofattn.spec import Attention, Kept
from dofattn.model.student import is_student_tensor, linearize
from tests.conftest import tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else os.environ.get("DOFATTN_GPU_TEST_DEVICE")
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (DOFATTN_GPU_TEST_DEVICE=cpu: a dry run)")


def student(attention: Attention, kept: Kept = Kept(), layers=(0, 1, 2)):
    """A tiny Llama student (GQA: 4 query heads on 2 kv heads) whose gains and decays are not their start."""
    model = tiny_model("llama")
    linearize(model, [9, 16, 5], attention, kept=kept, layers=list(layers), seed=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "log_gain" in name or "decay_rate" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
    model.generation_config.eos_token_id = None
    return model


def hf_generate(model, prompt, new_tokens: int):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def static_against_cpu(model, prompt, new_tokens: int):
    """The static decoder on DEVICE (a CUDA graph) gives HF generate's tokens there, and HF generate there gives
    the CPU's logits: the decoder, then what it runs on, each against its reference. Returns the decoder."""
    want_cpu = hf_generate(model, prompt, new_tokens)
    model = model.to(DEVICE)
    want = hf_generate(model, prompt.to(DEVICE), new_tokens)
    torch.testing.assert_close(torch.stack(want.logits).cpu(), torch.stack(want_cpu.logits), rtol=1e-4, atol=1e-4)
    decoder = StaticDecoder(model)
    assert decoder.graph == (DEVICE == "cuda")
    assert torch.equal(decoder.generate(prompt.to(DEVICE), new_tokens), want.sequences)
    return decoder


def test_ring_kernel_with_decay_and_sink_in_a_cuda_graph():
    """Window + sink + decay: the one-kernel ring step, captured and replayed, past the ring's wrap."""
    from dofattn.attention import StaticStateLayer

    model = student(Attention(feature="prf", window=4, sink=2, decay="head"))
    prompt = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(1))
    decoder = static_against_cpu(model, prompt, 14)
    assert all(isinstance(layer, StaticStateLayer) for layer in decoder.cache.layers)


def test_bounded_kept_layers_static_slots_under_capture():
    """A kept layer bounded after the prompt (sink, 3 chosen keys per kv head, a ring of W) beside linear layers
    with a decay: its static slots written in place under the graph."""
    from dofattn.model.bounded import StaticBoundedLayer

    model = student(Attention(window=4, sink=2, decay="head"), Kept(select=3, select_observe=3), layers=(0, 2))
    prompt = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    decoder = static_against_cpu(model, prompt, 12)
    assert isinstance(decoder.cache.layers[1], StaticBoundedLayer)


def test_prefill_and_training_steps_with_decay_and_sink():
    """The full forward (the Triton hybrid on CUDA) with a window, a sink and a decay: loss and every student
    gradient as on the CPU, then three Adam steps to the same tensors."""
    ids = torch.randint(3, 300, (2, 45), generator=torch.Generator().manual_seed(4))
    trained = {}
    for device in ("cpu", DEVICE):
        model = student(Attention(window=8, sink=2, decay="head")).to(device).train()
        params = {n: p for n, p in model.named_parameters() if is_student_tensor(n)}
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params.values(), lr=1e-2)
        losses, grads = [], {}
        for step in range(3):
            loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
            optimizer.zero_grad()
            loss.backward()
            if step == 0:
                grads = {n: p.grad.detach().cpu().clone() for n, p in params.items()}
            optimizer.step()
            losses.append(loss.item())
        trained[device] = (losses, grads, {n: p.detach().cpu() for n, p in params.items()})
    (cpu_losses, cpu_grads, cpu_params), (losses, grads, params) = trained["cpu"], trained[DEVICE]
    assert all(torch.isfinite(torch.tensor(losses)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-5)
    for name in cpu_grads:
        torch.testing.assert_close(grads[name], cpu_grads[name], rtol=1e-3, atol=1e-5, msg=name)
    for name in cpu_params:
        torch.testing.assert_close(params[name], cpu_params[name], rtol=1e-3, atol=1e-4, msg=name)


def test_selection_chooses_the_cpus_keys():
    from dofattn.ops.select import select_keys

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 300, 6, 16, generator=gen), torch.randn(2, 300, 2, 16, generator=gen)
    valid = torch.ones(2, 300, dtype=torch.bool)
    valid[1, :17] = False
    candidates = valid & (torch.arange(300) < 300 - 8) & (torch.arange(300) >= 4)
    want = select_keys(q, k, 0.25, candidates, 32, 8, 15, valid)
    got = select_keys(q.to(DEVICE), k.to(DEVICE), 0.25, candidates.to(DEVICE), 32, 8, 15, valid.to(DEVICE))
    assert torch.equal(got[1].cpu(), want[1])
    chosen = lambda index, ok: [sorted(index[b, h][ok[b]].tolist()) for b in range(2) for h in range(2)]
    assert chosen(got[0].cpu(), got[1].cpu()) == chosen(*want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_context_distill_on_a_tiny_model(dtype, model_dirs, corpus, tmp_path, capsys):
    """The `long-context` recipe, shrunk to a tiny Llama (one kept layer, bounded), distilled on DEVICE: it trains,
    and its validation perplexity is the CPU run's (float32: within 1%; bfloat16 against the float32 CPU run:
    within 10%)."""
    from dofattn.cli import main

    sets = ["layerwise.seq_len=64", "layerwise.blocks=8", "layerwise.batch_size=2", "layerwise.steps=3",
            "end_to_end.batch_size=2", "end_to_end.seq_len=64", "end_to_end.steps=3", "end_to_end.blocks=8",
            "eval.blocks=2", "eval.seq_len=64", "student.dims=fix:8", "student.window=8", "student.keep_softmax=1",
            "student.select=4"]
    ppl = {}
    for device, kind in (("cpu", "float32"), (DEVICE, dtype)):
        out = tmp_path / f"{device}-{kind}"
        argv = ["distill", "--recipe", "long-context", "--model", str(model_dirs["llama"]), "--data", str(corpus),
                "--out", str(out), "--device", device, "--dtype", kind]
        assert main(argv + [x for s in sets for x in ("--set", s)]) == 0, capsys.readouterr().err
        ppl[device, kind] = json.loads((out / "log.json").read_text())["evaluation"]["student_ppl"]
        assert torch.isfinite(torch.tensor(ppl[device, kind]))
    ratio = ppl[DEVICE, dtype] / ppl["cpu", "float32"]
    assert abs(ratio - 1) < (0.01 if dtype == "float32" else 0.1), ppl
