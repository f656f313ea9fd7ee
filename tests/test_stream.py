"""A streaming bounded cache (`student.select_by = stream`): keys scored as they arrive (`attention.scorer`), the
best C kept as they leave the window (`ops.stream`), in kept softmax layers (`attention.bounded.StreamKVLayer`)."""

import pytest
import torch
from transformers import DynamicCache

from dofattn.attention.bounded import StreamKVLayer
from dofattn.attention.cache import cache_bytes
from dofattn.attention.scorer import KeyScorer
from dofattn.errors import UserError
from dofattn.ops.stream import KEY, PAD, SINK, keep_after, naive_stream_visible, stream_visible
from dofattn.spec import Attention, StudentSpec
from dofattn.student import linearize
from tests.conftest import tiny_model


def pool(B=2, Hkv=3, P=37, seed=0):
    """Positions 0..P-1, scores with ties (one decimal), a sink of 2, and left padding of 5 in the second row (whose
    sink is then its positions 5 and 6)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(P).expand(B, Hkv, P).clone()
    score = torch.randn(B, Hkv, P, generator=g).round(decimals=1)
    kind = torch.full((B, Hkv, P), KEY)
    kind[:, :, :2] = SINK
    kind[1, :, :5], kind[1, :, 5:7] = PAD, SINK
    return pos, score, kind


@pytest.mark.parametrize("window,count", [(4, 3), (8, 5), (3, 60), (1, 1)])
def test_fast_visibility_matches_the_spec(window, count):
    pos, score, kind = pool()
    query_pos = torch.arange(pos.shape[-1])
    fast = stream_visible(pos, score, kind, query_pos, window, count)
    assert torch.equal(fast, naive_stream_visible(pos, score, kind, query_pos, window, count))
    # every query sees at most the sink, its window and `count` others
    assert fast.sum(-1).max() <= 2 + window + count
    assert not fast[1, :, :, :5].any()                                           # padding is never seen


def test_a_pool_kept_after_a_call_decides_as_the_whole_sequence():
    """What `keep_after` keeps at position `end` (the sink, the best C gone from the window), with the window's
    keys, gives later queries exactly the visibility that the whole sequence gives them."""
    pos, score, kind = pool(P=40)
    window, count, end = 5, 4, 23
    held, held_kind = keep_after(pos[..., :end], score[..., :end], kind[..., :end], end, window, count)
    win = torch.arange(end - window + 1, 40)
    sub_pos = torch.cat([pos.gather(-1, held), win.expand(2, 3, -1)], -1)
    sub_score = torch.cat([score.gather(-1, held), score[..., win]], -1)
    sub_kind = torch.cat([held_kind, kind[..., win]], -1)
    later = torch.arange(end, 40)
    got = stream_visible(sub_pos, sub_score, sub_kind, later, window, count)
    want = stream_visible(pos, score, kind, later, window, count)
    for b in range(2):
        for h in range(3):
            for t in range(len(later)):
                seen_sub = {int(p) for p, s in zip(sub_pos[b, h], got[b, h, t]) if s}
                seen_all = {int(p) for p, s in zip(pos[b, h], want[b, h, t]) if s}
                assert seen_sub == seen_all
    assert (held_kind == SINK).sum(-1).tolist() == [[2] * 3] * 2
    assert ((held_kind == KEY).sum(-1) <= count).all()


def test_scores_do_not_depend_on_how_the_text_is_fed():
    """A key's score reads it, the tokens before it and its position: one call = a call continued from the tokens
    before it."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 30, 3, 6, generator=g), torch.randn(2, 30, 3, 6, generator=g)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :4] = False
    scorer = KeyScorer(3, 6, hidden=5)
    whole = scorer(k, v, valid)
    with torch.no_grad():
        scorer.log_rate.fill_(0.5)
    whole = scorer(k, v, valid)
    later = scorer(k[:, 20:], v[:, 20:], valid[:, 20:], before=(k[:, 9:20], v[:, 9:20], valid[:, 9:20]), start=20)
    torch.testing.assert_close(later, whole[..., 20:])
    start = scorer(k[:, :3], v[:, :3], valid[:, :3])
    torch.testing.assert_close(start, whole[..., :3])
    k2 = k.clone()
    k2[:, 25] += 1.0                                        # a key changes its own score and the next 7, no other
    moved = (scorer(k2, v, valid) - whole).abs().amax((0, 1)) > 0
    assert moved.nonzero().flatten().tolist() == list(range(25, 30))


def streaming_model(window=8, count=5, seed=1):
    model = tiny_model("llama")
    linearize(model, [4] * 3, Attention(window=window, sink=2, select=count, select_by="stream"), layers=[0, 2],
              seed=seed)
    bounded = model.model.layers[1].self_attn.dofattn_bounded
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():                  # a scorer that ranks keys in no simple order
        for p in bounded.scorer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("chunks", [[41], [10, 20, 41], list(range(1, 42))], ids=["one call", "chunks", "tokens"])
