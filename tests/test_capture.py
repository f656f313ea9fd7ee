"""Capture gives the attention's real inputs (checked against a hand computation) and leaves outputs unchanged."""

import pytest
import torch

from dofattn.model.capture import AttentionInputs, capture, run_forward
from tests.conftest import tiny_model


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, dims: int) -> torch.Tensor:
    """Rotary embedding on the first `dims` features of x [B, T, H, D] (halves layout), by hand."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    angles = positions[:, None].double() * inv_freq[None]                  # [T, dims/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None]      # [1, T, 1, dims]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None]
    rot, rest = x[..., :dims].double(), x[..., dims:]
    half = dims // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([(rot * cos + rotated * sin).to(x.dtype), rest], -1)


def hand_qkv(family: str, model, layer: int, hidden: torch.Tensor):
    """q [B,T,H,D], k and v [B,T,Hkv,D] of `layer` from its input hidden states, without the model's attention."""
    cfg = model.config
    B, T, _ = hidden.shape
    pos = torch.arange(T)
    if family == "llama":
        attn = model.model.layers[layer].self_attn
        d = cfg.hidden_size // cfg.num_attention_heads
        q = attn.q_proj(hidden).view(B, T, -1, d)
        k = attn.k_proj(hidden).view(B, T, -1, d)
        v = attn.v_proj(hidden).view(B, T, -1, d)
        return rotate(q, pos, 1e4, d), rotate(k, pos, 1e4, d), v
    if family == "gpt_neox":
        attn = model.gpt_neox.layers[layer].attention
        d = cfg.hidden_size // cfg.num_attention_heads
        qkv = attn.query_key_value(hidden).view(B, T, -1, 3 * d)
        q, k, v = qkv.chunk(3, dim=-1)
        return rotate(q, pos, 1e4, d // 4), rotate(k, pos, 1e4, d // 4), v
    attn = model.transformer.h[layer].attn
    d = cfg.n_embd // cfg.n_head
    q, k, v = attn.c_attn(hidden).split(cfg.n_embd, dim=2)
    return q.view(B, T, -1, d), k.view(B, T, -1, d), v.view(B, T, -1, d)


def attention_module(family, model, layer):
    return {"llama": lambda: model.model.layers[layer].self_attn,
            "gpt_neox": lambda: model.gpt_neox.layers[layer].attention,
            "gpt2": lambda: model.transformer.h[layer].attn}[family]()


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_captured_qkv_match_hand_computation(family):
    model = tiny_model(family)
    ids = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(1))
    hidden_in, got = {}, {}

    def grab(layer):
        def hook(module, args, kwargs):
            hidden_in[layer] = kwargs.get("hidden_states", args[0] if args else None)
        return hook

    handles = [attention_module(family, model, i).register_forward_pre_hook(grab(i), with_kwargs=True)
               for i in range(3)]
    with capture(model, lambda a: got.__setitem__(a.layer, (a.query.clone(), a.key.clone(), a.value.clone(),
                                                             a.scaling))):
        run_forward(model, ids)
    for h in handles:
        h.remove()

    assert sorted(got) == [0, 1, 2]
    for layer in range(3):
        q, k, v, scaling = got[layer]
        with torch.no_grad():
            q_ref, k_ref, v_ref = hand_qkv(family, model, layer, hidden_in[layer])
        torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)
        assert scaling == pytest.approx(q.shape[-1] ** -0.5)
    assert got[0][1].shape[2] == (2 if family == "llama" else 4)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_capture_leaves_logits_identical(family, impl):
    model = tiny_model(family)
    model.set_attn_implementation(impl)
    ids = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding must reach the wrapped implementation through the mask interface
    stock = run_forward(model, ids, mask, logits=True)
    with capture(model, lambda a: None):
        captured = run_forward(model, ids, mask, logits=True)
    assert torch.equal(stock, captured)
    assert model.config._attn_implementation == impl  # restored
    assert torch.equal(run_forward(model, ids, mask, logits=True), stock)


def test_capture_stops_after_last_requested_layer():
    model = tiny_model("llama")
    seen = []
    with capture(model, lambda a: seen.append(a.layer), layers=[0, 1]):
        assert run_forward(model, torch.zeros(1, 5, dtype=torch.long)) is None
    assert seen == [0, 1]


def test_kv_head_mapping():
    q, k = torch.zeros(1, 2, 9, 4), torch.zeros(1, 2, 3, 4)
    inputs = AttentionInputs(0, q, k, k, 0.5)
    assert [inputs.kv_head(h) for h in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
