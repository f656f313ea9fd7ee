"""The selected keys (`exact.Select`, `ops.select`): a bounded exact cache chosen by a prompt's last queries."""

import pytest
import torch

from dofattn.attention import CONV_NAMES, LinearAttention, LinearStateLayer
from dofattn.attention.cache import RingWindowLayer, cache_bytes
from dofattn.errors import UserError
from dofattn.ops.select import naive_select_keys, select_keys
from dofattn.ops.softmax import expand_kv
from dofattn.ops.window import first_keys, naive_window_linear_attention
from dofattn.spec import Attention, StudentSpec
from dofattn.student import linearize
from tests.conftest import tiny_model
from tests.test_attention import off_its_start, reference_conv

# odd shapes: 23 tokens (a prompt of 15), 6 query heads on 2 kv heads, head dim 5, 7 features
B, T, P, H, HKV, D, M = 2, 23, 15, 6, 2, 5, 7
WINDOW, SINK, COUNT, OBSERVE, POOL = 4, 2, 7, 4, 3


def inputs(seed=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, T, HKV, D, generator=g, dtype=dtype) for _ in range(2))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False                                                        # left padding in the second row
    return q, k, v, valid


def chosen_sets(index, valid):
    """{(row, kv head): set of chosen positions} over the real slots."""
    return {(b, j): {int(s) for s, ok in zip(index[b, j], valid[b]) if ok}
            for b in range(index.shape[0]) for j in range(index.shape[1])}


@pytest.mark.parametrize("count,observe,pool", [(3, 4, 3), (7, 1, 1), (30, 40, 5)])
def test_fast_selection_matches_the_spec(count, observe, pool):
    q, k, _, valid = inputs(dtype=torch.float32)
    candidates = valid.clone()
    candidates[:, T - 4:] = False
    candidates[0, 5] = False
    fast = select_keys(q, k, 0.4, candidates, count, observe, pool, valid)
    spec = naive_select_keys(q, k, 0.4, candidates, count, observe, pool, valid)
    assert torch.equal(fast[1], spec[1])
    assert chosen_sets(*fast) == chosen_sets(*spec)
    assert all(candidates[b, s] for (b, _), chosen in chosen_sets(*fast).items() for s in chosen)
    assert fast[1].sum(1).tolist() == [min(count, int(n)) for n in candidates.sum(1)]


def test_selection_follows_the_last_queries():
    """A key that the last queries of each head group point at is chosen; its pooled neighbours with it."""
    q, k, _, valid = inputs(dtype=torch.float32)
    k[:, 8, 1] = 5 * q[:, -1, 3:].mean(1)         # kv head 1 serves query heads 3, 4, 5
    candidates = valid & (torch.arange(T) < T - 4)
    index, ok = select_keys(q, k, 1.0, candidates, 3, 1, 3, valid)
    for b in range(B):
        assert {7, 8, 9} == set(index[b, 1].tolist())


def odd_layer(**extra) -> LinearAttention:
    return off_its_start(Attention(window=WINDOW, sink=SINK, select=COUNT, select_in="all", select_observe=OBSERVE,
                                   select_pool=POOL, **extra))