def test_a_streaming_layer_reads_the_same_however_the_text_is_fed(chunks):
    """A kept layer that streams gives the same logits without a cache (perplexity) as with one, read in one call,
    in chunks or token by token, with left padding; its cache holds S + C + W - 1 keys per kv head."""
    model = streaming_model()
    ids = torch.randint(3, 300, (2, 41), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache, outs, lo = DynamicCache(config=model.config), [], 0
        for hi in chunks:
            outs.append(model(ids[:, lo:hi], attention_mask=mask[:, :hi], past_key_values=cache,
                              use_cache=True).logits)
            lo = hi
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got[mask.bool()], full[mask.bool()], rtol=1e-5, atol=1e-5)
    slot = cache.layers[1]
    assert isinstance(slot, StreamKVLayer)
    assert slot.held_keys.shape[2] == 2 + 5 and slot.keys.shape[2] == 8 - 1


def test_streaming_is_bounded_and_not_the_full_attention():
    """Past S + C + W keys the streamed layer drops keys (its logits leave the full student's); before, it is the
    full student exactly; generation runs on HF generate at the same cache size for any prompt length."""
    ids = torch.randint(3, 300, (1, 41), generator=torch.Generator().manual_seed(0))
    full = tiny_model("llama")
    linearize(full, [4] * 3, Attention(window=8, sink=2), layers=[0, 2], seed=1)
    model = streaming_model()
    with torch.no_grad():
        a, b = full(ids).logits, model(ids).logits
    torch.testing.assert_close(a[:, :2 + 5 + 8], b[:, :2 + 5 + 8])
    assert not torch.allclose(a[:, -5:], b[:, -5:])
    sizes = []
    for length in (20, 40):
        with torch.no_grad():
            out = model.generate(ids[:, :length], max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                                 pad_token_id=0)
        sizes.append(cache_bytes(out.past_key_values))
        assert isinstance(out.past_key_values.layers[1], StreamKVLayer)
    assert sizes[0] == sizes[1]


def test_scorers_train_alone_and_rank_what_the_teacher_wants():
    """`train_scorers` moves the scorers only, lowers their loss, and logs what a streaming cache retains."""
    from types import SimpleNamespace

    from dofattn.distill.scorer import train_scorers

    model = streaming_model(window=8, count=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    blocks = torch.randint(3, 300, (4, 48), generator=torch.Generator().manual_seed(3))
    log = train_scorers(model, blocks, SimpleNamespace(steps=60, lr=0.02), progress=False)
    assert set(log) == {"1"}
    assert log["1"]["loss_last"] < log["1"]["loss_first"]
    assert 0 <= log["1"]["retained"] <= 1 and 0 <= log["1"]["retained_recent"] <= 1
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != (".scorer." in name), name


def test_streaming_spec_rules_and_round_trip(tmp_path):
    with pytest.raises(UserError, match="select_in = 'softmax'"):
        Attention(select=8, select_by="stream", select_in="all")
    with pytest.raises(UserError, match="window >= 8"):
        Attention(window=4, select=8, select_by="stream")
    with pytest.raises(UserError, match="select_by"):
        Attention(select=8, select_by="later")
    attention = Attention(select=16, select_by="stream")
    spec = StudentSpec(base_model="x", dims=(4, 4), layers=(0, 1), attention=attention)
    assert StudentSpec.from_json(spec.to_json()) == spec
    assert "streamed" in attention.describe()


def test_a_streaming_student_saves_its_scorers(tmp_path):
    from dofattn.student import is_student_tensor, save_student, student_state

    model = streaming_model()
    spec = StudentSpec(base_model="tiny", dims=(4, 4, 4), layers=(0, 2),
                       attention=Attention(window=8, sink=2, select=5, select_by="stream"), seed=1)
    save_student(model, tmp_path, spec)
    names = [n for n in student_state(model) if ".scorer." in n]
    assert names and all(is_student_tensor(n) for n in names)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "features.safetensors"))
    for n in names:
        assert torch.equal(saved[n], student_state(model)[n])


def test_static_decoding_refuses_a_streaming_kept_layer():
    from dofattn.engine import StaticDecoder

    with pytest.raises(UserError, match="HF generate"):
        StaticDecoder(streaming_model())


def test_distill_trains_the_scorers_first_and_saves_them(model_dirs, corpus, tmp_path):
    """`dofattn distill` with select_by = stream trains each kept layer's scorer (logged), then the student."""
    import json

    from dofattn.cli import main
    from dofattn.student import load_student

    sets = ("layerwise.steps=2", "layerwise.blocks=2", "layerwise.seq_len=32", "end_to_end.steps=1",
            "end_to_end.seq_len=32", "eval.blocks=1", "eval.seq_len=32", "student.dims=fix:4", "student.window=8",
            "student.sink=2", "student.keep_softmax=1", "student.select=3", "student.select_by=stream",
            "scorer.steps=5", "scorer.blocks=2", "scorer.seq_len=40")
    out = tmp_path / "run"
    argv = ["distill", "--model", str(model_dirs["llama"]), "--data", str(corpus), "--out", str(out), "--device", "cpu"]
    assert main(argv + [x for key in sets for x in ("--set", key)]) == 0
    log = json.loads((out / "log.json").read_text())
    (kept,) = log["softmax_layers"]
    assert set(log["scorer"]) == {str(kept)} and "scorer" in log["seconds"]
    model, _, spec = load_student(out)
    assert spec.attention.select_by == "stream"
    assert model.model.layers[kept].self_attn.dofattn_bounded.scorer is not None
