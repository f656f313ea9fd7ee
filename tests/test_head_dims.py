"""Per-head feature dims (`student.dims = "dof-head"`): each query head of a linear layer uses its own number of
the layer's features, the rest masked (feature 0) and its 1/M its own.

A head's kernel estimate against a map of exactly its count of features (the same directions and weights); a layer
with per-head dims against its naive reference in outputs and gradients, with exact heads beside them; generation
(the CPU decode step's constants), static decoding, save, load and export against the forward; the dims a run takes
from dof.json; and the rules.
"""

from __future__ import annotations

import json

import pytest
import torch

from dofattn.errors import UserError
from dofattn.features import make_feature_map
from dofattn.model.attach import linear_of
from dofattn.model.hf import attention_modules
from dofattn.model.install import attention_forward
from dofattn.model.student import linearize
from dofattn.spec import Attention, Kept, StudentSpec
from tests.test_exact_heads import logits_as_generated, saved_and_exported, tiny

COUNTS = (3, 7, 1, 5, 6, 2, 7, 4)        # features per query head of an 8-head layer of 7 features


def kernel(fmap, q, k):
    """φ(q)·φ(k)·exp(scale_q + scale_k): [B, T, H, S], the map's estimate of exp(s·qᵀk)."""
    (pq, sq), (pk, sk) = fmap.features(q, "query"), fmap.features(k, "key")
    return torch.einsum("bthm,bshm->bths", pq, pk) * torch.exp(sq[..., None] + sk[None, None, :, None])


@pytest.mark.parametrize("kind", ["prf", "performer"])
def test_a_head_estimates_with_its_own_count_of_features(kind):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 8, 16, generator=g), torch.randn(2, 6, 8, 16, generator=g)
    fmap = make_feature_map(kind, 8, 16, 7, 0.25, seed=1, head_dims=COUNTS).eval()
    with torch.no_grad():
        fmap.log_weights.copy_(torch.randn(8, 7, generator=g) * 0.3)
        got = kernel(fmap, q, k)
        assert (fmap.features(q, "query")[0][:, :, 0, 3:] == 0).all()          # head 0 uses 3 of 7
        for h, count in enumerate(COUNTS):
            alone = make_feature_map(kind, 1, 16, count, 0.25).eval()
            alone.directions.copy_(fmap.directions[h:h + 1, :count])
            alone.log_weights.copy_(fmap.log_weights[h:h + 1, :count])
            want = kernel(alone, q[:, :, h:h + 1], k[:, :, h:h + 1])
            torch.testing.assert_close(got[:, :, h:h + 1], want, rtol=1e-5, atol=0)


def per_head(exact=(), window: int = 3, kept=Kept()):
    model = tiny()
    head_dims = (COUNTS, tuple(reversed(COUNTS)), (7,) * 8)
    linearize(model, [7] * 3, Attention(window=window, sink=1), kept=kept, layers=[0, 1, 2], seed=1,
              exact_heads=exact, head_dims=head_dims)
    with torch.no_grad():
        for module in attention_modules(model):
            linear_of(module).window.log_gain.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.parametrize("exact", [(), ((1,), (), ())])
def test_a_layer_with_per_head_dims_is_its_naive_reference(exact):
    from tests.test_exact_heads import naive as mixed_naive

    model = per_head(exact, kept=Kept(select=4, select_observe=3, select_pool=3) if exact else Kept())
    module = attention_modules(model)[0]
    linear = linear_of(module)
    # exact kv head 1 takes query heads 2 and 3 (and their counts) away from the linear module
    assert linear.feature_map.head_dims == ([3, 7, 6, 2, 7, 4] if exact else list(COUNTS))
    g = torch.Generator().manual_seed(2)
    B, T, D = 2, 13, 8
    q = torch.randn(B, 8, T, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, 4, T, D, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(B, T, 8, D, generator=g)
    params = [p for p in linear.parameters() if p.requires_grad]
    got = attention_forward(module, q, k, v, None, scaling=module.scaling, dropout=0.0)[0]
    if exact:
        want = mixed_naive(module, q, k, v)
    else:
        group = 2
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        weights = linear.naive(q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2)).exp()  # [B, H, T, T]
        want = (weights @ vr).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(torch.autograd.grad((got * w).sum(), [q, k, v, *params]),
                    torch.autograd.grad((want * w).sum(), [q, k, v, *params])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_generation_and_static_decoding_are_the_forward():
    """Linear layers keep every key in their state: each generated token's logits are the forward's, through the
    decode step's constants (a head's features past its count masked there too)."""
    from dofattn.engine import StaticDecoder

    model = per_head()
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        seq, logits = logits_as_generated(model, ids, 6)
        torch.testing.assert_close(logits, model(seq).logits[:, 8:-1], rtol=1e-4, atol=1e-4)
        assert torch.equal(StaticDecoder(model).generate(ids, 6), seq)


def test_save_load_and_export_keep_the_head_dims(tmp_path, tokenizer):
    head_dims = (COUNTS, tuple(reversed(COUNTS)), (7,) * 8)
    spec = dict(dims=(7,) * 3, layers=(0, 1, 2), attention=Attention(window=3, sink=1), seed=1, head_dims=head_dims)
    assert any("own share" in line for line in StudentSpec(base_model="x", **spec).describe())
    again = saved_and_exported(per_head(), tmp_path, tokenizer, **spec)
    assert again.head_dims == head_dims


def test_a_run_takes_each_layers_largest_head_and_every_heads_count(tmp_path):
    from dofattn import recipe as recipes
    from dofattn.distill import choose
    from dofattn.dof import DofResult, LayerDof

    counts = [list(COUNTS), [2] * 8, [9, 1, 1, 1, 1, 1, 1, 1]]
    result = DofResult(layers=[LayerDof(i, 1.0, [1.0] * 8, 64, heads) for i, heads in enumerate(counts)])
    (tmp_path / "dof.json").write_text(result.to_json())
    model = tiny()
    recipe = recipes.load("window", overrides={"student.dims": "dof-head"})
    assert choose.dims(recipe, model, None, tmp_path) == ([7, 2, 9], counts)
    recipe = recipes.load("window")
    assert choose.dims(recipe, model, None, tmp_path) == ([64, 64, 64], [])
    assert json.loads(result.to_json())["layers"][0]["head_dims"] == list(COUNTS)


@pytest.mark.parametrize("head_dims,match", [
    ((COUNTS, COUNTS), "gives 2 layers"),
    (((8,) * 8, COUNTS, COUNTS), "between 1 and its 7"),
    (((7,) * 7, COUNTS, COUNTS), "each of the layer's query heads"),
])
def test_bad_head_dims_are_refused_in_one_line(head_dims, match):
    with pytest.raises(UserError, match=match):
        StudentSpec(base_model="x", dims=(7,) * 3, layers=(0, 1, 2), base={"num_heads": 8}, head_dims=head_dims)


def test_per_head_dims_need_random_features():
    from dofattn import recipe as recipes

    with pytest.raises(UserError, match="prf or performer"):
        make_feature_map("hedgehog", 8, 16, 7, 0.25, head_dims=COUNTS)
    with pytest.raises(UserError, match="prf or performer"):
        recipes.load("window", overrides={"student.dims": "dof-head", "student.feature": "hedgehog"})