def reference(layer, q, k, v, valid):
    """The spec of a prompt of P tokens and its continuation: the prompt's queries but its last as without a
    selection; its last query and each later one of head h reads, beside the window and the sink, the keys its kv head chose exactly (a sink mask
    per head), by the naive op and the naive selection, head by head."""
    fmap = layer.feature_map
    if layer.conv is not None:
        keep = valid[:, :, None, None].to(q.dtype)
        q, k, v = (reference_conv(x * keep, getattr(layer.conv, name)) for x, name in zip((q, k, v), CONV_NAMES))
    sink = first_keys(valid, B, T, SINK, q.device)
    candidates = valid[:, :P] & ~sink[:, :P] & (torch.arange(P) < P - WINDOW)
    index, chosen = naive_select_keys(q[:, :P], k[:, :P], fmap.scaling, candidates, COUNT, OBSERVE, POOL,
                                      valid[:, :P])
    kq, vq = expand_kv(k, H), expand_kv(v, H)
    phi_q, q_scale = fmap.features(q, "query")
    phi_k, k_scale = fmap.features(kq, "key")
    offset = k_scale + layer.window.log_gain
    out = naive_window_linear_attention(q, kq, vq, phi_q, phi_k, q_scale, offset, fmap.scaling, WINDOW, valid,
                                        sink_mask=sink)[0].clone()
    for h in range(H):
        mask = sink.clone()
        for b in range(B):
            mask[b, index[b, h // (H // HKV)][chosen[b]]] = True
        one = slice(h, h + 1)
        later = naive_window_linear_attention(q[:, :, one], kq[:, :, one], vq[:, :, one], phi_q[:, :, one],
                                              phi_k[:, :, one], q_scale[:, :, one], offset[one], fmap.scaling, WINDOW,
                                              valid, sink_mask=mask)[0]
        out[:, P - 1:, one] = later[:, P - 1:]
    return out


@pytest.mark.parametrize("extra", [{}, {"conv": 3}], ids=["window+sink+select", "conv+window+sink+select"])
def test_prompt_then_continuation_matches_the_spec(extra):
    """A prompt in one cached call, then single steps (lean decode steps once the window is full) and a chunk; and
    static ring steps after the prompt: each against the naive forms, per head."""
    layer = odd_layer(**extra)
    q, k, v, valid = inputs()
    layer(q, k, v, valid)                                          # training mode: the PRF map calibrates its shift
    layer.eval()
    ref = reference(layer, q, k, v, valid)
    with torch.no_grad():
        full = layer(q, k, v, valid)                               # no cache: no selection
        torch.testing.assert_close(full[:, :P - 1], ref[:, :P - 1], rtol=1e-6, atol=1e-6)
        assert (full[:, P - 1:] - ref[:, P - 1:]).abs().amax((0, 2, 3)).min() > 1e-3   # the selection shows
        cache = LinearStateLayer()
        pieces = [slice(0, P), *(slice(t, t + 1) for t in range(P, P + 4)), slice(P + 4, T)]
        steps = [layer(q[:, s], k[:, s], v[:, s], valid[:, s], cache=cache) for s in pieces]
        torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-6, atol=1e-6)
        chosen = cache.part("select")
        assert chosen.keys.shape == (B, COUNT, HKV, D) and chosen.valid.sum(1).tolist() == [7, 6]
        cache = LinearStateLayer()
        layer(q[:, :P], k[:, :P], v[:, :P], valid[:, :P], cache=cache)
        cache.seen = P
        position = torch.tensor([P])
        ring = RingWindowLayer.from_layer(cache, WINDOW, position)
        for t in range(P, T):
            out = layer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache=ring)
            torch.testing.assert_close(out, ref[:, t:t + 1], rtol=1e-6, atol=1e-6)
            position.add_(1)


