"""The hybrid's decode step in few operations (`ops.window.window_decode_step`, `fold_key`;
`hybrid.WindowForms.decode_step` and the ring's step): the op against the spec's last row, the layer's steady steps against its general cached call
(outputs, states and caches, step after step), and numerics at exponent 195."""

import math

import pytest
import torch

from dofattn.attention.hybrid import WindowForms
from dofattn.spec import Attention
from dofattn.attention import LinearAttention, LinearStateLayer, StaticStateLayer
from dofattn.features import make_feature_map
from dofattn.ops.window import fold_key, naive_window_linear_attention, window_decode_step
from dofattn.ops.softmax import expand_kv

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (B, H, Hkv, D, V, M, W, S): GQA and not, a window of 1, odd sizes, sinks of 0 to 3
SHAPES = [(1, 2, 2, 4, 5, 3, 4, 0), (2, 6, 2, 8, 3, 7, 5, 2), (3, 3, 1, 5, 6, 1, 1, 1), (2, 4, 4, 3, 2, 9, 7, 3)]


@pytest.mark.parametrize("shape,decay", [(shape, decay) for shape in SHAPES for decay in (False, True)
                                         if not (decay and shape[-1])])       # a sink and a decay do not combine
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_op_is_the_specs_last_row(shape, decay, dtype):
    """Keys [sinks, the one leaving the window, W−1 cached, new] through the spec give the same output and final
    state as `fold_key` on the leaving key and `window_decode_step` on the rest, in shuffled order (an exact key's
    weight does not depend on its distance). Padding in the first row, a sink slot still empty in the last."""
    B, H, Hkv, D, V, M, W, S = shape
    g = torch.Generator().manual_seed(sum(shape))
    Tk = S + W + 1
    q = torch.randn(B, 1, H, D, generator=g)
    k, v = torch.randn(B, Tk, Hkv, D, generator=g), torch.randn(B, Tk, Hkv, V, generator=g)
    phi_q, phi_k = torch.rand(B, 1, H, M, generator=g), torch.rand(B, Tk, H, M, generator=g)
    q_scale, offset = torch.randn(B, 1, H, generator=g), torch.randn(H, generator=g)
    state = torch.rand(B, H, M, V + 1, generator=g)
    log_decay = -torch.rand(H, generator=g) if decay else None
    valid = torch.ones(B, Tk, dtype=torch.bool)
    valid[0, S:S + 2] = False                                            # the leaving key and one cached: padding
    sink = torch.zeros(B, Tk, dtype=torch.bool)
    sink[:, :S] = True
    if S:
        valid[-1, S - 1] = False                                         # an empty sink slot
    q, k, v, phi_q, phi_k = (x.to(dtype) for x in (q, k, v, phi_q, phi_k))

    ref, ref_state = naive_window_linear_attention(
        q, expand_kv(k, H), expand_kv(v, H), phi_q, phi_k, q_scale, offset, D ** -0.5, W, valid, state,
        output_final_state=True, log_decay=log_decay, sink_mask=sink if S else None)
    leaving = phi_k[:, S].to(torch.float32) * valid[:, S, None, None]
    new_state = fold_key(state, leaving, expand_kv(v[:, S:S + 1], H)[:, 0], log_decay)
    exact = [i for i in range(Tk) if i != S]
    exact = [exact[i] for i in torch.randperm(len(exact), generator=g)]
    o = window_decode_step(q[:, 0], k[:, exact], v[:, exact], valid[:, exact], phi_q[:, 0], q_scale[:, 0], offset,
                           D ** -0.5, new_state)
    assert o.dtype == dtype and new_state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    torch.testing.assert_close(new_state, ref_state, **tol)
    torch.testing.assert_close(o.float(), ref[:, 0].float(), **(tol if dtype != torch.bfloat16 else
                                                                {"rtol": 1e-2, "atol": 1e-2}))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decay", [False, True])
