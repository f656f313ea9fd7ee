"""The feature maps (`dofattn.features`): shapes and positivity, numerics at large exponents, the key shift."""

import math

import pytest
import torch

from dofattn.features import FEATURES, make_feature_map


@pytest.mark.parametrize("kind", FEATURES)
@pytest.mark.parametrize("dim", [2, 7, 64, 130])
def test_feature_maps_are_positive_and_shaped(kind, dim):
    fmap = make_feature_map(kind, num_heads=3, head_dim=16, dim=dim, scaling=0.25, seed=1)
    x = torch.randn(2, 5, 3, 16)
    for role in ("query", "key"):
        phi = fmap(x, role)
        assert phi.shape == (2, 5, 3, dim) and (phi >= 0).all() and torch.isfinite(phi).all()
    trainable = {n for n, p in fmap.named_parameters() if p.requires_grad}
    assert (trainable == set()) == (kind == "performer")


@pytest.mark.parametrize("kind", ["prf", "performer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prf_is_finite_at_exponent_195(kind, dtype):
    # q·k/√d = 195 with d = 64: norms of ~35, the largest seen on SmolLM2
    d = 64
    g = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    x = (direction * math.sqrt(195 * math.sqrt(d)))[None, None, None, :].expand(1, 8, 1, d).clone()
    x[:, ::2] *= 0.3  # a mix of huge and moderate vectors
    fmap = make_feature_map(kind, 1, d, 64, d ** -0.5)
    from dofattn.ops import linear_attention

    pq, pk = fmap(x.to(dtype), "query"), fmap(x.to(dtype), "key")
    out, state = linear_attention(pq, pk, torch.randn(1, 8, 1, d).to(dtype), output_final_state=True)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()


def test_key_shift_cancels_in_the_attention_ratio():
    from dofattn.ops import linear_attention

    fmap = make_feature_map("prf", 2, 16, 32, 0.25, seed=3)
    q, k, v = torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
    fmap(k, "key")  # calibrates the shift
    out1, _ = linear_attention(fmap(q, "query"), fmap(k, "key"), v)
    fmap.key_shift += 5.0
    out2, _ = linear_attention(fmap(q, "query"), fmap(k, "key"), v)
    torch.testing.assert_close(out1, out2, rtol=1e-5, atol=1e-6)


def test_key_shift_calibration_flag_follows_the_buffer():
    """`shift_calibrated` is cached per buffer version: calibrating, loading and resetting all move it."""
    from dofattn.features import make_feature_map

    fmap = make_feature_map("prf", 2, 8, 5, scaling=0.25)
    assert not fmap.shift_calibrated()
    fmap.features(torch.randn(1, 4, 2, 8), "key")                       # training mode: calibrates
    assert fmap.shift_calibrated()
    fmap.key_shift.fill_(-torch.inf)
    assert not fmap.shift_calibrated()
    fmap.load_state_dict({**fmap.state_dict(), "key_shift": torch.zeros(2)})
    assert fmap.shift_calibrated()