def test_the_state_loses_exactly_the_chosen_keys():
    """After the prompt, the state equals the one folded from the linear keys minus the chosen ones."""
    layer = odd_layer()
    q, k, v, valid = inputs()
    layer(q, k, v, valid)
    layer.eval()
    with torch.no_grad():
        cache = LinearStateLayer()
        layer(q[:, :P], k[:, :P], v[:, :P], valid[:, :P], cache=cache)
        held_keys, chosen = cache.part("select").keys, cache.part("select").valid
        kq = expand_kv(k[:, :P], H)
        phi, _ = layer.feature_map.features(kq, "key")
        sink = first_keys(valid[:, :P], B, P, SINK, q.device)
        linear = valid[:, :P] & ~sink & (torch.arange(P) < P - WINDOW)
        for b in range(B):
            for h in range(H):
                held = {tuple(x.tolist()) for x, ok in zip(held_keys[b, :, h // 3], chosen[b]) if ok}
                keep = [s for s in range(P) if linear[b, s] and tuple(k[b, s, h // 3].tolist()) not in held]
                values = v[b, keep, h // 3]
                want = phi[b, keep, h].T @ torch.cat([values, torch.ones(len(keep), 1, dtype=values.dtype)], -1)
                torch.testing.assert_close(cache.state[b, h], want, rtol=1e-9, atol=1e-9)


def test_select_bounds_the_cache_and_counts_in_its_bytes():
    model = tiny_model("llama")
    linearize(model, [4] * 3, Attention(window=4, sink=2, select=5, select_in="all", select_observe=3), seed=1)
    prompt = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    sizes = []
    for extra in (0, 30):
        with torch.no_grad():
            out = model.generate(prompt[:, :10 + extra], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 return_dict_in_generate=True, pad_token_id=0)
        sizes.append(cache_bytes(out.past_key_values))
        layer = out.past_key_values.layers[0]
        assert layer.parts["select"].keys.shape[1] == 5
    assert sizes[0] == sizes[1]


def test_select_errors_and_round_trip():
    with pytest.raises(UserError, match="student.window >= 1"):
        Attention(window=0, sink=0, select=8)
    with pytest.raises(UserError, match="decay"):
        Attention(select=8, select_in="all", decay="head")
    assert Attention(select=8, decay="head").select == 8        # kept layers bounded, linear layers decayed
    with pytest.raises(UserError, match="odd"):
        Attention(select=8, select_pool=4)
    with pytest.raises(UserError, match=">= 0"):
        Attention(select=-1)
    spec = StudentSpec(base_model="x", dims=(4, 4), layers=(0, 1), attention=Attention(select=16, select_observe=8))
    assert StudentSpec.from_json(spec.to_json()) == spec
    assert "select=16" in Attention(select=16).describe()


# --- a kept softmax layer's bounded cache (`attention.bounded`) ------------------------------------------------

def test_bounded_softmax_cache_reads_what_the_spec_keeps():
    """A prompt read in full, then chunks: each later query of head h attends, exactly, to the sink, its kv head's
    selected keys and the keys less than W back, by a naive softmax over that set."""
    from types import SimpleNamespace

    from transformers.cache_utils import DynamicLayer

    from dofattn.attention.bounded import BoundedSoftmax

    q, k, v, valid = inputs()
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))                                    # HF layout [B, heads, T, D]
    scaling = D ** -0.5
    bounded = BoundedSoftmax(Attention(window=WINDOW, sink=SINK, select=COUNT, select_observe=OBSERVE,
                                       select_pool=POOL), scaling)
    cache = SimpleNamespace(layers=[DynamicLayer()])
    bounded.cache, bounded.layer_idx = cache, 0
    keys, values = cache.layers[0].update(k[:, :, :P], v[:, :, :P])
    bounded.after(q[:, :, :P], keys, values, valid[:, :P])
    got = []
    for piece in (slice(P, P + 1), slice(P + 1, P + 2), slice(P + 2, T)):
        keys, values = cache.layers[0].update(k[:, :, piece], v[:, :, piece])
        mask = bounded.mask()                                                            # [B, 1, t, n]
        logits = scaling * expand_kv(keys, H, dim=1).transpose(-1, -2).__rmatmul__(q[:, :, piece])
        weights = torch.softmax(logits.masked_fill(~mask, -torch.inf), -1)
        got.append(weights @ expand_kv(values, H, dim=1))
    got = torch.cat(got, 2)                                                              # [B, H, T - P, D]
    assert cache.layers[0].keys.shape[2] <= WINDOW + (T - P - 2)
    sink = first_keys(valid, B, T, SINK, q.device)
    candidates = valid[:, :P] & ~sink[:, :P] & (torch.arange(P) < P - WINDOW)
    index, chosen = naive_select_keys(q[:, :, :P].transpose(1, 2), k[:, :, :P].transpose(1, 2), scaling, candidates,
                                      COUNT, OBSERVE, POOL, valid[:, :P])
    for b in range(B):
        for h in range(H):
            held = {int(s) for s, ok in zip(index[b, h // (H // HKV)], chosen[b]) if ok}
            held |= {s for s in range(P) if sink[b, s]}
            for t in range(P, T):
                seen = sorted(held | {s for s in range(max(t - WINDOW + 1, 0), t + 1) if valid[b, s]})
                w = torch.softmax(scaling * k[b, h // (H // HKV), seen] @ q[b, h, t], 0)
                want = w @ v[b, h // (H // HKV), seen]
                torch.testing.assert_close(got[b, h, t - P], want, rtol=1e-9, atol=1e-9)


def test_a_bounded_cache_that_drops_nothing_generates_as_the_full_one():
    """With a window past the whole sequence (nothing dropped) the bounded kept layer generates exactly what the
    student with a full KV cache generates; with little room it differs, and its cache stays the same size at any
    prompt length."""
    prompt = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    outs = {}
    for name, attention in {"full": Attention(window=64, sink=2),
                            "roomy": Attention(window=64, sink=2, select=64, select_observe=3),
                            "tight": Attention(window=4, sink=2, select=3, select_observe=3)}.items():
        model = tiny_model("llama")
        linearize(model, [4] * 3, attention, layers=[0, 2], seed=1)
        with torch.no_grad():
            outs[name] = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                        return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        if name != "full":
            assert type(outs[name].past_key_values.layers[1]).__name__ == "BoundedKVLayer"
    torch.testing.assert_close(torch.stack(outs["roomy"].logits), torch.stack(outs["full"].logits))
    assert not torch.allclose(torch.stack(outs["tight"].logits), torch.stack(outs["full"].logits))
    sizes = []
    for length in (12, 30):
        model = tiny_model("llama")
        linearize(model, [4] * 3, Attention(window=4, sink=2, select=3, select_observe=3), layers=[0, 2], seed=1)
        with torch.no_grad():
            out = model.generate(prompt[:, :length], max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                 pad_token_id=0)
        sizes.append(cache_bytes(out.past_key_values))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("length", [3, 30], ids=["prompt inside the window", "prompt past it"])
def test_static_decoding_of_a_bounded_kept_layer_matches_hf_generate(length):
    """The static decoder's ring of W slots after the held keys reads what the growing bounded cache reads: the same
    greedy tokens as HF generate, over more steps than the window has slots."""
    from dofattn.attention.bounded import StaticBoundedLayer
    from dofattn.engine import StaticDecoder

    model = tiny_model("llama")
    linearize(model, [4] * 3, Attention(window=4, sink=2, select=3, select_observe=3), layers=[0, 2], seed=1)
    prompt = torch.randint(3, 300, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=11, min_new_tokens=11, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True)
    decoder = StaticDecoder(model, graph=False)
    got = decoder.generate(prompt, max_new_tokens=11)
    assert torch.equal(got, want.sequences)
    static, grown = decoder.cache.layers[1], want.past_key_values.layers[1]
    assert isinstance(static, StaticBoundedLayer) and static.keys.shape[2] == 2 + 3 + 4
    # the same keys: the held ones, and the last W in their ring slots (position p in slot p mod W)
    seen = length + 10
    torch.testing.assert_close(static.keys[:, :, :5], grown.held_keys, rtol=1e-5, atol=1e-6)
    ring = torch.stack([grown.keys[:, :, grown.keys.shape[2] - (seen - p)] for p in range(seen - 4, seen)], 2)
    order = [p % 4 for p in range(seen - 4, seen)]
    torch.testing.assert_close(static.keys[:, :, 5:][:, :, order], ring, rtol=1e-5, atol=1e-6)
