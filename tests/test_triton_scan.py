"""The linear-attention scan in Triton (`ops/triton/scan.py`) against the naive reference: outputs, states and
gradients, with a decay, a gate or neither, and its decode step.

    python -m pytest tests/test_triton_scan.py -q

How the kernels run without a GPU, and when these tests skip: tests/triton_helpers.py.
"""

import pytest
import torch

# first: it skips the module without Triton
from tests.triton_helpers import CUDA, DEVICE, RATIO, decay_leaf, gate_leaf, on_device, skip_wrong_bf16_dots

from dofattn.ops import linear_attention, naive_linear_attention, pick_backend  # noqa: E402
from dofattn.ops.triton import scan  # noqa: E402
from dofattn.spec import Attention
from tests.test_ops import assert_close, forward_backward, make_inputs  # noqa: E402


# (B, T, H, M, V, with_initial_state): odd T, M and V that are not powers of two, M above 128 (value tiles).
CASES = [
    (1, 1, 1, 1, 1, False),
    (1, 7, 3, 5, 16, True),
    (2, 63, 2, 64, 64, False),
    (1, 65, 1, 130, 16, True),
    (2, 130, 3, 20, 65, True),
    (1, 200, 2, 257, 33, False),
]
if CUDA:
    CASES += [(2, 500, 3, 128, 64, True), (1, 3000, 2, 203, 64, False), (1, 4099, 12, 64, 64, True)]
CASE_IDS = [f"B{b}-T{t}-H{h}-M{m}-V{v}{'-S0' if s else ''}" for b, t, h, m, v, s in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matches_naive(case):
    B, T, H, M, V, with_state = case
    inputs = on_device(make_inputs(B, T, H, M, V, with_state))
    ref_o, ref_s, ref_grads = forward_backward(naive_linear_attention, *[x.double() if x is not None else None
                                                                          for x in inputs])
    tri_o, tri_s, tri_grads = forward_backward(scan.triton_linear_attention, *inputs)
    assert tri_o.dtype == torch.float32 and tri_s.dtype == torch.float32
    assert_close("o", ref_o, tri_o, RATIO)
    assert_close("ht", ref_s, tri_s, RATIO)
    assert_same_without_grad(inputs, {}, tri_o, tri_s)
    for name in ref_grads:
        floor = ref_grads["dk"].norm().item() if (name == "dq" and M == 1) else 1e-8
        assert_close(name, ref_grads[name], tri_grads[name], RATIO, floor)


@pytest.mark.parametrize("block", [64, 128, 256])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_blocks_and_direction(block, reverse):
    """The raw scan with several blocks per sequence, left to right and right to left, with and without the den."""
    phi_q, phi_k, v, _ = on_device(make_inputs(2, 300, 3, 20, 24, with_state=False))
    A = torch.einsum("bthm,bshm->bhts", phi_q.double(), phi_k.double())
    mask = torch.ones(300, 300, dtype=torch.bool, device=DEVICE)
    A = A * (mask.triu() if reverse else mask.tril())
    ref_o = torch.einsum("bhts,bshv->bthv", A, v.double())
    ref_d = A.sum(-1).transpose(1, 2)
    o, d, _ = scan.scan(phi_q, phi_k, v, with_den=True, reverse=reverse, block=block)
    assert_close("o", ref_o, o, RATIO)
    assert_close("den", ref_d, d, RATIO)
    o, _, _ = scan.scan(phi_q, phi_k, v, with_den=True, reverse=reverse, normalize=True, block=block)
    assert_close("o/den", ref_o / ref_d[..., None], o, RATIO)
    o, d, _ = scan.scan(phi_q, phi_k, v, reverse=reverse, block=block)
    assert d is None
    assert_close("o", ref_o, o, RATIO)


def test_scan_states_over_blocks():
    """Final state over several blocks, from an initial state, with and without the normaliser column."""
    phi_q, phi_k, v, state = on_device(make_inputs(2, 300, 3, 20, 24))
    _, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    for block in (64, 128, 512):
        _, _, s = scan.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block)
        assert_close("ht", ref_s, s, RATIO)
        _, _, s = scan.scan(phi_q, phi_k, v, state, final_state=True, block=block)
        assert_close("ht[:V]", ref_s[..., :-1], s[..., :-1], RATIO)
        assert torch.equal(s[..., -1], torch.zeros_like(s[..., -1]))


