"""The teacher's softmax attention helpers (`ops.softmax`): kv heads, logits, the exact reference, by hand."""

import math

import pytest
import torch

from dofattn.ops.softmax import attention_logits, expand_kv, softmax_attention


def test_expand_kv_gives_each_query_head_its_group_kv_head():
    x = torch.randn(2, 5, 3, 4)
    out = expand_kv(x, 6)
    assert out.shape == (2, 5, 6, 4)
    for h in range(6):
        assert torch.equal(out[:, :, h], x[:, :, h // 2])
    assert expand_kv(x, 3) is x
    assert torch.equal(expand_kv(x.transpose(1, 2), 6, dim=1), out.transpose(1, 2))
    with pytest.raises(ValueError, match="7 query heads cannot share 3 kv heads"):
        expand_kv(x, 7)


@pytest.mark.parametrize("T, Tk", [(1, 1), (7, 7), (3, 8)])
def test_logits_by_hand(T, Tk):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, T, 3, 5, generator=g), torch.randn(2, Tk, 3, 5, generator=g)
    logits = attention_logits(q, k, 0.7, torch.float64)
    assert logits.shape == (2, 3, T, Tk) and logits.dtype == torch.float64
    for t in range(T):
        for s in range(Tk):
            if s > Tk - T + t:                                           # the query t sits at position Tk - T + t
                assert (logits[:, :, t, s] == -math.inf).all()
            else:
                expected = 0.7 * (q[:, t].double() * k[:, s].double()).sum(-1)
                torch.testing.assert_close(logits[:, :, t, s], expected)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        attention_logits(torch.randn(1, Tk + 1, 3, 5), k, 1.0)


def test_softmax_attention_by_hand():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 9, 3, 5, generator=g), torch.randn(2, 9, 3, 5, generator=g), torch.randn(2, 9, 3, 4,
                                                                                                      generator=g)
    o = softmax_attention(q, k, v, 0.4)
    assert o.shape == (2, 9, 3, 4) and o.dtype == torch.float32
    for t in range(9):
        w = torch.softmax(0.4 * torch.einsum("bhd,bshd->bhs", q[:, t], k[:, :t + 1]), -1)   # [B, H, t+1]
        torch.testing.assert_close(o[:, t], torch.einsum("bhs,bshv->bhv", w, v[:, :t + 1]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="as many keys and values as queries"):
        softmax_attention(q, k[:, :5], v[:, :5], 0.4)
