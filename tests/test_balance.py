"""The balance part (`attention.balance`): queries times c and keys over c per kv head, c measured once on the first
real tokens. Every path against the naive forms is in tests/test_attention.py (its `balance` rows); here what the
part is for and how it is measured."""

import pytest
import torch

from dofattn import recipe as recipes
from dofattn.attention import LinearAttention
from dofattn.errors import UserError
from dofattn.features import make_feature_map
from dofattn.model.student import linear_parts, linearize, load_student, save_student, StudentSpec, fingerprint
from dofattn.ops.softmax import expand_kv
from dofattn.spec import Attention

H, HKV, D, T = 4, 2, 16, 48


def qk(key_size: float, seed: int = 0):
    """Queries of norm² about D/4 and keys `key_size` times as long (QK-norm's keys on Gemma 3's global layers)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g, dtype=torch.float64) * 0.5
    k = torch.randn(1, T, HKV, D, generator=g, dtype=torch.float64) * 0.5 * key_size
    v = torch.randn(1, T, HKV, D, generator=g, dtype=torch.float64)
    return q, k, v


def layer(balance: bool, window: int = 4, dim: int = 64) -> LinearAttention:
    fmap = make_feature_map("prf", H, D, dim, scaling=1.0, seed=0)
    return LinearAttention(Attention(window=window, sink=0, balance=balance), fmap, num_kv_heads=HKV).double()


def test_c_is_measured_once_from_the_median_norms():
    q, k, v = qk(key_size=8.0)
    part = layer(True).balance
    assert not part.measured()
    part.inputs(q, k, v, None)
    assert part.measured()
    ratio = k.square().sum(-1).flatten(0, 1).median(0).values / \
        q.square().sum(-1).flatten(0, 1).median(0).values.view(HKV, H // HKV).mean(-1)
    torch.testing.assert_close(part.log_scale.exp() ** 4, ratio, rtol=0.15, atol=0)     # medians, pooled per group
    before = part.log_scale.clone()
    for mode in (True, False):
        part.train(mode)
        part.inputs(q * 3, k, v, None)                                                  # measured once only
        assert torch.equal(part.log_scale, before)


def test_padding_does_not_move_c():
    q, k, v = qk(key_size=8.0)
    valid = torch.ones(1, T, dtype=torch.bool)
    padded_k = k.clone()
    padded_k[:, :T // 2 + 2] = 1e3                                         # huge pad keys, more than half of them
    valid[:, :T // 2 + 2] = False
    part, plain = layer(True).balance, layer(True).balance
    part.inputs(q, padded_k, v, valid)
    plain.inputs(q[:, T // 2 + 2:], k[:, T // 2 + 2:], v, None)
    torch.testing.assert_close(part.log_scale, plain.log_scale)


def test_the_logits_stay_the_teachers():
    """Within the window every key is exact: the output is the softmax's with the balance or without it."""
    q, k, v = qk(key_size=8.0)
    on, off = layer(True, window=T), layer(False, window=T)
    off.load_state_dict(on.state_dict(), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(on(q, k, v), off(q, k, v), rtol=1e-5, atol=1e-6)
        assert on.balance.log_scale.exp().min() > 2                          # and c was not 1


def test_balanced_keys_keep_their_features_where_long_keys_lose_them():
    """Keys 20x the queries' length: one shift per head puts every other key's PRF features below float32's range
    without the balance (the linear branch reads almost nothing); with it nearly every key keeps them, and the linear
    branch's weights come closer to the softmax's."""
    q, k, v = (x.float() for x in qk(key_size=20.0))
    q = q * 2
    rows = {}
    for balance in (False, True):
        each = layer(balance, window=0, dim=256).float()            # the naive form computes in float32
        each(q, k, v)                                              # training mode: calibrates the shift (and c)
        qq, kk, _ = (each.balance.inputs(q, k, v, None) if balance else (q, k, v))
        phi_k, _ = each.feature_map.features(expand_kv(kk, H), "key")
        rows[balance] = (phi_k.amax(-1) > 0).float().mean().item(), each.naive(q, expand_kv(k, H)).exp()
    exact = torch.softmax((torch.einsum("bthd,bshd->bhts", q, expand_kv(k, H)))
                          .masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")), -1)
    assert rows[False][0] < 0.2 and rows[True][0] > 0.9
    error = {b: (w - exact).abs().sum(-1).mean().item() for b, (_, w) in rows.items()}
    assert error[True] < 0.7 * error[False], error


def test_a_student_saves_its_c_and_loads_it(tmp_path, model_dirs):
    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    attention = Attention(window=4, sink=1, decay="head", balance=True)
    linearize(model, [8, 8, 8], attention, seed=1)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    scales = {i: part.balance.log_scale.clone() for i, part in linear_parts(model).items()}
    assert all(torch.isfinite(s).all() for s in scales.values())
    spec = StudentSpec(str(model_dirs["llama"]), [8, 8, 8], [0, 1, 2], attention, seed=1, base=fingerprint(model))
    save_student(model, tmp_path / "s", spec)
    loaded, _, read = load_student(tmp_path / "s")
    assert read == spec
    for i, part in linear_parts(loaded).items():
        assert torch.equal(part.balance.log_scale, scales[i])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want)


def test_the_recipe_key():
    assert recipes.load("window", ["student.balance=true"]).student.attention.balance is True
    with pytest.raises(UserError, match="student.balance"):
        Attention(balance=3)


def test_a_plan_measures_a_balanced_students_step():
    """The plan runs an end-to-end step on fake tensors: the part's measurement has no data-dependent shape or
    read-back there (it refused: 'needs the values of a tensor')."""
    from dofattn.distill.plan import make_plan
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    plan = make_plan(recipes.load("window", ["student.balance=true", "layerwise.seq_len=40"]), 1, config=model.config,
                     device="cpu", timed=False)
    assert plan.end_to_end_flops > 0 and plan.memory.total > 0