@pytest.mark.parametrize("delay", [16, 64, 300])
@pytest.mark.parametrize("block", [64, 256])
def test_scan_with_delay_reads_keys_in_place(delay, block):
    """`delay` W (the window hybrid's linear part) against the same scan on keys and values moved W positions
    later by copying, zeros in front: outputs, normaliser and final state, from an initial state; W = 300 ≥ T
    leaves no key at all."""
    phi_q, phi_k, v, state = on_device(make_inputs(2, 250, 3, 20, 24))
    moved_k, moved_v = (torch.nn.functional.pad(x, (0, 0, 0, 0, delay, 0))[:, :250].contiguous() for x in (phi_k, v))
    ref_o, ref_d, ref_s = scan.scan(phi_q, moved_k, moved_v, state, with_den=True, final_state=True, block=block)
    o, d, s = scan.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block, delay=delay)
    assert_close("o", ref_o, o, RATIO)
    assert_close("den", ref_d, d, RATIO)
    assert_close("ht", ref_s, s, RATIO)


# --- decay ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decay", "gate"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decay_and_gate_match_naive(case, kind):
    """With a per-head decay or a gate: outputs, final state and the gradients of every input, log γ or the log
    gates included."""
    B, T, H, M, V, with_state = case
    inputs = on_device(make_inputs(B, T, H, M, V, with_state))
    ref_leaf, tri_leaf = ((decay_leaf(H), decay_leaf(H)) if kind == "decay" else
                          (gate_leaf(B, T, H), gate_leaf(B, T, H)))
    ref_o, ref_s, ref_grads = forward_backward(naive_linear_attention, *[x.double() if x is not None else None
                                                                          for x in inputs], **{"log_" + kind: ref_leaf})
    tri_o, tri_s, tri_grads = forward_backward(scan.triton_linear_attention, *inputs, **{"log_" + kind: tri_leaf})
    assert_close("o", ref_o, tri_o, RATIO)
    assert_close("ht", ref_s, tri_s, RATIO)
    for name in ref_grads:
        floor = ref_grads["dk"].norm().item() if (name == "dq" and M == 1) else 1e-8
        assert_close(name, ref_grads[name], tri_grads[name], RATIO, floor)
    assert_close("dlog_" + kind, ref_leaf.grad, tri_leaf.grad, RATIO)
    assert_same_without_grad(inputs, {"log_" + kind: tri_leaf.detach()}, tri_o, tri_s)


def assert_same_without_grad(inputs, kwargs, o, state):
    """Without autograd the op runs its kernels outside its autograd Function (a prefill; one token takes the decode
    step): the same result."""
    with torch.no_grad():
        o_ng, s_ng = scan.triton_linear_attention(*inputs, output_final_state=True, **kwargs)
    assert_close("o without grad", o.detach().double(), o_ng, RATIO)
    assert_close("ht without grad", state.detach().double(), s_ng, RATIO)


def decayed_pairs(T: int, log_decay: torch.Tensor, reverse: bool) -> torch.Tensor:
    """[H, T, T] float64: γ^|t − s| on s ≤ t (s ≥ t if reverse), else 0."""
    t = torch.arange(T, device=log_decay.device)
    distance = (t[:, None] - t[None, :]).abs().double()
    keep = (t[:, None] <= t[None, :]) if reverse else (t[:, None] >= t[None, :])
    return torch.exp(log_decay.double()[:, None, None] * distance) * keep


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("reverse", [False, True])
def test_decay_scan_blocks_and_direction(block, reverse):
    """The raw decayed scan over several blocks (the last one partial), both directions, with and without the den:
    o_t = Σ γ^|t − s| (q_t·k_s) v_s."""
    log_decay = decay_leaf(3).detach()
    check_weighted_scan(decayed_pairs(300, log_decay, reverse), reverse, block, log_decay=log_decay)


def check_weighted_scan(weights: torch.Tensor, reverse: bool, block: int, **decay):
    """The raw scan on [2, 300, 3] inputs against o_t = Σ_s w_ts (q_t·k_s) v_s and its den Σ_s w_ts q_t·k_s, with
    weights [.., T, T] float64 that hold the causal mask, with the den and without; `decay`: the scan's log_decay
    or log_gate."""
    phi_q, phi_k, v, _ = on_device(make_inputs(2, 300, 3, 20, 24, with_state=False))
    A = torch.einsum("bthm,bshm->bhts", phi_q.double(), phi_k.double()) * weights
    ref_o = torch.einsum("bhts,bshv->bthv", A, v.double())
    ref_d = A.sum(-1).transpose(1, 2)
    o, d, _ = scan.scan(phi_q, phi_k, v, with_den=True, reverse=reverse, block=block, **decay)
    assert_close("o", ref_o, o, RATIO)
    assert_close("den", ref_d, d, RATIO)
    o, d, _ = scan.scan(phi_q, phi_k, v, reverse=reverse, block=block, **decay)
    assert d is None
    assert_close("o", ref_o, o, RATIO)


