"""The selected keys (`ops.select`, `model.bounded`): a kept softmax layer's cache after the prompt, bounded to its
sink, its window and the keys the prompt's last queries attend to most (`spec.Kept`)."""

import pytest
import torch

from dofattn.attention.cache import cache_bytes
from dofattn.errors import UserError
from dofattn.ops.select import naive_select_keys, select_keys
from dofattn.ops.softmax import expand_kv
from dofattn.ops.window import first_keys
from dofattn.spec import Attention, Kept, StudentSpec
from dofattn.model.student import linearize
from tests.conftest import tiny_model

# odd shapes: 23 tokens (a prompt of 15), 6 query heads on 2 kv heads, head dim 5
B, T, P, H, HKV, D = 2, 23, 15, 6, 2, 5
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


@pytest.mark.parametrize("keep", [OBSERVE, OBSERVE + 3])
def test_the_last_queries_choose_as_the_whole_prompts_do(keep):
    """A prompt read in chunks keeps only its last queries: given those, both forms choose as with every query."""
    q, k, _, valid = inputs(dtype=torch.float32)
    candidates = valid & (torch.arange(T) < T - 4)
    for form in (select_keys, naive_select_keys):
        whole = form(q, k, 0.4, candidates, COUNT, OBSERVE, POOL, valid)
        last = form(q[:, T - keep:], k, 0.4, candidates, COUNT, OBSERVE, POOL, valid)
        assert torch.equal(whole[1], last[1]) and chosen_sets(*whole) == chosen_sets(*last)
    with pytest.raises(ValueError, match="the last 4 queries observe, but q holds 3"):
        select_keys(q[:, T - 3:], k, 0.4, candidates, COUNT, OBSERVE, POOL, valid)


def test_selection_follows_the_last_queries():
    """A key that the last queries of each head group point at is chosen; its pooled neighbours with it."""
    q, k, _, valid = inputs(dtype=torch.float32)
    k[:, 8, 1] = 5 * q[:, -1, 3:].mean(1)         # kv head 1 serves query heads 3, 4, 5
    candidates = valid & (torch.arange(T) < T - 4)
    index, ok = select_keys(q, k, 1.0, candidates, 3, 1, 3, valid)
    for b in range(B):
        assert {7, 8, 9} == set(index[b, 1].tolist())


def test_select_bounds_the_kept_layers_cache_and_counts_in_its_bytes():
    """A kept layer (layer 1) holds S + C + W keys per kv head after the prompt, whatever its length, and the bytes
    counted are the linear layers' state and parts plus exactly those keys; with select = 0 it holds every key."""
    prompt = torch.randint(3, 300, (1, 60), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for select in (0, 5):
        for length in (20, 50):
            model = tiny_model("llama")
            linearize(model, [4] * 3, Attention(window=4, sink=2), kept=Kept(select=select, select_observe=3)
                      if select else Kept(), layers=[0, 2], seed=1)
            with torch.no_grad():
                out = model.generate(prompt[:, :length], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                     return_dict_in_generate=True, pad_token_id=0)
            cache = out.past_key_values
            kept = cache.layers[1]
            if select:
                assert type(kept).__name__ == "BoundedKVLayer" and kept.lead == 2 + 5
            linear = sum(t.numel() * t.element_size() for i in (0, 2) for t in cache.layers[i].tensors().values())
            if select:      # keys and values [1, 2 kv heads, S + C + W, 16] in float32, and a bool per slot
                assert cache_bytes(cache) - linear == 2 * (2 * (2 + 5 + 4) * 16 * 4) + (2 + 5 + 4)
            sizes[select, length] = cache_bytes(cache)
    assert sizes[5, 20] == sizes[5, 50]
    assert sizes[0, 20] < sizes[0, 50]


def test_select_holds_the_sink_the_chosen_keys_and_the_window():
    """After a prompt of 50 tokens a bounded kept layer holds, per kv head, the prompt's first S keys, C keys from
    between the sink and the window, and its last W keys in their ring slots (position p in slot S + C + p mod W):
    each the key the layer's full cache holds at that position."""
    prompt = torch.randint(3, 300, (1, 50), generator=torch.Generator().manual_seed(0))
    caches = {}
    for select in (0, 5):
        model = tiny_model("llama")
        linearize(model, [4] * 3, Attention(window=4, sink=2), kept=Kept(select=select, select_observe=3)
                  if select else Kept(), layers=[0, 2], seed=1)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                                 pad_token_id=0)
        caches[select] = out.past_key_values.layers[1]
    full, kept = caches[0].keys, caches[5]                  # [1, 2, 50, 16]; the bounded slot
    assert kept.keys.shape == (1, 2, 2 + 5 + 4, 16) and kept.lead == 2 + 5
    assert torch.equal(kept.keys[:, :, :2], full[:, :, :2])                                  # the sink
    for p in range(46, 50):                                                                  # the window
        assert torch.equal(kept.keys[:, :, 7 + p % 4], full[:, :, p]), p
    for h in range(2):                                      # the chosen: prompt keys past the sink, before the window
        positions = [p for c in range(2, 7) for p in range(50) if torch.equal(kept.keys[0, h, c], full[0, h, p])]
        assert len(positions) == 5 and all(2 <= p < 46 for p in positions), positions


