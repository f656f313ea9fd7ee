"""The short causal convolution (`ops.conv`) against torch's depthwise conv1d, by hand, and in pieces."""

import pytest
import torch
import torch.nn.functional as F

from dofattn.ops.conv import short_conv


def conv1d_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, T, C, D], weight [K, C, D] through F.conv1d (groups = channels, zeros before the first token)."""
    B, T, C, D = x.shape
    K = weight.shape[0]
    channels = x.permute(0, 2, 3, 1).reshape(B, C * D, T)                        # [B, C·D, T]
    kernel = weight.permute(1, 2, 0).reshape(C * D, 1, K).flip(-1)                # conv1d correlates: flip
    y = F.conv1d(F.pad(channels, (K - 1, 0)), kernel, groups=C * D)
    return y.reshape(B, C, D, T).permute(0, 3, 1, 2)


@pytest.mark.parametrize("B,T,C,D,K", [(1, 1, 1, 1, 2), (2, 63, 3, 5, 4), (3, 7, 2, 64, 4), (1, 500, 1, 8, 3),
                                       (2, 3, 4, 6, 5)])   # T < K - 1 too
def test_matches_depthwise_conv1d(B, T, C, D, K):
    g = torch.Generator().manual_seed(T + K)
    x = torch.randn(B, T, C, D, generator=g, dtype=torch.float64)
    weight = torch.randn(K, C, D, generator=g, dtype=torch.float64)
    y, tail = short_conv(x, weight)
    torch.testing.assert_close(y, conv1d_reference(x, weight), rtol=1e-12, atol=1e-12)
    assert tail.shape == (B, K - 1, C, D)
    padded = torch.cat([x.new_zeros(B, K - 1, C, D), x], 1)
    torch.testing.assert_close(tail, padded[:, -(K - 1):])


def test_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 4, 1, 1)
    weight = torch.tensor([10.0, 1.0, 0.5]).reshape(3, 1, 1)        # the token, one back, two back
    y, tail = short_conv(x, weight)
    assert y.flatten().tolist() == [10.0, 21.0, 32.5, 44.0]
    assert tail.flatten().tolist() == [3.0, 4.0]


def test_identity_start_changes_nothing():
    x = torch.randn(2, 9, 3, 4, dtype=torch.bfloat16)
    weight = torch.zeros(4, 3, 4)
    weight[0] = 1
    y, _ = short_conv(x, weight)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x)


@pytest.mark.parametrize("pieces", [[1] * 12, [5, 1, 1, 5], [2, 10], [3, 3, 3, 3]])
def test_pieces_equal_one_call(pieces):
    """A sequence fed in pieces, each continuing from the tail of the one before, gives the same output and tail."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, sum(pieces), 3, 4, generator=g)
    weight = torch.randn(4, 3, 4, generator=g)
    whole, whole_tail = short_conv(x, weight)
    tail, outs, start = None, [], 0
    for n in pieces:
        y, tail = short_conv(x[:, start:start + n], weight, tail)
        outs.append(y)
        start += n
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tail, whole_tail)


def test_gradients_match_the_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 37, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 37, 3, 5, generator=g, dtype=torch.float64)
    (short_conv(x, weight)[0] * target).sum().backward()
    gx, gw = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    (conv1d_reference(x, weight) * target).sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, weight.grad, rtol=1e-12, atol=1e-12)


def test_sums_in_float32_for_16_bit_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 50, 2, 8, generator=g).to(torch.bfloat16)
    weight = torch.randn(4, 2, 8, generator=g)
    y, tail = short_conv(x, weight)
    ref = conv1d_reference(x.float(), weight)
    assert y.dtype == tail.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)   # one rounding of the float32 sum


def test_bad_weight_shape():
    with pytest.raises(ValueError, match="does not fit x"):
        short_conv(torch.zeros(1, 3, 2, 4), torch.zeros(4, 3, 4))