@pytest.mark.parametrize("block", [64, 256])
def test_decay_states_over_blocks_and_delay(block):
    """Final state over several blocks from an initial state (γ^T S0 + Σ γ^(T−1−s) k ⊗ v), and `delay` W against
    keys and values moved W later by copying: the decay counts positions, so key s reaches t as γ^(t − W − s)."""
    phi_q, phi_k, v, state = on_device(make_inputs(2, 250, 3, 20, 24))
    log_decay = decay_leaf(3).detach()
    _, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True, log_decay=log_decay)
    _, _, s = scan.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block, log_decay=log_decay)
    assert_close("ht", ref_s, s, RATIO)
    for delay in (16, 64, 300):
        moved_k, moved_v = (torch.nn.functional.pad(x, (0, 0, 0, 0, delay, 0))[:, :250].contiguous()
                            for x in (phi_k, v))
        ref_o, ref_s = naive_linear_attention(phi_q, moved_k, moved_v, state, output_final_state=True,
                                              normalize=False, log_decay=log_decay)
        o, d, s = scan.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block, delay=delay,
                            log_decay=log_decay)
        assert_close("o", ref_o[..., :-1], o, RATIO, floor=1e-6)
        assert_close("den", ref_o[..., -1], d, RATIO, floor=1e-6)
        assert_close("ht", ref_s, s, RATIO)


def test_decay_refuses_states_in_reverse():
    phi_q, phi_k, v, state = on_device(make_inputs(1, 10, 1, 4, 4))
    with pytest.raises(ValueError, match="with a decay or a gate, an initial or final state is for the forward"):
        scan.scan(phi_q, phi_k, v, state, reverse=True, log_decay=torch.zeros(1, device=DEVICE))


def test_decay_limits_and_strong_decay_stay_finite():
    """log γ = −inf and a positive value (clamped to γ = 0 and 1) and e^-200 over 300 tokens: finite outputs and
    gradients, equal to the spec; a head that forgets everything outputs each token's own value."""
    phi_q, phi_k, v, state = on_device(make_inputs(1, 300, 3, 5, 4))
    for log_decay in (torch.tensor([-torch.inf, 3.0, -200.0]), torch.tensor([-1e4, 0.0, -1e-6])):
        log_decay = log_decay.to(DEVICE)
        ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, True, log_decay=log_decay)
        decay = log_decay.clone().requires_grad_()
        o, s, grads = forward_backward(scan.triton_linear_attention, phi_q, phi_k, v, state, log_decay=decay)
        assert_close("o", ref_o, o, RATIO)
        assert_close("ht", ref_s, s, RATIO)
        assert all(torch.isfinite(g).all() for g in grads.values()) and torch.isfinite(decay.grad).all()
        torch.testing.assert_close(o[0, :, 0], v[0, :, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["decay", "gate"])
def test_decay_and_gate_prefill_then_decode_steps(kind):
    """Decayed or gated Triton prefill, then the one-kernel decode step with the decay or each token's gate, in
    place: the full naive run."""
    phi_q, phi_k, v, _ = on_device(make_inputs(2, 80, 3, 37, 16, with_state=False))
    log_decay, log_gate = decay_leaf(3).detach(), gate_leaf(2, 80, 3).detach()

    def tokens(a: int, b: int) -> dict:              # the decay, or the gates of tokens a to b − 1
        return {"log_decay": log_decay} if kind == "decay" else {"log_gate": log_gate[:, a:b]}

    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, output_final_state=True, **tokens(0, 80))
    o, s = scan.triton_linear_attention(phi_q[:, :70], phi_k[:, :70], v[:, :70], output_final_state=True,
                                        **tokens(0, 70))
    outputs = [o]
    for t in range(70, 80):
        outputs.append(scan.triton_decode_step(phi_q[:, t:t + 1], phi_k[:, t:t + 1], v[:, t:t + 1], s, s,
                                               **tokens(t, t + 1)))
    assert_close("o", ref_o, torch.cat(outputs, 1), RATIO)
    assert_close("ht", ref_s, s, RATIO)
    with torch.no_grad():                              # T = 1 through the entry point: the same step, a new state
        o1, s1 = scan.triton_linear_attention(phi_q[:, :1], phi_k[:, :1], v[:, :1], ref_s, True, **tokens(0, 1))
    ref_o1, ref_s1 = naive_linear_attention(phi_q[:, :1], phi_k[:, :1], v[:, :1], ref_s, True, **tokens(0, 1))
    assert_close("o1", ref_o1, o1, RATIO)
    assert_close("ht1", ref_s1, s1, RATIO)


