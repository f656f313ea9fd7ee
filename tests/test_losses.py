"""The layerwise softmax loss on sampled rows (`distill.losses`: `layerwise.rows`): each row read in blocks against
the whole row, as the full loss reads it (values and gradients), for every kind of layer; and the rows drawn."""

import math

import pytest
import torch

from dofattn.attention import LinearAttention
from dofattn.distill import losses
from dofattn.distill.losses import sample_rows, softmax_loss
from dofattn.features import make_feature_map
from dofattn.ops.softmax import attention_logits
from dofattn.spec import Attention

B, T, H, D, M = 2, 23, 4, 8, 6

KINDS = {"window, sink, decay": Attention(window=5, sink=2, decay="head"), "window": Attention(window=4),
         "pure": Attention(window=0, sink=0), "pure, decay": Attention(window=0, sink=0, decay="head"),
         "pure, gate": Attention(window=0, sink=0, decay="gate")}


def layer_and_inputs(attention: Attention):
    torch.manual_seed(0)
    layer = LinearAttention(attention, make_feature_map("prf", H, D, M, scaling=D ** -0.5, seed=0))
    with torch.no_grad():
        if layer.window is not None:
            layer.window.log_gain.normal_(0, 1)
        if layer.decay is not None:
            layer.decay.decay_rate.copy_(torch.linspace(0.5, -3, H))
    g = torch.Generator().manual_seed(1)
    q, k, v = (2 * torch.randn(B, T, H, D, generator=g) for _ in range(3))
    return layer, q, k, v


def row_kl(layer, q, k, v) -> torch.Tensor:
    """[B, H, T]: every row's KL, the full loss's way."""
    log_student = layer.naive(q, k, v)
    log_teacher = torch.log_softmax(attention_logits(q, k, D ** -0.5), -1)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return (log_teacher.exp() * (log_teacher - log_student)).masked_fill(~mask, 0).sum(-1)


