"""The PRF feature map and the PRF decode step in Triton (`ops/triton/prf.py`) against the map's PyTorch path and
the naive op.

    python -m pytest tests/test_triton_prf.py -q

How the kernels run without a GPU, and when these tests skip: tests/triton_helpers.py.
"""

import pytest
import torch

# first: it skips the module without Triton
from tests.triton_helpers import CUDA, DEVICE, RATIO

from dofattn.ops import naive_linear_attention  # noqa: E402
from dofattn.ops.triton import prf  # noqa: E402
from dofattn.spec import Attention
from tests.test_ops import assert_close  # noqa: E402


def prf_map(H=3, D=16, M=37, seed=0):
    """A learned PRF map with random log-weights and a key shift calibrated on large keys (exponents ~ 100)."""
    from dofattn.features import make_feature_map

    fmap = make_feature_map("prf", H, D, M, scaling=D ** -0.5, seed=seed).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fmap.log_weights.copy_(torch.randn(H, M, generator=g).to(DEVICE))
        fmap.features(6 * torch.randn(2, 50, H, D, generator=g).to(DEVICE), "key")   # training mode: calibrates
    return fmap.eval()


def torch_features(fmap, x, role):
    """The map's PyTorch path (autograd on, so the fused path is never taken)."""
    with torch.enable_grad():
        phi, scale = fmap.features(x.detach().requires_grad_(), role)
    return phi.detach(), scale.detach()


@pytest.mark.parametrize("shape", [(1, 1, 3, 16), (2, 70, 3, 16), (1, 130, 3, 16)])
def test_prf_features_match_torch(shape):
    from dofattn.features import MAX_KEY_EXCESS

    fmap = prf_map()
    x = 6 * torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for role in ("query", "key"):
        ref_phi, ref_scale = torch_features(fmap, x, role)
        phi, scale = prf.prf_features(fmap.prf(), x, role, MAX_KEY_EXCESS)
        assert_close(role, ref_phi, phi, RATIO)
        if role == "query":
            assert_close("scale", ref_scale, scale, 1e-6)
        else:
            assert scale is None


def test_prf_features_of_bfloat16_inputs():
    """16-bit x: the projection runs in tf32x3 on a GPU (near float32), the features come out in bf16."""
    from dofattn.features import MAX_KEY_EXCESS

    fmap = prf_map()
    x = (6 * torch.randn(2, 70, 3, 16, generator=torch.Generator().manual_seed(2))).bfloat16().to(DEVICE)
    for role in ("query", "key"):
        ref_phi, ref_scale = torch_features(fmap, x.float(), role)
        phi, scale = prf.prf_features(fmap.prf(), x, role, MAX_KEY_EXCESS)
        assert phi.dtype == torch.bfloat16
        assert_close(role, ref_phi, phi, 1e-2)
        if role == "query":
            assert_close("scale", ref_scale, scale, 1e-5)


def test_prf_decode_step_matches_the_layer():
    """The one-kernel step (features + state update + output, GQA) against features + the naive op."""
    from dofattn.features import MAX_KEY_EXCESS

    fmap = prf_map(H=4, M=24)
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, D, V = 2, 4, 2, 16, 16
    q = 3 * torch.randn(B, 1, H, D, generator=g).to(DEVICE)
    k, v = (3 * torch.randn(B, 1, Hkv, D, generator=g).to(DEVICE) for _ in range(2))
    state = torch.rand(B, H, 24, V + 1, generator=g).to(DEVICE)
    k_h, v_h = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    ref_o, ref_s = naive_linear_attention(torch_features(fmap, q, "query")[0], torch_features(fmap, k_h, "key")[0],
                                          v_h, state, output_final_state=True)
    before = state.clone()
    o = prf.prf_decode_step(fmap.prf(), q, k, v, state, MAX_KEY_EXCESS)
    assert_close("o", ref_o, o, RATIO)
    assert_close("ht", ref_s, state, RATIO)                                            # updated in place
    # a padding token (row 1) leaves its state alone; row 0 steps as before
    state = before.clone()
    prf.prf_decode_step(fmap.prf(), q, k, v, state, MAX_KEY_EXCESS, torch.tensor([[True], [False]], device=DEVICE))
    assert_close("ht0", ref_s[:1], state[:1], RATIO)
    assert torch.equal(state[1], before[1])
    with pytest.raises(ValueError, match="contiguous float32 state"):
        prf.prf_decode_step(fmap.prf(), q, k, v, state.double(), MAX_KEY_EXCESS)
    # with a decay: γ S + φk ⊗ [v, 1]; a padding token adds no key, but its step still decays the state
    log_decay = torch.tensor([-2.0, -0.05, -1e-4, -0.3], device=DEVICE)
    ref_o, ref_s = naive_linear_attention(torch_features(fmap, q, "query")[0], torch_features(fmap, k_h, "key")[0],
                                          v_h, before, output_final_state=True, log_decay=log_decay)
    state = before.clone()
    o = prf.prf_decode_step(fmap.prf(), q, k, v, state, MAX_KEY_EXCESS, torch.tensor([[True], [False]], device=DEVICE),
                            log_decay=log_decay)
    assert_close("o0", ref_o[:1], o[:1], RATIO)
    assert_close("ht0", ref_s[:1], state[:1], RATIO)
    assert_close("ht1", torch.exp(log_decay)[:, None, None] * before[1], state[1], RATIO)


@pytest.mark.skipif(not CUDA, reason="the one-kernel decode path runs on CUDA")
@pytest.mark.parametrize("decay", [False, True], ids=["", "decay"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_generation_on_cuda_takes_one_kernel_steps(family, decay, monkeypatch):
    """Greedy generation on CUDA: every step of every layer is one `prf_decode_step` (with the layer's decay, if it
    has one), and the logits equal a full forward over the generated sequence (Triton prefill) up to float
    rounding."""
    from dofattn.model.student import attention_modules, linearize
    from tests.conftest import tiny_model

    model = tiny_model(family).cuda()
    linearize(model, [9, 16, 5], Attention(feature="prf", window=0, sink=0, decay="head" if decay else "none"), seed=1)
    if decay:                                         # half-lives from under a token to hundreds
        with torch.no_grad():
            for module in attention_modules(model):
                module.dofattn.decay.decay_rate.copy_(torch.linspace(0.5, -6, module.dofattn.num_heads))
    calls = []
    step = prf.prf_decode_step
    monkeypatch.setattr(prf, "prf_decode_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    prompt = torch.randint(3, 300, (1, 11), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences, use_cache=False).logits
    assert len(calls) == 3 * 19
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, prompt.shape[1] - 1: -1], rtol=1e-3, atol=1e-3)
