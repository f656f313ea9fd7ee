"""dofattn's Triton kernels (`ops/fused.py`) against the naive reference: outputs, states and gradients.

    python -m pytest tests/test_fused.py -q

On CUDA the compiled kernels run. Without a GPU but with the `triton` package installed, the same kernels run in
Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are defined) on CPU tensors, slowly, so the
cases stay small. Without Triton every test here skips.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="needs the triton package")

from dofattn.ops import fused, linear_attention, naive_linear_attention, pick_backend   # noqa: E402
from tests.test_ops import assert_close, forward_backward, make_inputs                # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and Triton's interpreter is off", allow_module_level=True)

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
# Float32 dots run as tf32x3 on the GPU (about float32 accuracy); the interpreter computes in float32.
RATIO = 2e-4


def on_device(inputs):
    return [None if x is None else x.to(DEVICE) for x in inputs]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matches_naive(case):
    B, T, H, M, V, with_state = case
    inputs = on_device(make_inputs(B, T, H, M, V, with_state))
    ref_o, ref_s, ref_grads = forward_backward(naive_linear_attention, *[x.double() if x is not None else None
                                                                          for x in inputs])
    tri_o, tri_s, tri_grads = forward_backward(fused.triton_linear_attention, *inputs)
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
    o, d, _ = fused.scan(phi_q, phi_k, v, with_den=True, reverse=reverse, block=block)
    assert_close("o", ref_o, o, RATIO)
    assert_close("den", ref_d, d, RATIO)
    o, _, _ = fused.scan(phi_q, phi_k, v, with_den=True, reverse=reverse, normalize=True, block=block)
    assert_close("o/den", ref_o / ref_d[..., None], o, RATIO)
    o, d, _ = fused.scan(phi_q, phi_k, v, reverse=reverse, block=block)
    assert d is None
    assert_close("o", ref_o, o, RATIO)


def test_scan_states_over_blocks():
    """Final state over several blocks, from an initial state, with and without the normaliser column."""
    phi_q, phi_k, v, state = on_device(make_inputs(2, 300, 3, 20, 24))
    _, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    for block in (64, 128, 512):
        _, _, s = fused.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block)
        assert_close("ht", ref_s, s, RATIO)
        _, _, s = fused.scan(phi_q, phi_k, v, state, final_state=True, block=block)
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
    ref_o, ref_d, ref_s = fused.scan(phi_q, moved_k, moved_v, state, with_den=True, final_state=True, block=block)
    o, d, s = fused.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block, delay=delay)
    assert_close("o", ref_o, o, RATIO)
    assert_close("den", ref_d, d, RATIO)
    assert_close("ht", ref_s, s, RATIO)


# --- decay ------------------------------------------------------------------------------------------------------------


def decay_leaf(H: int) -> torch.Tensor:
    """log γ per head, strong to almost none (`test_ops.make_log_decay`), on the device, as a leaf."""
    from tests.test_ops import make_log_decay

    return make_log_decay(H).to(DEVICE).requires_grad_()


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
    tri_o, tri_s, tri_grads = forward_backward(fused.triton_linear_attention, *inputs, **{"log_" + kind: tri_leaf})
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
        o_ng, s_ng = fused.triton_linear_attention(*inputs, output_final_state=True, **kwargs)
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
    o, d, _ = fused.scan(phi_q, phi_k, v, with_den=True, reverse=reverse, block=block, **decay)
    assert_close("o", ref_o, o, RATIO)
    assert_close("den", ref_d, d, RATIO)
    o, d, _ = fused.scan(phi_q, phi_k, v, reverse=reverse, block=block, **decay)
    assert d is None
    assert_close("o", ref_o, o, RATIO)


@pytest.mark.parametrize("block", [64, 256])
def test_decay_states_over_blocks_and_delay(block):
    """Final state over several blocks from an initial state (γ^T S0 + Σ γ^(T−1−s) k ⊗ v), and `delay` W against
    keys and values moved W later by copying: the decay counts positions, so key s reaches t as γ^(t − W − s)."""
    phi_q, phi_k, v, state = on_device(make_inputs(2, 250, 3, 20, 24))
    log_decay = decay_leaf(3).detach()
    _, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True, log_decay=log_decay)
    _, _, s = fused.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block, log_decay=log_decay)
    assert_close("ht", ref_s, s, RATIO)
    for delay in (16, 64, 300):
        moved_k, moved_v = (torch.nn.functional.pad(x, (0, 0, 0, 0, delay, 0))[:, :250].contiguous()
                            for x in (phi_k, v))
        ref_o, ref_s = naive_linear_attention(phi_q, moved_k, moved_v, state, output_final_state=True,
                                              normalize=False, log_decay=log_decay)
        o, d, s = fused.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block, delay=delay,
                             log_decay=log_decay)
        assert_close("o", ref_o[..., :-1], o, RATIO, floor=1e-6)
        assert_close("den", ref_o[..., -1], d, RATIO, floor=1e-6)
        assert_close("ht", ref_s, s, RATIO)


def test_decay_refuses_states_in_reverse():
    phi_q, phi_k, v, state = on_device(make_inputs(1, 10, 1, 4, 4))
    with pytest.raises(ValueError, match="with a decay or a gate, an initial or final state is for the forward"):
        fused.scan(phi_q, phi_k, v, state, reverse=True, log_decay=torch.zeros(1, device=DEVICE))


def test_decay_limits_and_strong_decay_stay_finite():
    """log γ = −inf and a positive value (clamped to γ = 0 and 1) and e^-200 over 300 tokens: finite outputs and
    gradients, equal to the spec; a head that forgets everything outputs each token's own value."""
    phi_q, phi_k, v, state = on_device(make_inputs(1, 300, 3, 5, 4))
    for log_decay in (torch.tensor([-torch.inf, 3.0, -200.0]), torch.tensor([-1e4, 0.0, -1e-6])):
        log_decay = log_decay.to(DEVICE)
        ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, True, log_decay=log_decay)
        decay = log_decay.clone().requires_grad_()
        o, s, grads = forward_backward(fused.triton_linear_attention, phi_q, phi_k, v, state, log_decay=decay)
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
    o, s = fused.triton_linear_attention(phi_q[:, :70], phi_k[:, :70], v[:, :70], output_final_state=True,
                                         **tokens(0, 70))
    outputs = [o]
    for t in range(70, 80):
        outputs.append(fused.triton_decode_step(phi_q[:, t:t + 1], phi_k[:, t:t + 1], v[:, t:t + 1], s, s,
                                                **tokens(t, t + 1)))
    assert_close("o", ref_o, torch.cat(outputs, 1), RATIO)
    assert_close("ht", ref_s, s, RATIO)
    with torch.no_grad():                              # T = 1 through the entry point: the same step, a new state
        o1, s1 = fused.triton_linear_attention(phi_q[:, :1], phi_k[:, :1], v[:, :1], ref_s, True, **tokens(0, 1))
    ref_o1, ref_s1 = naive_linear_attention(phi_q[:, :1], phi_k[:, :1], v[:, :1], ref_s, True, **tokens(0, 1))
    assert_close("o1", ref_o1, o1, RATIO)
    assert_close("ht1", ref_s1, s1, RATIO)