def test_prf_step_is_the_fold_and_the_read(shape, decay):
    """`prf_window_decode_step` (the map's features inside, the state in place) against `fold_key` on the leaving
    key's features and `window_decode_step` on the query's: a padded leaving key (first row), an empty sink slot
    (last row), exponents up to about 60 above the key shift (clamped)."""
    B, H, Hkv, D, V, M, W, S = shape
    g = torch.Generator().manual_seed(sum(shape) + decay)
    fmap = make_feature_map("prf", H, D, M, scaling=D ** -0.5, seed=sum(shape))
    with torch.no_grad():
        fmap.log_weights.normal_(0, 1, generator=g)
        fmap.key_shift.copy_(torch.randn(H, generator=g) - 30)
    q, old_k = (4 * torch.randn(B, n, D, generator=g) for n in (H, Hkv))
    old_v = torch.randn(B, Hkv, V, generator=g)
    N = S + W
    keys, values = torch.randn(B, N, Hkv, D, generator=g), torch.randn(B, N, Hkv, V, generator=g)
    valid = torch.ones(B, N, dtype=torch.bool)
    if S:
        valid[-1, 0] = False
    old_valid = torch.ones(B, dtype=torch.bool)
    old_valid[0] = False
    state = torch.rand(B, H, M, V + 1, generator=g)
    log_gain, log_decay = torch.randn(H, generator=g), (-torch.rand(H, generator=g) if decay else None)
    from dofattn.features import MAX_KEY_EXCESS
    from dofattn.ops.window import prf_step_constants, prf_window_decode_step

    phi, k_scale = fmap.features(old_k[:, None].repeat_interleave(H // Hkv, 2), "key")
    want_state = fold_key(state, phi[:, 0] * old_valid[:, None, None], old_v.repeat_interleave(H // Hkv, 1), log_decay)
    phi_q, q_scale = fmap.features(q[:, None], "query")
    want = window_decode_step(q, keys, values, valid, phi_q[:, 0], q_scale[:, 0], k_scale + log_gain, D ** -0.5,
                              want_state)
    constants = prf_step_constants(fmap.prf(), log_gain, Hkv, MAX_KEY_EXCESS, log_decay)
    got = prf_window_decode_step(q, old_k, old_v, old_valid, keys, values, valid, state, constants)
    torch.testing.assert_close(state, want_state, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_op_gives_zero_for_a_row_with_nothing():
    """No valid key and an empty state: 0, not NaN (as the spec)."""
    o = window_decode_step(torch.randn(1, 2, 4), torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 5),
                           torch.zeros(1, 3, dtype=torch.bool), torch.rand(1, 2, 3), torch.zeros(1, 2),
                           torch.zeros(2), 0.5, torch.zeros(1, 2, 3, 6))
    assert torch.equal(o, torch.zeros(1, 2, 5))


def layer_pair(H, Hkv, D, M, W, S, decay, seed=0):
    """A trained-looking hybrid layer (random gains, rates) and its calibration call's inputs."""
    torch.manual_seed(seed)
    layer = LinearAttention(Attention(window=W, sink=S, decay="head" if decay else "none"), make_feature_map("prf", H,
                            D, M, scaling=D ** -0.5, seed=seed), num_kv_heads=Hkv)
    with torch.no_grad():
        layer.window.log_gain.normal_(0, 1)
        if decay:
            layer.decay.decay_rate.copy_(torch.linspace(0.5, -4, H))
    return layer


def count_lean(layer, monkeypatch):
    """Counts the layer's steps through `decode_step`: the test must not pass on the general path alone."""
    calls = []
    original = WindowForms.decode_step

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(WindowForms, "decode_step", counted)
    return calls


@pytest.mark.parametrize("H,Hkv,W,S,decay,prompt", [(4, 2, 4, 0, False, 9), (6, 3, 5, 2, False, 3),
                                                    (4, 2, 4, 0, True, 2), (3, 1, 1, 1, False, 6),
                                                    (4, 4, 6, 3, False, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_steady_steps_equal_the_general_call(H, Hkv, W, S, decay, prompt, dtype, device, monkeypatch):
    """Prefill, then 3W + 2 one-token calls on the growing cache: the lean steps give the general call's outputs,
    state, window and sink, every step. Batch 3, the first row left-padded (its sink fills later). On CUDA the
    general call runs the Triton ops."""
    D, M, B = 8, 7, 3
    layer = layer_pair(H, Hkv, D, M, W, S, decay).to(device)
    g = torch.Generator().manual_seed(5)
    T = prompt + 3 * W + 2
    q = (2 * torch.randn(B, T, H, D, generator=g)).to(device, dtype)
    k, v = ((2 * torch.randn(B, T, Hkv, D, generator=g)).to(device, dtype) for _ in range(2))
    valid = torch.ones(B, T, dtype=torch.bool, device=device)
    valid[0, :min(2, prompt)] = False
    with torch.no_grad():
        layer(q[:, :prompt], k[:, :prompt], v[:, :prompt], valid[:, :prompt])    # training mode: calibrates the shift
    layer.eval()
    lean, general = LinearStateLayer(), LinearStateLayer()
    calls = count_lean(layer, monkeypatch)
    with torch.no_grad():
        for cache in (lean, general):
            layer(q[:, :prompt], k[:, :prompt], v[:, :prompt], valid[:, :prompt], cache=cache)
        for t in range(prompt, T):
            args = (q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], valid[:, :t + 1][:, -1:])
            out = layer(*args, cache=lean)
            with monkeypatch.context() as m:
                m.setattr(WindowForms, "lean_step_ok", lambda *a: False)
                ref = layer(*args, cache=general)
            tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
            torch.testing.assert_close(out, ref, **tol)
            torch.testing.assert_close(lean.state, general.state, rtol=1e-4, atol=1e-5)   # sums in another order
            ours, theirs = lean.tensors(), general.tensors()
            assert ours.keys() == theirs.keys() and {"window.keys", "window.values", "window.valid"} <= ours.keys()
            for name in ours.keys() - {"state"}:
                assert torch.equal(ours[name], theirs[name]), name
    assert len(calls) >= 2 * W                                         # the lean step ran once the window was full


@pytest.mark.parametrize("W,S,decay,prompt", [(4, 0, False, 7), (4, 0, False, 2), (16, 0, False, 9), (4, 2, False, 7),
                                               (5, 0, True, 7), (4, 0, True, 2)])
def test_ring_steps_equal_the_general_call(W, S, decay, prompt, monkeypatch):
    """The static ring (`StaticStateLayer`, any slot order) gives the general call's outputs and state after it has
    wrapped twice, from prompts longer and shorter than the window (with a decay: the state moves on by one factor
    γ each step, before the key leaving the window joins it)."""
    H, Hkv, D, M = 4, 2, 8, 12
    layer = layer_pair(H, Hkv, D, M, W, S, decay, seed=1)
    g = torch.Generator().manual_seed(1)
    q = 2 * torch.randn(2, prompt + 2 * W + 3, H, D, generator=g)
    k, v = (2 * torch.randn(2, prompt + 2 * W + 3, Hkv, D, generator=g) for _ in range(2))
    listed, ringed = LinearStateLayer(), LinearStateLayer()
    monkeypatch.setattr(WindowForms, "lean_step_ok", lambda *a: False)     # the reference: the general call
    with torch.no_grad():
        layer(q[:, :prompt], k[:, :prompt], v[:, :prompt])          # training mode: calibrates the shift
        layer.eval()
        for cache in (listed, ringed):
            layer(q[:, :prompt], k[:, :prompt], v[:, :prompt], cache=cache)
        ringed.seen = prompt
        position = torch.tensor([prompt])
        ring = StaticStateLayer.freeze(ringed, position)
        for t in range(prompt, q.shape[1]):
            ref = layer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache=listed)
            out = layer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache=ring)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            position.add_(1)
    torch.testing.assert_close(ring.state, listed.state, rtol=1e-5, atol=1e-6)


def test_lean_step_waits_for_a_full_window_and_sink(monkeypatch):
    """A prompt shorter than the window or the sink: the general call runs until both are full (a new token may
    still be a sink, or the window not yet lose a key), then the lean step."""
    W, S = 4, 3
    layer = layer_pair(2, 1, 4, 5, W, S, False)
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 9, 2, 4, generator=g), torch.randn(1, 9, 1, 4, generator=g), torch.randn(1, 9, 1, 4,
                                                                                                      generator=g)
    with torch.no_grad():
        layer(q, k, v)
    layer.eval()
    calls = count_lean(layer, monkeypatch)
    cache = LinearStateLayer()
    steps = []
    with torch.no_grad():
        layer(q[:, :1], k[:, :1], v[:, :1], cache=cache)
        for t in range(1, 9):
            before = len(calls)
            layer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache=cache)
            steps.append(len(calls) > before)
    # token t sees t cached keys, of which the window holds min(t, W) (sinks are marked padding there)
    assert steps == [t >= W for t in range(1, 9)] and cache.parts["sink"].full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_lean_steps_finite_at_exponent_195(dtype, device):
    D = 64
    layer = LinearAttention(Attention(window=4, sink=2), make_feature_map("prf", 1, D, 16, scaling=D ** -0.5,
                            seed=0)).to(device)
    x = torch.randn(1, 40, 1, D, device=device)
    x = x / x.norm(dim=-1, keepdim=True) * math.sqrt(195 * math.sqrt(D))  # s·qᵀq ≈ 195 on the diagonal
    v = torch.randn(1, 40, 1, D, device=device)
    with torch.no_grad():
        layer(x[:, :8], x[:, :8], v[:, :8])
        layer.eval()
        cache = LinearStateLayer()
        layer(x[:, :8].to(dtype), x[:, :8].to(dtype), v[:, :8].to(dtype), cache=cache)
        outs = [layer(x[:, t:t + 1].to(dtype), x[:, t:t + 1].to(dtype), v[:, t:t + 1].to(dtype), cache=cache)
                for t in range(8, 40)]
    assert all(o.dtype == dtype and torch.isfinite(o).all() for o in outs) and torch.isfinite(cache.state).all()


def test_step_constants_follow_the_parameters(monkeypatch):
    """The PRF step's constants are kept while the layer's parameters are, and made again after an in-place change
    (an optimizer step, a load): a steady step after the change gives the general call's output."""
    from dofattn.ops.window import prf_step_constants

    H, Hkv, D, M, W = 4, 2, 8, 12, 3
    layer = layer_pair(H, Hkv, D, M, W, 1, True, seed=2)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 9, H, D, generator=g)
    k, v = (torch.randn(1, 9, Hkv, D, generator=g) for _ in range(2))
    with torch.no_grad():
        layer(q, k, v)                                                   # training mode: calibrates the shift
        layer.eval()
        step_v = v[:, :1]
        held = WindowForms.step_constants(layer, step_v)
        assert WindowForms.step_constants(layer, step_v) is held
        layer.window.log_gain.add_(0.5)
        layer.decay.decay_rate.sub_(1.0)
        fresh = WindowForms.step_constants(layer, step_v)
        assert fresh is not held
        want = prf_step_constants(layer.feature_map.prf(), layer.window.log_gain, Hkv, fresh.max_excess,
                                  layer.decay.log_decay())
        for got, ref in zip(fresh, want):
            assert got == ref if isinstance(ref, float) else torch.equal(got, ref)
        lean, general = LinearStateLayer(), LinearStateLayer()
        for cache in (lean, general):
            layer(q[:, :8], k[:, :8], v[:, :8], cache=cache)
        calls = count_lean(layer, monkeypatch)
        out = layer(q[:, 8:], k[:, 8:], v[:, 8:], cache=lean)
        assert calls == [1]
        monkeypatch.setattr(WindowForms, "lean_step_ok", lambda *a: False)
        torch.testing.assert_close(out, layer(q[:, 8:], k[:, 8:], v[:, 8:], cache=general), rtol=1e-5, atol=1e-6)


def test_step_arguments_follow_the_parameters():
    """A decode step's op arguments are kept while the layer's tensors are, made again after an in-place change, and
    made each call with autograd on or where a part reads the values (a gate)."""
    fmap = make_feature_map("hedgehog", 4, 8, 6, scaling=8 ** -0.5)
    layer = LinearAttention(Attention(window=3, sink=0, decay="head"), fmap, num_kv_heads=2).eval()
    v = torch.randn(1, 1, 2, 8)
    with torch.no_grad():
        held = layer.step_arguments(v)
        assert layer.step_arguments(v) is held and torch.equal(held["log_decay"], layer.decay.log_decay())
        layer.decay.decay_rate.sub_(1.0)
        fresh = layer.step_arguments(v)
        assert fresh is not held and torch.equal(fresh["log_decay"], layer.decay.log_decay())
        gated = LinearAttention(Attention(window=0, sink=0, decay="gate"), fmap, num_kv_heads=2).eval()
        assert gated.step_arguments(v) is not gated.step_arguments(v)
        torch.testing.assert_close(gated.step_arguments(v)["log_gate"], gated.decay.log_gates(expand_kv(v, 4)))
    assert layer.step_arguments(v) is not layer.step_arguments(v)