@pytest.mark.parametrize("kind", ["decay", "gate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decay_and_gate_half_inputs(dtype, kind):
    """16-bit inputs with a decay or a gate: the decayed keys go to 16 bits for the dots, sums and state stay
    float32."""
    skip_wrong_bf16_dots(dtype)
    phi_q, phi_k, v, state = on_device(make_inputs(2, 150, 3, 64, 32))
    decay = {"log_decay": decay_leaf(3).detach()} if kind == "decay" else {"log_gate": gate_leaf(2, 150, 3).detach()}
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True, **decay)
    o, s = scan.triton_linear_attention(phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), state,
                                        output_final_state=True, **decay)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close("o", ref_o, o, 2e-2)
    assert_close("ht", ref_s, s, 2e-2)


# --- gate ---------------------------------------------------------------------------------------------------------


def gated_pairs(log_gate: torch.Tensor, reverse: bool) -> torch.Tensor:
    """[B, H, T, T] float64: exp(Σ over the positions l with min(t, s) < l ≤ max(t, s) of g_l) on s ≤ t (s ≥ t if
    reverse), else 0; each span summed over its own terms."""
    B, T, H = log_gate.shape
    g = log_gate.double().permute(0, 2, 1)                                                     # [B, H, T]
    t = torch.arange(T, device=log_gate.device)
    lo, hi = torch.minimum(t[:, None], t[None, :]), torch.maximum(t[:, None], t[None, :])
    inside = (t[None, None, :] > lo[..., None]) & (t[None, None, :] <= hi[..., None])          # [T, T, L]
    spans = torch.einsum("tsl,bhl->bhts", inside.double(), g)
    keep = (t[:, None] <= t[None, :]) if reverse else (t[:, None] >= t[None, :])
    return torch.exp(spans) * keep


@pytest.mark.parametrize("block", [64, 128, 256])
@pytest.mark.parametrize("reverse", [False, True])
def test_gate_scan_blocks_and_direction(block, reverse):
    """The raw gated scan over several blocks (the last one partial), both directions, with and without the den:
    o_t = Σ exp(Σ_{span} g) (q_t·k_s) v_s, the spans' sums made here term by term."""
    log_gate = gate_leaf(2, 300, 3).detach()
    check_weighted_scan(gated_pairs(log_gate, reverse), reverse, block, log_gate=log_gate)


@pytest.mark.parametrize("block", [64, 256])
def test_gate_states_over_blocks(block):
    """Final state over several blocks from an initial state: exp(Σ g) S0 + Σ_s exp(Σ_{l>s} g_l) k_s ⊗ [v_s, 1]."""
    phi_q, phi_k, v, state = on_device(make_inputs(2, 250, 3, 20, 24))
    log_gate = gate_leaf(2, 250, 3).detach()
    _, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True, log_gate=log_gate)
    _, _, s = scan.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block, log_gate=log_gate)
    assert_close("ht", ref_s, s, RATIO)


def test_gate_refuses_what_it_does_not_cover():
    phi_q, phi_k, v, state = on_device(make_inputs(1, 10, 1, 4, 4))
    gate = torch.zeros(1, 10, 1, device=DEVICE)
    with pytest.raises(ValueError, match="with a decay or a gate, an initial or final state is for the forward"):
        scan.scan(phi_q, phi_k, v, state, reverse=True, log_gate=gate)
    with pytest.raises(ValueError, match="a gate takes no decay and no delay"):
        scan.scan(phi_q, phi_k, v, delay=4, log_gate=gate)
    with pytest.raises(ValueError, match="a gate takes no decay and no delay"):
        scan.scan(phi_q, phi_k, v, log_decay=torch.zeros(1, device=DEVICE), log_gate=gate)
    with pytest.raises(ValueError, match="log_decay and log_gate do not combine"):
        scan.triton_linear_attention(phi_q, phi_k, v, log_decay=torch.zeros(1, device=DEVICE), log_gate=gate)