def test_select_errors_and_round_trip():
    with pytest.raises(UserError, match="student.window >= 1"):
        StudentSpec(base_model="x", dims=(4, 4), layers=(0,), attention=Attention(window=0, sink=0),
                    kept=Kept(select=8))
    with pytest.raises(UserError, match="keep_softmax >= 1"):     # a setting that would do nothing
        StudentSpec(base_model="x", dims=(4, 4), layers=(0, 1), kept=Kept(select=8))
    with pytest.raises(UserError, match="selects none"):
        Kept(select_observe=4)
    with pytest.raises(UserError, match="odd"):
        Kept(select=8, select_pool=4)
    with pytest.raises(UserError, match=">= 0"):
        Kept(select=-1)
    spec = StudentSpec(base_model="x", dims=(4, 4), layers=(0,), attention=Attention(decay="head"),
                       kept=Kept(select=16, select_observe=4))
    assert StudentSpec.from_json(spec.to_json()) == spec
    assert "select=16" in spec.kept.describe(spec.attention)


def test_a_schema_3_folder_reads_its_selection_or_refuses_an_option_that_left():
    import json

    old = {"base_model": "x", "dims": [4, 4], "layers": [0], "schema": 3,
           "attention": {"feature": "prf", "window": 64, "sink": 4, "gain": "head", "decay": "head", "select": 256,
                         "select_in": "softmax", "select_by": "prompt", "select_observe": 8, "select_pool": 15,
                         "conv": 0, "delta": False}}
    spec = StudentSpec.from_json(json.dumps(old))
    assert spec.kept == Kept(select=256) and spec.attention == Attention(decay="head")
    for key, value in (("gain", "query"), ("select_by", "stream"), ("select_in", "all"), ("delta", True)):
        with pytest.raises(UserError, match=f"student.{key} = {value!r}.*distill the student again"):
            StudentSpec.from_json(json.dumps({**old, "attention": {**old["attention"], key: value}}))
    current = json.loads(spec.to_json())                # schema 4 with the delta rule's key at its default: read
    current["attention"]["delta"] = False
    assert StudentSpec.from_json(json.dumps(current)) == spec


# --- a kept softmax layer's bounded cache (`model.bounded`) ---------------------------------------------------