@pytest.mark.parametrize("kind", ["decay", "gate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decay_and_gate_half_inputs(dtype, kind):
    """16-bit inputs with a decay or a gate: the decayed keys go to 16 bits for the dots, sums and state stay
    float32."""
    if not CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter gets bf16 dots wrong (off by 1e9 on a plain 16×16 product)")
    phi_q, phi_k, v, state = on_device(make_inputs(2, 150, 3, 64, 32))
    decay = {"log_decay": decay_leaf(3).detach()} if kind == "decay" else {"log_gate": gate_leaf(2, 150, 3).detach()}
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True, **decay)
    o, s = fused.triton_linear_attention(phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), state,
                                         output_final_state=True, **decay)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close("o", ref_o, o, 2e-2)
    assert_close("ht", ref_s, s, 2e-2)


# --- gate ---------------------------------------------------------------------------------------------------------


def gate_leaf(B: int, T: int, H: int) -> torch.Tensor:
    """Log gates [B, T, H], mostly weak with some strong (`test_ops.make_log_gate`), on the device, as a leaf."""
    from tests.test_ops import make_log_gate

    return make_log_gate(B, T, H).to(DEVICE).requires_grad_()


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
    _, _, s = fused.scan(phi_q, phi_k, v, state, with_den=True, final_state=True, block=block, log_gate=log_gate)
    assert_close("ht", ref_s, s, RATIO)


def test_gate_refuses_what_it_does_not_cover():
    phi_q, phi_k, v, state = on_device(make_inputs(1, 10, 1, 4, 4))
    gate = torch.zeros(1, 10, 1, device=DEVICE)
    with pytest.raises(ValueError, match="with a decay or a gate, an initial or final state is for the forward"):
        fused.scan(phi_q, phi_k, v, state, reverse=True, log_gate=gate)
    with pytest.raises(ValueError, match="a gate takes no decay and no delay"):
        fused.scan(phi_q, phi_k, v, delay=4, log_gate=gate)
    with pytest.raises(ValueError, match="a gate takes no decay and no delay"):
        fused.scan(phi_q, phi_k, v, log_decay=torch.zeros(1, device=DEVICE), log_gate=gate)
    with pytest.raises(ValueError, match="log_decay and log_gate do not combine"):
        fused.triton_linear_attention(phi_q, phi_k, v, log_decay=torch.zeros(1, device=DEVICE), log_gate=gate)


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
        o, s, grads = forward_backward(fused.triton_linear_attention, phi_q, phi_k, v, state, log_gate=gate)
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
    from dofattn.student import attention_modules, linearize
    from tests.conftest import tiny_model

    model = tiny_model("llama").to(DEVICE)
    linearize(model, dims=[20, 16, 9], feature="hedgehog", gate=True, seed=1)
    layer = attention_modules(model)[0].dofattn
    with torch.no_grad():
        layer.gate_weight.normal_(0, 2.0, generator=torch.Generator(DEVICE).manual_seed(2))
        layer.decay_rate.copy_(torch.linspace(-4, 1, layer.num_heads))
    g = torch.Generator().manual_seed(3)
    H, D = layer.num_heads, layer.gate_weight.shape[1]
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
    assert {"gate_weight", "decay_rate"} <= set(results["chunk"])
    assert results["chunk"].keys() == results["triton"].keys()
    for name, ref in results["chunk"].items():
        assert_close(name, ref, results["triton"][name], RATIO)