def test_gate_limits_and_strong_gates_stay_finite():
    """Log gates of −inf and +3 (clamped to a factor of 0 and 1), −1e4 and −200 beside weak ones in the same chunk
    (the spans must not be differences of running sums, or the weak pairs after a strong gate go wrong): finite
    outputs and gradients, equal to the spec; where every token forgets everything, each outputs its own value."""
    phi_q, phi_k, v, state = on_device(make_inputs(1, 300, 3, 5, 4))
    weak = -torch.rand(1, 300, 3, generator=torch.Generator().manual_seed(5)) * 1e-3
    strong = weak.clone()
    strong[:, ::7] = -1e4
    strong[:, 3::11] = -200.0
    strong[:, 5::13] = -torch.inf
    strong[:, 6::17] = 3.0
    forget = torch.full((1, 300, 3), -1e4)
    strong, forget = strong.to(DEVICE), forget.to(DEVICE)
    for log_gate in (strong, forget):
        ref_gate = log_gate.double().clone().requires_grad_()
        ref_o, ref_s, ref_grads = forward_backward(naive_linear_attention, *(x.double() for x in
                                                                             (phi_q, phi_k, v, state)),
                                                   log_gate=ref_gate)
        gate = log_gate.clone().requires_grad_()
        o, s, grads = forward_backward(scan.triton_linear_attention, phi_q, phi_k, v, state, log_gate=gate)
        assert_close("o", ref_o, o, RATIO)
        assert_close("ht", ref_s, s, RATIO)
        assert all(torch.isfinite(g).all() for g in grads.values()) and torch.isfinite(gate.grad).all()
        # forgetting everything, o_t = v_t whatever φq or the gates: ∂φq and ∂log_gate are exactly 0 in the spec
        # and rounding noise in the kernel (the gate's: suffix sums that cancel), so they are measured against ∂φk's
        # size
        floor = ref_grads["dk"].norm().item() if log_gate is forget else 1e-8
        for name in ref_grads:
            assert_close(name, ref_grads[name], grads[name], RATIO, floor if name == "dq" else 1e-8)
        assert_close("dlog_gate", ref_gate.grad, gate.grad, RATIO, floor)
    torch.testing.assert_close(o[0], v[0], rtol=1e-5, atol=1e-5)