@pytest.mark.parametrize("kind", KINDS)
def test_every_row_in_blocks_is_the_full_loss_with_its_gradients(kind, monkeypatch):
    monkeypatch.setattr(losses, "ROW_BLOCK", 5)                         # 23 rows: blocks of 5 and a last of 3
    layer, q, k, v = layer_and_inputs(KINDS[kind])
    layer(q, k, v)                                                       # training mode: calibrates the shift
    full = softmax_loss(layer, q, k, v, D ** -0.5)
    want = torch.autograd.grad(full, list(layer.parameters()))
    rows = softmax_loss(layer, q, k, v, D ** -0.5, at=torch.arange(T))
    got = torch.autograd.grad(rows, list(layer.parameters()))
    torch.testing.assert_close(rows, full, rtol=1e-5, atol=1e-7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_some_rows_are_the_mean_of_those_rows(kind, monkeypatch):
    monkeypatch.setattr(losses, "ROW_BLOCK", 2)
    layer, q, k, v = layer_and_inputs(KINDS[kind])
    layer(q, k, v)
    at = torch.tensor([0, 3, 4, 11, 17, 22])
    with torch.no_grad():
        want = row_kl(layer, q, k, v)[:, :, at].mean()
        got = softmax_loss(layer, q, k, v, D ** -0.5, at=at)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_rows_are_distinct_and_sorted():
    g = torch.Generator().manual_seed(0)
    for at in [sample_rows(1000, 50, g, exact=9) for _ in range(40)]:
        assert at.unique().numel() == 50 and torch.equal(at, at.sort().values) and 9 <= at.min() and at.max() < 1000
    assert torch.equal(sample_rows(7, 9, g), torch.arange(7))


def test_rows_need_the_softmax_loss():
    from dofattn.errors import UserError
    from dofattn.recipe import load

    assert load("long-context", ["layerwise.rows=128"]).layerwise.rows == 128
    with pytest.raises(UserError, match="layerwise.rows samples the rows of the softmax loss"):
        load("long-context", ["layerwise.rows=8", "layerwise.loss=l2", "layerwise.seq_len=512"])


def test_rows_give_every_doubling_a_share_and_skip_exact_rows():
    g = torch.Generator().manual_seed(0)
    at = torch.cat([sample_rows(4096, 128, g, exact=64) for _ in range(40)])
    assert at.min() >= 64                                                 # rows the window reads exactly: never
    shares = torch.histc(at.float().log2(), bins=6, min=6, max=12) / len(at)   # 64-127, ..., 2-4 K
    assert shares.min() > 0.12 and shares.max() < 0.22                  # about 1/6 each
    assert len(sample_rows(100, 98, g, exact=64).unique()) == 98          # too few rows past `exact`: still 98


def test_rows_by_left_and_a_run_folder_naming_it_still_loads():
    """`layerwise.rows_by` left: a run folder's recipe.toml names it ("log", or the old default "position" where
    every row is read) and loads; "position" where rows are drawn would change the student: refused."""
    from dofattn.errors import UserError
    from dofattn.recipe import load

    assert load("long-context", ["layerwise.rows_by=log"]).layerwise.rows == 128
    assert load("window", ["layerwise.rows_by=position"]).layerwise.rows == 0          # every row: moot
    with pytest.raises(UserError, match="rows_by.*left dofattn"):
        load("long-context", ["layerwise.rows_by=position"])
    with pytest.raises(UserError, match="rows_by"):
        load("long-context", ["layerwise.rows_by=uniform"])


def test_a_layer_trains_on_rows_drawn_by_log_position(monkeypatch):
    from dofattn.distill.layerwise import train_layer
    from dofattn.recipe import Layerwise

    layer, q, k, v = layer_and_inputs(Attention(window=5, sink=2, decay="head"))
    drawn = []
    real = losses.sample_rows
    monkeypatch.setattr("dofattn.distill.layerwise.sample_rows",
                        lambda *a, **kw: drawn.append(real(*a, **kw)) or drawn[-1])
    log = train_layer(layer, (q, k, v), D ** -0.5, Layerwise(steps=3, batch_size=1, seq_len=T, rows=6),
                  seed=0, progress=False)
    assert log["steps"] == 3 and len(drawn) == 4 and all(len(at) == 6 and at.min() >= 7 for at in drawn)


def test_the_l2_loss_refuses_what_a_recipe_refuses():
    """One rule (`recipe.check_l2`) for the recipe and for the loss called directly: kernel values need PRF or
    Performer features, and pairs beyond the window."""
    from dofattn.distill.losses import l2_loss
    from dofattn.errors import UserError

    q = k = v = torch.randn(1, 8, 2, 4)
    for feature, window, message in (("hedgehog", 0, "compares kernel values"), ("prf", 8, "seq_len > student.window")):
        fmap = make_feature_map(feature, 2, 4, 6, 0.5)
        layer = LinearAttention(Attention(feature=feature, window=window, sink=0), fmap)
        with pytest.raises(UserError, match=message):
            l2_loss(layer, q, k, v, 0.5)


@pytest.mark.parametrize("attention", [Attention(window=0, sink=0), Attention(window=5, sink=2, decay="head")])
def test_l2_loss_on_rows_is_the_full_loss_restricted_to_them(attention):
    """`at`: every row gives the full loss; a subset's loss is the mean over its rows' pairs (`eval`'s kernel error
    at length reads 512 rows, not T × T)."""
    layer, q, k, v = layer_and_inputs(attention)
    full = losses.l2_loss(layer, q, k, v, D ** -0.5)
    torch.testing.assert_close(losses.l2_loss(layer, q, k, v, D ** -0.5, torch.arange(T)), full)
    rows = torch.tensor([9, 14, T - 1])                          # each with linear pairs beside the window
    pairs = layer.attention.linear_pairs(T)
    per_row = [losses.l2_loss(layer, q, k, v, D ** -0.5, torch.tensor([t])) * pairs[t].sum() for t in rows]
    want = torch.stack(per_row).sum() / pairs[rows].sum()
    torch.testing.assert_close(losses.l2_loss(layer, q, k, v, D ** -0.5, rows), want)


def test_a_layer_whose_keys_lose_their_features_says_so():
    """Keys far longer than the queries (QK-norm's, on Gemma 3's global layers) leave most keys' PRF features under
    float32's range with one shift per head: the layer's log counts the keys that keep one."""
    from dofattn.distill.layerwise import keys_with_features, train_layer
    from dofattn.recipe import Layerwise

    layer, q, k, v = layer_and_inputs(Attention(window=5, sink=2, decay="head"))
    config = Layerwise(steps=1, batch_size=1, seq_len=T, rows=0)
    assert train_layer(layer, (q, k, v), D ** -0.5, config, seed=0, progress=False)["keys_with_features"] == 1.0
    long = k * torch.linspace(1, 40, k.shape[1])[None, :, None, None]                # key norms over a wide range
    layer, *_ = layer_and_inputs(Attention(window=5, sink=2, decay="head"))
    log = train_layer(layer, (q, long, v), D ** -0.5, config, seed=0, progress=False)
    assert log["keys_with_features"] < 0.5
    assert keys_with_features(layer, long[:1]) == log["keys_with_features"]          # its fixed batch: block 0


def test_a_layer_step_with_a_nan_gradient_is_skipped_and_logged():
    """As in the end-to-end phase: an inf/NaN gradient (float32's range, keys far below the PRF shift) skips that
    step and the log names it; the layer's tensors stay finite and the other steps train."""
    from dofattn.distill.layerwise import train_layer
    from dofattn.recipe import Layerwise

    layer, q, k, v = layer_and_inputs(Attention(window=5, sink=2, decay="head"))
    start = {n: p.detach().clone() for n, p in layer.named_parameters()}
    calls = iter(range(100))
    first = next(p for p in layer.parameters() if p.requires_grad)
    first.register_hook(lambda g: g * float("nan") if next(calls) == 1 else g)          # the second step's
    log = train_layer(layer, (q, k, v), D ** -0.5, Layerwise(steps=3, batch_size=1, seq_len=T, rows=0), seed=0,
                      progress=False)
    assert log["skipped_steps"] == [1] and math.isfinite(log["last_loss"])
    assert all(torch.isfinite(p).all() for p in layer.parameters())
    assert any(not torch.equal(p, start[n]) for n, p in layer.named_parameters())