def test_bad_block():
    phi_q, phi_k, v, _ = on_device(make_inputs(1, 10, 1, 4, 4, with_state=False))
    with pytest.raises(ValueError, match="block must be a power of two >= 64"):
        fused.scan(phi_q, phi_k, v, block=96)
    with pytest.raises(ValueError, match="normalize needs with_den"):
        fused.scan(phi_q, phi_k, v, normalize=True)
    with pytest.raises(ValueError, match="delay is for the forward scan only"):
        fused.scan(phi_q, phi_k, v, reverse=True, delay=4)


# (M, V): narrow values (a 16-bit dot against a 32-column value tile faulted on an H100), and wide features (whose
# register budget used to narrow the tile)
HALF_SHAPES = [(64, 32), (20, 16)] + ([(203, 64), (256, 16)] if CUDA else [])


@pytest.mark.parametrize("shape", HALF_SHAPES, ids=[f"M{m}-V{v}" for m, v in HALF_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype, shape):
    """16-bit inputs: the dots run in 16 bit, sums and state in float32; near the float32 result."""
    if not CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter gets bf16 dots wrong (off by 1e9 on a plain 16×16 product)")
    phi_q, phi_k, v, state = on_device(make_inputs(2, 150, 3, *shape))
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
    o, s = fused.triton_linear_attention(phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), state,
                                         output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close("o", ref_o, o, 2e-2)
    assert_close("ht", ref_s, s, 2e-2)


def test_zero_keys_and_tiny_features():
    phi_q, phi_k, v, _ = on_device(make_inputs(1, 70, 2, 5, 16, with_state=False))
    o, s = fused.triton_linear_attention(phi_q, torch.zeros_like(phi_k), v, output_final_state=True)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(s, torch.zeros_like(s))
    ref_o, _ = naive_linear_attention(phi_q, phi_k, v)
    o, _ = fused.triton_linear_attention(phi_q * 1e-10, phi_k * 1e-10, v)
    assert_close("o", ref_o, o, RATIO)


def test_prefill_then_decode_steps():
    """Triton prefill, then the one-kernel decode step in place, equal to the full naive run."""
    phi_q, phi_k, v, _ = on_device(make_inputs(2, 80, 3, 37, 16, with_state=False))
    ref_o, ref_s = naive_linear_attention(phi_q, phi_k, v, output_final_state=True)
    o, s = fused.triton_linear_attention(phi_q[:, :70], phi_k[:, :70], v[:, :70], output_final_state=True)
    outputs = [o]
    for t in range(70, 80):
        outputs.append(fused.triton_decode_step(phi_q[:, t:t + 1], phi_k[:, t:t + 1], v[:, t:t + 1], s, s))  # in place
    assert_close("o", ref_o, torch.cat(outputs, 1), RATIO)
    assert_close("ht", ref_s, s, RATIO)


def test_decode_step_rejects_bad_state():
    phi_q, phi_k, v, state = on_device(make_inputs(1, 1, 2, 5, 16))
    with pytest.raises(ValueError, match="one token .T = 1. and a contiguous float32 state"):
        fused.triton_decode_step(phi_q, phi_k, v, state.double())
    with pytest.raises(ValueError, match="initial_state must be"):
        fused.triton_decode_step(phi_q, phi_k, v, state[..., :4].contiguous())


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
        o, s = fused.triton_linear_attention(phi_q, phi_k, v, state, output_final_state=True)
        aug, _ = fused.triton_linear_attention(phi_q, phi_k, v, state, normalize=False)
    ref_aug, _ = naive_linear_attention(phi_q, phi_k, v, state, normalize=False)
    assert_close("o", ref_o, o, RATIO)
    assert_close("ht", ref_s, s, RATIO)
    assert_close("aug", ref_aug, aug, RATIO)
    if state is not None:
        assert torch.equal(state, before)


def prf_map(H=3, D=16, M=37, head_dims=(37, 20, 5), seed=0):
    """A learned PRF map with random log-weights and a key shift calibrated on large keys (exponents ~ 100)."""
    from dofattn.features import make_feature_map

    fmap = make_feature_map("prf", H, D, M, scaling=D ** -0.5, seed=seed, head_dims=list(head_dims)).to(DEVICE)
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
        phi, scale = fused.prf_features(fmap, x, role, MAX_KEY_EXCESS)
        assert_close(role, ref_phi, phi, RATIO)
        assert torch.equal(phi[..., 5:][:, :, 2], torch.zeros_like(phi[..., 5:][:, :, 2]))   # head 2: 5 features
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
        phi, scale = fused.prf_features(fmap, x, role, MAX_KEY_EXCESS)
        assert phi.dtype == torch.bfloat16
        assert_close(role, ref_phi, phi, 1e-2)
        if role == "query":
            assert_close("scale", ref_scale, scale, 1e-5)


def test_prf_decode_step_matches_the_layer():
    """The one-kernel step (features + state update + output, GQA) against features + the naive op."""
    from dofattn.features import MAX_KEY_EXCESS

    fmap = prf_map(H=4, M=24, head_dims=(24, 24, 10, 3))
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, D, V = 2, 4, 2, 16, 16
    q = 3 * torch.randn(B, 1, H, D, generator=g).to(DEVICE)
    k, v = (3 * torch.randn(B, 1, Hkv, D, generator=g).to(DEVICE) for _ in range(2))
    state = torch.rand(B, H, 24, V + 1, generator=g).to(DEVICE)
    k_h, v_h = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    ref_o, ref_s = naive_linear_attention(torch_features(fmap, q, "query")[0], torch_features(fmap, k_h, "key")[0],
                                          v_h, state, output_final_state=True)
    before = state.clone()
    o = fused.prf_decode_step(fmap, q, k, v, state, MAX_KEY_EXCESS)
    assert_close("o", ref_o, o, RATIO)
    assert_close("ht", ref_s, state, RATIO)                                            # updated in place
    # a padding token (row 1) leaves its state alone; row 0 steps as before
    state = before.clone()
    fused.prf_decode_step(fmap, q, k, v, state, MAX_KEY_EXCESS, torch.tensor([[True], [False]], device=DEVICE))
    assert_close("ht0", ref_s[:1], state[:1], RATIO)
    assert torch.equal(state[1], before[1])
    with pytest.raises(ValueError, match="contiguous float32 state"):
        fused.prf_decode_step(fmap, q, k, v, state.double(), MAX_KEY_EXCESS)
    # with a decay: γ S + φk ⊗ [v, 1]; a padding token adds no key, but its step still decays the state
    log_decay = torch.tensor([-2.0, -0.05, -1e-4, -0.3], device=DEVICE)
    ref_o, ref_s = naive_linear_attention(torch_features(fmap, q, "query")[0], torch_features(fmap, k_h, "key")[0],
                                          v_h, before, output_final_state=True, log_decay=log_decay)
    state = before.clone()
    o = fused.prf_decode_step(fmap, q, k, v, state, MAX_KEY_EXCESS, torch.tensor([[True], [False]], device=DEVICE),
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
    from dofattn.student import attention_modules, linearize
    from tests.conftest import tiny_model

    model = tiny_model(family).cuda()
    linearize(model, dims=[9, 16, 5], feature="prf", seed=1, decay=decay)
    if decay:                                         # half-lives from under a token to hundreds
        with torch.no_grad():
            for module in attention_modules(model):
                module.dofattn.decay_rate.copy_(torch.linspace(0.5, -6, module.dofattn.num_heads))
    calls = []
    step = fused.prf_decode_step
    monkeypatch.setattr(fused, "prf_decode_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    prompt = torch.randint(3, 300, (1, 11), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences, use_cache=False).logits
    assert len(calls) == 3 * 19
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, prompt.shape[1] - 1: -1], rtol=1e-3, atol=1e-3)


# (B, T, H, D, M, V, window, key padding, initial state, block)
WINDOW_CASES = [
    (1, 5, 1, 8, 5, 4, 16, False, False, None),
    (2, 100, 2, 8, 20, 16, 16, True, True, 64),
    (1, 300, 3, 16, 37, 8, 32, False, True, 128),
    (1, 200, 1, 16, 24, 16, 64, True, False, None),
    (2, 130, 2, 16, 128, 16, 64, True, True, 64),
    (1, 90, 1, 16, 203, 16, 32, True, True, 64),      # features past 128: the scan's wide-tile launch
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=[f"T{c[1]}-M{c[4]}-W{c[6]}{'-pad' if c[7] else ''}"
                                                     f"{'-S0' if c[8] else ''}" for c in WINDOW_CASES])
def test_window_forward_matches_the_spec(case):
    """The Triton hybrid against `naive_window_linear_attention`: outputs and the state left after the window."""
    from dofattn.ops.window import naive_window_linear_attention

    W, block = case[6], case[9]
    args, key_valid, state = window_case(case)
    extra = [key_valid, state]
    ref_o, ref_s = naive_window_linear_attention(*args, 0.3, W, *extra, output_final_state=True)
    o, s = fused.window_forward(*args, 0.3, W, *extra, output_final_state=True, block=block)
    rows = slice(None) if key_valid is None else key_valid    # padded queries' outputs are unused
    assert_close("o", ref_o[rows], o[rows], RATIO)
    assert_close("ht", ref_s, s, RATIO, floor=1.0)


def window_case(case, logit_scale: float = 1.0):
    """Inputs of a WINDOW_CASES row: ([q, k, v, phi_q, phi_k, q_log_scale, log_offset], key_valid, state)."""
    B, T, H, D, M, V, W, padded, with_state, block = case
    g = torch.Generator().manual_seed(T + M)
    q, k = (logit_scale * torch.randn(B, T, H, D, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    phi_q, phi_k = (torch.rand(B, T, H, M, generator=g) for _ in range(2))
    q_log_scale, log_offset = torch.randn(B, T, H, generator=g), torch.randn(H, generator=g)
    key_valid = None
    if padded:                                          # left padding, as batched generation makes it
        key_valid = torch.ones(B, T, dtype=torch.bool)
        key_valid[-1, :T // 3] = False
    state = torch.rand(B, H, M, V + 1, generator=g) if with_state else None
    return on_device([q, k, v, phi_q, phi_k, q_log_scale, log_offset]), *on_device([key_valid, state])


def window_forward_backward(op, args, key_valid, state, W, **kwargs):
    """op with random upstream gradients on o (valid rows) and on the final state: (o, state, grads)."""
    names = ["q", "k", "v", "phi_q", "phi_k", "q_log_scale", "log_offset", "state"]
    leaves = [x.detach().clone().requires_grad_() for x in [*args, state] if x is not None]
    o, final = op(*leaves[:7], 0.3, W, key_valid, leaves[7] if state is not None else None,
                  output_final_state=True, **kwargs)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=g).to(o.device)
    if key_valid is not None:                           # padded queries' outputs are unused
        do = do * key_valid[:, :, None, None]
    dht = torch.randn(final.shape, generator=g).to(final.device)
    ((o * do).sum() + (final * dht).sum()).backward()
    return o, final, dict(zip(names, (x.grad for x in leaves)))


@pytest.mark.parametrize("case", WINDOW_CASES, ids=[f"T{c[1]}-M{c[4]}-W{c[6]}{'-pad' if c[7] else ''}"
                                                     f"{'-S0' if c[8] else ''}" for c in WINDOW_CASES])
def test_window_backward_matches_the_spec(case):
    """Gradients of the Triton hybrid (exact-part kernel + the scan's backward on delayed keys) against autograd
    through `naive_window_linear_attention`, for every input: q, k, v, both feature maps, the log-scales and the
    initial state, from the output and the final state."""
    check_window_against_spec(case)


def check_window_against_spec(case, spec_kwargs=None, fused_kwargs=None):
    """The spec and the Triton hybrid on a WINDOW_CASES row, each with its extra arguments, agree on the output
    (valid rows), the final state and every input's gradient. Returns (the hybrid's o, args, key_valid, state)."""
    from dofattn.ops.window import naive_window_linear_attention

    W, block = case[6], case[9]
    args, key_valid, state = window_case(case)
    ref_o, ref_s, ref_g = window_forward_backward(naive_window_linear_attention, args, key_valid, state, W,
                                                  **(spec_kwargs or {}))
    o, s, grads = window_forward_backward(fused.window_forward, args, key_valid, state, W, block=block,
                                          **(fused_kwargs or {}))
    rows = slice(None) if key_valid is None else key_valid
    assert_close("o", ref_o[rows], o[rows], RATIO)
    assert_close("ht", ref_s, s, RATIO, floor=1.0)
    assert sorted(grads) == sorted(ref_g)
    for name in grads:
        assert_close(name, ref_g[name], grads[name], RATIO, floor=1.0)
    with torch.no_grad():                               # a prefill: the kernels without autograd's Function
        o_ng, s_ng = fused.window_forward(*args, 0.3, W, key_valid, state, output_final_state=True, block=block,
                                          **(fused_kwargs or {}))
    assert_close("o without grad", ref_o[rows], o_ng[rows], RATIO)
    assert_close("ht without grad", ref_s, s_ng, RATIO, floor=1.0)
    return o, args, key_valid, state


@pytest.mark.parametrize("case", WINDOW_CASES[1:5], ids=[f"T{c[1]}-M{c[4]}-W{c[6]}{'-pad' if c[7] else ''}"
                                                          f"{'-S0' if c[8] else ''}" for c in WINDOW_CASES[1:5]])
def test_window_decay_matches_the_spec(case):
    """The Triton hybrid with a decay of the linear part (γ^(t − W − s) beyond the window, S0 as γ^(t+1)):
    outputs, the final state and every gradient, log γ included, against autograd through the spec."""
    ref_decay, tri_decay = decay_leaf(case[2]), decay_leaf(case[2])
    check_window_against_spec(case, {"log_decay": ref_decay}, {"log_decay": tri_decay})
    assert_close("dlog_decay", ref_decay.grad, tri_decay.grad, RATIO, floor=1.0)


@pytest.mark.parametrize("sink", [1, 4, 17])            # 17: a block of 32 sink columns
@pytest.mark.parametrize("case", WINDOW_CASES[:5], ids=[f"T{c[1]}-M{c[4]}-W{c[6]}{'-pad' if c[7] else ''}"
                                                         f"{'-S0' if c[8] else ''}" for c in WINDOW_CASES[:5]])
def test_window_sink_matches_the_spec(case, sink):
    """The Triton hybrid with an attention sink (the first real keys exact for every query, out of the linear part
    and the state): outputs, the final state and every gradient against autograd through the spec."""
    from dofattn.ops.window import first_keys

    B, T, W = case[0], case[1], case[6]
    key_valid = window_case(case)[1]
    sink_mask = first_keys(key_valid, B, T, sink, DEVICE)
    o, args, key_valid, state = check_window_against_spec(case, {"sink_mask": sink_mask}, {"sink_mask": sink_mask})
    rows = slice(None) if key_valid is None else key_valid
    if T > W + sink:                                   # the sink changes the result where it lies beyond the window
        plain, _ = fused.window_forward(*args, 0.3, W, key_valid, state)
        assert (plain[rows] - o[rows]).abs().max() > 1e-3


def test_sink_positions():
    """Each row's sink positions in order, then −1, in a block of at least 16 columns; None when no row has one."""
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[0, :4] = True
    mask[1, 30:33] = True                               # a left-padded row: its first real keys
    pos = fused.sink_positions(mask)
    assert pos.dtype == torch.int32 and pos.shape == (3, 16)
    assert pos[0, :5].tolist() == [0, 1, 2, 3, -1] and pos[1, :4].tolist() == [30, 31, 32, -1]
    assert (pos[2] == -1).all() and (pos[:, 4:] == -1).all()
    mask[2] = True
    assert fused.sink_positions(mask).shape == (3, 64)
    assert fused.sink_positions(torch.zeros(2, 9, dtype=torch.bool)) is None


def test_window_sink_with_exponents_near_200():
    """Sink logits near 200 beside linear masses near e^0, without autograd: the three parts mix in log space."""
    from dofattn.ops.window import first_keys, naive_window_linear_attention

    case = (1, 90, 2, 16, 12, 8, 16, True, True, None)
    args, key_valid, state = window_case(case, logit_scale=6.0)
    sink_mask = first_keys(key_valid, 1, 90, 4, args[0].device)
    ref, _ = naive_window_linear_attention(*args, 0.3, 16, key_valid, state, sink_mask=sink_mask)
    with torch.no_grad():
        o, _ = fused.window_forward(*args, 0.3, 16, key_valid, state, sink_mask=sink_mask)
    assert torch.isfinite(o).all()
    assert_close("o", ref[key_valid], o[key_valid], RATIO)


def test_window_sink_refuses_a_decay():
    args, key_valid, state = window_case(WINDOW_CASES[1])
    sink_mask = torch.zeros(key_valid.shape, dtype=torch.bool, device=key_valid.device)
    with pytest.raises(ValueError, match="sink_mask and log_decay"):
        fused.window_forward(*args, 0.3, 16, key_valid, state, sink_mask=sink_mask,
                             log_decay=torch.zeros(2, device=key_valid.device))


def test_window_backward_with_exponents_near_200():
    """Exact logits up to ~200 (SmolLM2 reaches 195) against linear masses near e^0: nothing overflows and the
    gradients still match the spec, which normalises by the row maximum."""
    from dofattn.ops.window import naive_window_linear_attention

    case = (1, 90, 2, 16, 12, 8, 16, True, True, None)
    args, key_valid, state = window_case(case, logit_scale=6.0)
    top = (0.3 * torch.einsum("bthd,bshd->bhts", args[0], args[1])).amax().item()
    assert 150 < top < 260, top
    ref_o, _, ref_g = window_forward_backward(naive_window_linear_attention, args, key_valid, state, 16)
    o, _, grads = window_forward_backward(fused.window_forward, args, key_valid, state, 16)
    assert_close("o", ref_o[key_valid], o[key_valid], RATIO)
    for name in grads:
        assert_close(name, ref_g[name], grads[name], 1e-3, floor=1.0)


def test_window_forward_refuses_what_it_does_not_cover():
    x = on_device([torch.rand(1, 10, 1, 8)])[0]
    phi = on_device([torch.rand(1, 10, 1, 4)])[0]
    scale, offset = on_device([torch.zeros(1, 10, 1), torch.zeros(1)])
    with pytest.raises(ValueError, match="windows \\(16, 32, 64\\)"):
        fused.window_forward(x, x, x, phi, phi, scale, offset, 0.3, 8)


@pytest.mark.skipif(not CUDA, reason="dispatch to the fused hybrid needs CUDA")
def test_window_dispatch_on_cuda(monkeypatch):
    """Without autograd a CUDA prefill takes the Triton hybrid; with autograd the PyTorch form, unless the Triton
    backend is asked for by name."""
    from dofattn.ops import window

    calls = []
    forward = fused.window_forward
    monkeypatch.setattr(fused, "window_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 150, 2, 16, generator=g).cuda() for _ in range(3))
    phi_q, phi_k = (torch.rand(1, 150, 2, 24, generator=g).cuda() for _ in range(2))
    scale, offset = torch.randn(1, 150, 2, generator=g).cuda(), torch.randn(2, generator=g).cuda()
    ref, _ = window.naive_window_linear_attention(q, k, v, phi_q, phi_k, scale, offset, 0.25, 64)
    with torch.no_grad():
        o, _ = window.window_linear_attention(q, k, v, phi_q, phi_k, scale, offset, 0.25, 64)
    assert calls == [1]
    assert_close("o", ref, o, RATIO)
    o, _ = window.window_linear_attention(q, k, v, phi_q.requires_grad_(), phi_k, scale, offset, 0.25, 64)
    assert calls == [1]
    assert_close("o", ref, o, RATIO)
    o, _ = window.window_linear_attention(q, k, v, phi_q, phi_k, scale, offset, 0.25, 64, backend="triton")
    assert calls == [1, 1] and o.requires_grad
    assert_close("o", ref, o, RATIO)
    sink_mask = window.first_keys(None, 1, 150, 4, q.device)
    ref, _ = window.naive_window_linear_attention(q, k, v, phi_q, phi_k, scale, offset, 0.25, 64, sink_mask=sink_mask)
    with torch.no_grad():
        o, _ = window.window_linear_attention(q, k, v, phi_q, phi_k, scale, offset, 0.25, 64, sink_mask=sink_mask)
    assert calls == [1, 1, 1]
    assert_close("o", ref, o, RATIO)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_forward_half_near_float32(dtype):
    """16-bit inputs: the exact part's dots run in 16 bit too (exact products, weights rounded for the values)."""
    from dofattn.ops.window import naive_window_linear_attention

    if not CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter gets bf16 dots wrong")

    g = torch.Generator().manual_seed(5)
    q, k = (3 * torch.randn(2, 300, 3, 64, generator=g) for _ in range(2))
    v = torch.randn(2, 300, 3, 64, generator=g)
    phi_q, phi_k = (torch.rand(2, 300, 3, 96, generator=g) for _ in range(2))
    scale, offset = torch.randn(2, 300, 3, generator=g), torch.randn(3, generator=g)
    args = on_device([q, k, v, phi_q, phi_k, scale, offset])
    ref, _ = naive_window_linear_attention(*args, 0.125, 64)
    o, _ = fused.window_forward(*[x.to(dtype) if x.dim() == 4 else x for x in args], 0.125, 64)
    assert o.dtype == dtype
    assert_close("o", ref, o, 2e-2)


# --- the window hybrid's static decode step -------------------------------------------------------------------------

# (W, S, H, Hkv, D, M, decay, prompt, dtype): a ring of W slots after a prompt, S sink tokens, GQA or not; M and
# V + 1 = D + 1 not powers of two. A prompt under W leaves empty slots (the ring fills during the steps); over W the
# ring has wrapped; sink tokens sit in the ring as empty slots, which a later step must not fold.
RING_CASES = [
    (1, 0, 4, 2, 24, 37, True, 1, torch.float32),
    (1, 1, 4, 4, 24, 37, False, 2, torch.float32),
    (5, 0, 4, 2, 24, 37, False, 2, torch.float32),
    (5, 1, 4, 4, 40, 37, False, 3, torch.float32),
    (5, 4, 4, 2, 40, 37, False, 6, torch.float16),
    (5, 0, 4, 4, 24, 37, True, 3, torch.float16),
    (64, 4, 4, 2, 24, 37, False, 62, torch.float32),
    (64, 0, 4, 2, 40, 37, True, 66, torch.float32),
]
RING_IDS = [f"W{c[0]}-S{c[1]}-H{c[2]}kv{c[3]}-D{c[4]}{'-decay' if c[6] else ''}-p{c[7]}-{str(c[8])[6:]}"
            for c in RING_CASES]


def ring_case(W, S, H, Hkv, D, M, decay, prompt, dtype, steps, scale=2.0):
    """A PRF window hybrid (random log-weights, gains and decays; a head with fewer features) after a PyTorch
    prefill of `prompt` tokens (training mode: calibrates the key shift), two rings of its cache (each its own
    buffers), their position tensors and the `steps` tokens after the prompt (q [B, steps, H, D], k, v)."""
    import copy

    from dofattn.attention import LinearAttention, LinearStateLayer, RingWindowLayer
    from dofattn.features import make_feature_map

    g = torch.Generator().manual_seed(W + 7 * S + D)
    fmap = make_feature_map("prf", H, D, M, scaling=D ** -0.5, seed=3, head_dims=[M, 20, 5, M][:H])
    layer = LinearAttention(fmap, H, Hkv, W, decay, sink=S)
    with torch.no_grad():
        fmap.log_weights.copy_(torch.randn(H, M, generator=g))
        layer.log_gain.copy_(torch.randn(H, generator=g))
        if decay:                                      # half-lives from under a token to hundreds
            layer.decay_rate.copy_(torch.linspace(0.5, -6, H))
    layer = layer.to(DEVICE)
    q = scale * torch.randn(2, prompt + steps, H, D, generator=g)
    k = scale * torch.randn(2, prompt + steps, Hkv, D, generator=g)
    v = torch.randn(2, prompt + steps, Hkv, D, generator=g)
    q, k, v = (x.to(DEVICE, dtype) for x in (q, k, v))
    cache = LinearStateLayer()
    with torch.no_grad():
        layer(q[:, :prompt], k[:, :prompt], v[:, :prompt], cache=cache)
    layer.eval()
    cache.seen = prompt
    rings, positions = [], []
    for _ in range(2):
        positions.append(torch.tensor([prompt], device=DEVICE))
        rings.append(RingWindowLayer.from_layer(copy.deepcopy(cache), W, positions[-1]))
    return layer, rings, positions, (q[:, prompt:], k[:, prompt:], v[:, prompt:])


def ring_steps(layer, rings, positions, qkv, monkeypatch):
    """Each token through the PyTorch ring step (ring 0, backend naive) and the kernel (ring 1, backend triton);
    -> (outputs of each [B, steps, H, V], calls of `fused.prf_ring_step`)."""
    calls = []
    step = fused.prf_ring_step
    monkeypatch.setattr(fused, "prf_ring_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    outputs = ([], [])
    with torch.no_grad():
        for t in range(qkv[0].shape[1]):
            for i, backend in enumerate(("naive", "triton")):
                outputs[i].append(layer(*(x[:, t:t + 1] for x in qkv), cache=rings[i], backend=backend))
                positions[i].add_(1)
    return [torch.cat(o, 1) for o in outputs], len(calls)


@pytest.mark.parametrize("case", RING_CASES, ids=RING_IDS)
def test_prf_ring_step_matches_the_ring_step(case, monkeypatch):
    """Six steps of the one-kernel ring step against the PyTorch one: outputs, the state, the ring's keys, values
    and flags (the same bits: copies), and the arrivals count back at 0 after each step."""
    layer, rings, positions, qkv = ring_case(*case, steps=6)
    (ref, out), calls = ring_steps(layer, rings, positions, qkv, monkeypatch)
    assert calls == 6 and out.dtype == ref.dtype
    half = case[-1] != torch.float32
    assert_close("o", ref, out, 2e-3 if half else 1e-5)
    assert_close("ht", rings[0].state, rings[1].state, 1e-2 if half and CUDA else 1e-5)   # CUDA: 16-bit features
    for name in ("keys", "values", "key_valid"):
        assert torch.equal(getattr(rings[0], name), getattr(rings[1], name)), name
    assert rings[1].key_valid.all() == (case[7] + 6 >= case[0] + case[1])       # filled, but for the sink's slots
    assert torch.equal(rings[1].arrivals, torch.zeros_like(rings[1].arrivals))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prf_ring_step_with_exponents_near_200(dtype, monkeypatch):
    """Exact logits near 200 beside the sink's and a linear mass near e^0 (SmolLM2 reaches 195): one normalisation
    under the running max, nothing overflows in float32 or bfloat16."""
    layer, rings, positions, (q, k, v) = ring_case(5, 4, 4, 2, 24, 37, False, 12, dtype, steps=3, scale=7.0)
    top = (layer.feature_map.scaling * torch.einsum("bthd,bshd->bhts", q.float(),
                                                    k.float().repeat_interleave(2, 2))).amax().item()
    assert 150 < top < 400, top
    (ref, out), calls = ring_steps(layer, rings, positions, (q, k, v), monkeypatch)
    assert calls == 3 and torch.isfinite(out).all() and torch.isfinite(rings[1].state).all()
    assert_close("o", ref, out, 1e-5 if dtype == torch.float32 else 1e-2)
    assert_close("ht", rings[0].state, rings[1].state, 1e-5 if dtype == torch.float32 or not CUDA else 1e-2)


def test_prf_ring_step_dispatch(monkeypatch):
    """Backend auto takes the kernel on CUDA only (on CPU the PyTorch step); a map other than PRF, or autograd,
    never; and the op refuses a ring it cannot update in place."""
    from dofattn.features import MAX_KEY_EXCESS

    layer, rings, positions, qkv = ring_case(5, 0, 4, 2, 24, 37, False, 3, torch.float32, steps=1)
    ring = rings[1]
    with torch.no_grad():
        assert layer.one_kernel_ring(qkv[0], ring, "auto") == CUDA
        assert layer.one_kernel_ring(qkv[0], ring, "triton")
        assert not layer.one_kernel_ring(qkv[0], ring, "naive")
        layer.train()
        assert not layer.one_kernel_ring(qkv[0], ring, "triton")   # training would move the key shift
        layer.eval()
    assert not layer.one_kernel_ring(qkv[0], ring, "triton")       # autograd: the parameters want gradients
    q, k, v = (x[:, :1] for x in qkv)
    with pytest.raises(ValueError, match="contiguous buffers shaped"):
        fused.prf_ring_step(layer.feature_map, q, k, v, ring.state, ring.keys.transpose(0, 1), ring.values,
                            ring.key_valid, ring.position, layer.log_gain, MAX_KEY_EXCESS)
    with pytest.raises(ValueError, match="contiguous float32 state"):
        fused.prf_ring_step(layer.feature_map, q, k, v, ring.state.double(), ring.keys, ring.values, ring.key_valid,
                            ring.position, layer.log_gain, MAX_KEY_EXCESS)