def test_gated_layer_trains_on_triton_as_on_chunk():
    """A gated Hedgehog layer of a tiny Llama (GQA), its gate trained away from the start: `attend` on the Triton
    kernels gives the chunk op's output and the same gradients for q, k, v and every parameter (feature map, decay
    rate, gate weights)."""
    from dofattn.model.student import attention_modules, linearize
    from tests.conftest import tiny_model

    model = tiny_model("llama").to(DEVICE)
    linearize(model, [20, 16, 9], Attention(feature="hedgehog", window=0, sink=0, decay="gate"), seed=1)
    layer = attention_modules(model)[0].dofattn
    with torch.no_grad():
        layer.decay.gate_weight.normal_(0, 2.0, generator=torch.Generator(DEVICE).manual_seed(2))
        layer.decay.decay_rate.copy_(torch.linspace(-4, 1, layer.num_heads))
    g = torch.Generator().manual_seed(3)
    H, D = layer.num_heads, layer.decay.gate_weight.shape[1]
    q, k, v = (torch.randn(2, 150, H, D, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    results = {}
    for backend in ("chunk", "triton"):
        layer.zero_grad()
        for x in (q, k, v):
            x.grad = None
        o, _ = layer.attend(q, k, v, backend=backend)
        (o * torch.linspace(-1, 1, o.numel(), device=DEVICE).view_as(o)).sum().backward()
        results[backend] = {"o": o.detach(), "dq": q.grad.clone(), "dk": k.grad.clone(), "dv": v.grad.clone(),
                            **{name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}}
    assert {"decay.gate_weight", "decay.decay_rate"} <= set(results["chunk"])
    assert results["chunk"].keys() == results["triton"].keys()
    for name, ref in results["chunk"].items():
        assert_close(name, ref, results["triton"][name], RATIO)


def test_bad_block():
    phi_q, phi_k, v, _ = on_device(make_inputs(1, 10, 1, 4, 4, with_state=False))
    with pytest.raises(ValueError, match="block must be a power of two >= 64"):
        scan.scan(phi_q, phi_k, v, block=96)
    with pytest.raises(ValueError, match="normalize needs with_den"):
        scan.scan(phi_q, phi_k, v, normalize=True)
    with pytest.raises(ValueError, match="delay is for the forward scan only"):
        scan.scan(phi_q, phi_k, v, reverse=True, delay=4)


# (M, V): narrow values (16-bit dots take a value tile of at least 64 columns, `common._value_tile`), and wide
# features (whose register budget would narrow the value tile)
HALF_SHAPES = [(64, 32), (20, 16)] + ([(203, 64), (256, 16)] if CUDA else [])


@pytest.mark.parametrize("shape", HALF_SHAPES, ids=[f"M{m}-V{v}" for m, v in HALF_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype, shape):
    """16-bit inputs: the dots run in 16 bit, sums and state in float32; near the float32 result."""
    skip_wrong_bf16_dots(dtype)
    phi_q, phi_k, v, state = on_device(make_inputs(2, 150, 3, *shape))
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    o, s = scan.triton_linear_attention(phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), state,
                                        output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close("o", ref_o, o, 2e-2)
    assert_close("ht", ref_s, s, 2e-2)


def test_zero_keys_and_tiny_features():
    phi_q, phi_k, v, _ = on_device(make_inputs(1, 70, 2, 5, 16, with_state=False))
    o, s = scan.triton_linear_attention(phi_q, torch.zeros_like(phi_k), v, output_final_state=True)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(s, torch.zeros_like(s))
    ref_o, _ = naive_linear_attention(phi_q, phi_k, v)
    o, _ = scan.triton_linear_attention(phi_q * 1e-10, phi_k * 1e-10, v)
    assert_close("o", ref_o, o, RATIO)


def test_prefill_then_decode_steps():
    """Triton prefill, then the one-kernel decode step in place, equal to the full naive run."""
    phi_q, phi_k, v, _ = on_device(make_inputs(2, 80, 3, 37, 16, with_state=False))
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, output_final_state=True)
    o, s = scan.triton_linear_attention(phi_q[:, :70], phi_k[:, :70], v[:, :70], output_final_state=True)
    outputs = [o]
    for t in range(70, 80):
        outputs.append(scan.triton_decode_step(phi_q[:, t:t + 1], phi_k[:, t:t + 1], v[:, t:t + 1], s, s))  # in place
    assert_close("o", ref_o, torch.cat(outputs, 1), RATIO)
    assert_close("ht", ref_s, s, RATIO)


def test_decode_step_rejects_bad_state():
    phi_q, phi_k, v, state = on_device(make_inputs(1, 1, 2, 5, 16))
    with pytest.raises(ValueError, match="one token .T = 1. and a contiguous float32 state"):
        scan.triton_decode_step(phi_q, phi_k, v, state.double())
    with pytest.raises(ValueError, match="initial_state must be"):
        scan.triton_decode_step(phi_q, phi_k, v, state[..., :4].contiguous())


@pytest.mark.skipif(not CUDA, reason="dispatch to triton needs CUDA")
def test_auto_picks_triton_on_cuda():
    phi_q, phi_k, v, state = on_device(make_inputs(1, 100, 3, 16, 16))
    assert pick_backend(phi_q) == "triton" and pick_backend(phi_q, decay=True) == "triton"
    assert pick_backend(phi_q, gate=True) == "triton" and pick_backend(phi_q[:, :1], gate=True) == "triton"
    ref_o, _ = naive_linear_attention(phi_q, phi_k, v, state)
    assert_close("o", ref_o, linear_attention(phi_q, phi_k, v, state)[0], RATIO)


@pytest.mark.parametrize("with_state", [False, True])
def test_one_token_without_grad_is_the_decode_step(with_state):
    """T = 1 outside autograd takes the one-kernel step; the input state is left as it was."""
    phi_q, phi_k, v, state = on_device(make_inputs(2, 1, 3, 10, 16, with_state))
    before = None if state is None else state.clone()
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    with torch.no_grad():
        o, s = scan.triton_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
        aug, _ = scan.triton_linear_attention(phi_q, phi_k, v, state, normalize=False)
    ref_aug, _ = naive_linear_attention(phi_q, phi_k, v, state, normalize=False)
    assert_close("o", ref_o, o, RATIO)
    assert_close("ht", ref_s, s, RATIO)
    assert_close("aug", ref_aug, aug, RATIO)
    if state is not None:
        assert torch.equal(state, before)