def test_bounded_softmax_cache_reads_what_the_spec_keeps():
    """A prompt read in full, then chunks: each later query of head h attends, exactly, to the sink, its kv head's
    selected keys and the keys less than W back, by a naive softmax over that set."""
    from types import SimpleNamespace

    from transformers.cache_utils import DynamicLayer

    from dofattn.model.bounded import BoundedSoftmax

    q, k, v, valid = inputs()
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))                                    # HF layout [B, heads, T, D]
    scaling = D ** -0.5
    bounded = BoundedSoftmax(Kept(select=COUNT, select_observe=OBSERVE, select_pool=POOL),
                             Attention(window=WINDOW, sink=SINK), scaling)
    cache = SimpleNamespace(layers=[DynamicLayer()])
    keys, values = cache.layers[0].update(k[:, :, :P], v[:, :, :P])
    bounded.after(cache, 0, q[:, :, :P], keys, values, valid[:, :P])
    got = []
    for piece in (slice(P, P + 1), slice(P + 1, P + 2), slice(P + 2, T)):
        keys, values = cache.layers[0].update(k[:, :, piece], v[:, :, piece])
        mask = bounded.mask(cache.layers[0])                                             # [B, 1, t, n]
        logits = scaling * expand_kv(keys, H, dim=1).transpose(-1, -2).__rmatmul__(q[:, :, piece])
        weights = torch.softmax(logits.masked_fill(~mask, -torch.inf), -1)
        got.append(weights @ expand_kv(values, H, dim=1))
    got = torch.cat(got, 2)                                                              # [B, H, T - P, D]
    assert cache.layers[0].keys.shape[2] == cache.layers[0].lead + WINDOW                 # bounded: a ring of W
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
    for name, (attention, kept) in {"full": (Attention(window=64, sink=2), Kept()),
                                    "roomy": (Attention(window=64, sink=2), Kept(select=64, select_observe=3)),
                                    "tight": (Attention(window=4, sink=2), Kept(select=3, select_observe=3))}.items():
        model = tiny_model("llama")
        linearize(model, [4] * 3, attention, kept=kept, layers=[0, 2], seed=1)
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
        linearize(model, [4] * 3, Attention(window=4, sink=2), kept=Kept(select=3, select_observe=3), layers=[0, 2],
                  seed=1)
        with torch.no_grad():
            out = model.generate(prompt[:, :length], max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                 pad_token_id=0)
        sizes.append(cache_bytes(out.past_key_values))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("length", [3, 30], ids=["prompt inside the window", "prompt past it"])
def test_static_decoding_of_a_bounded_kept_layer_matches_hf_generate(length):
    """The static decoder's ring of W slots after the held keys reads what the growing bounded cache reads: the same
    greedy tokens as HF generate, over more steps than the window has slots."""
    from dofattn.model.bounded import StaticBoundedLayer
    from dofattn.engine import StaticDecoder

    model = tiny_model("llama")
    linearize(model, [4] * 3, Attention(window=4, sink=2), kept=Kept(select=3, select_observe=3), layers=[0, 2],
                  seed=1)
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
    assert grown.seen == static.seen == seen
    torch.testing.assert_close(static.keys, grown.keys, rtol=1e-5, atol=1e-6)


def test_steps_after_the_prompt_with_gradients_keep_each_steps_keys():
    """A bounded slot writes its ring in place; with gradients on, each call writes a copy, so that two steps' losses
    go back through both (the keys the first step's attention saved are unchanged)."""
    from transformers import DynamicCache

    from dofattn.attention.cache import cache_kwargs

    model = tiny_model("llama")
    linearize(model, [4] * 3, Attention(window=4, sink=2), kept=Kept(select=3, select_observe=3), layers=[0, 2],
              seed=1)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **cache_kwargs(model, cache))
    assert type(cache.layers[1]).__name__ == "BoundedKVLayer"
    first = model(ids[:, :1], use_cache=True, **cache_kwargs(model, cache)).logits
    second = model(ids[:, 1:2], use_cache=True, **cache_kwargs(model, cache)).logits
    (first.sum() + second.sum()).backward()
    assert any(p.grad is not None for p in model.parameters())
