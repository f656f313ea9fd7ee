"""Exact heads inside linear layers (`student.exact_heads`): a layer whose chosen key/value heads stay softmax
attention, their query heads with them, bounded after the prompt as the kept layers are, beside its linear heads.

The mixed layer against its naive reference (every head's attention matrix the quadratic way: the exact heads' the
teacher's softmax, the linear heads' `LinearAttention.naive`) in outputs and gradients, with the exact heads first,
in the middle, last and apart; its generation against its own forward while the bound holds every key; a prompt read
in chunks, left-padded rows, static decoding, save and load and export against the plain paths; and the rules.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from dofattn.errors import UserError
from dofattn.model.attach import bounded_of, linear_of
from dofattn.model.bounded import BoundedKVLayer, HeadSplit, take
from dofattn.model.hf import attention_modules, causal_lm_class
from dofattn.model.install import attention_forward
from dofattn.model.prompt import set_prompt_chunk
from dofattn.model.student import linearize
from dofattn.spec import Attention, Kept, StudentSpec

ATTENTION = Attention(window=3, sink=1)          # PRF features, a window of 3 and a sink of 1


def tiny(seed: int = 0):
    """8 query heads on 4 key/value heads of 8, 3 layers: room for exact heads first, in the middle and last."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=4, rope_theta=1e4, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return causal_lm_class(config)._from_config(config).eval()


def mixed(exact=((1, 2), (), (0, 3)), select: int = 4, seed: int = 0):
    model = tiny(seed)
    linearize(model, [6] * 3, ATTENTION, kept=Kept(select=select, select_observe=3, select_pool=3),
              layers=[0, 1, 2], seed=1, exact_heads=exact)
    with torch.no_grad():           # the window's gain and the features away from their start: every head differs
        for module in attention_modules(model):
            linear = linear_of(module)
            linear.window.log_gain.normal_(0, 0.5, generator=torch.Generator().manual_seed(module.layer_idx))
    return model


def test_head_split_takes_and_puts_back_every_head():
    split = HeadSplit((1, 3), num_kv_heads=4, num_heads=8)
    assert split.exact_q == (2, 3, 6, 7) and split.linear_q == (0, 1, 4, 5) and split.linear == (0, 2)
    x = torch.arange(8.0)[None, :, None]
    (qe, _, _), (ql, _, _) = split.split(x, torch.arange(4.0)[None, :, None], torch.arange(4.0)[None, :, None], 1)
    assert qe.flatten().tolist() == [2, 3, 6, 7] and ql.flatten().tolist() == [0, 1, 4, 5]
    assert torch.equal(split.merge(qe, ql, 1), x)
    assert take(torch.arange(5), (0, 1, 3), 0).tolist() == [0, 1, 3]


def naive(module, q, k, v):
    """The layer's output the quadratic way, head by head: q [B, H, T, D], k, v [B, Hkv, T, D] -> [B, T, H, D]."""
    linear, split = linear_of(module), bounded_of(module).heads
    H, Hkv = q.shape[1], k.shape[1]
    group = H // Hkv
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    outs = [None] * H
    (qe, ke, ve), (ql, kl, vl) = split.split(q, k, v, 1)
    # exact heads: the teacher's softmax
    ke, ve = ke.repeat_interleave(group, 1), ve.repeat_interleave(group, 1)
    logits = (qe @ ke.transpose(-1, -2) * module.scaling).masked_fill(~causal, -torch.inf)
    exact = torch.softmax(logits, -1) @ ve                                          # [B, He, T, D]
    # linear heads: the layer's naive attention matrix
    kl, vl = kl.repeat_interleave(group, 1), vl.repeat_interleave(group, 1)
    weights = linear.naive(ql.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2)).exp()   # [B, Hl, T, T]
    lin = weights @ vl
    for i, h in enumerate(split.exact_q):
        outs[h] = exact[:, i]
    for i, h in enumerate(split.linear_q):
        outs[h] = lin[:, i]
    return torch.stack(outs, 2)                                                     # [B, T, H, D]


@pytest.mark.parametrize("exact", [(0,), (1, 2), (3,), (0, 2)])
def test_a_mixed_layer_is_its_naive_reference_in_outputs_and_gradients(exact):
    model = mixed(exact=(exact, (), ()))
    module = attention_modules(model)[0]
    g = torch.Generator().manual_seed(2)
    B, T, D = 2, 13, 8
    q = torch.randn(B, 8, T, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, 4, T, D, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(B, T, 8, D, generator=g)
    params = [p for p in linear_of(module).parameters() if p.requires_grad]
    got = attention_forward(module, q, k, v, None, scaling=module.scaling, dropout=0.0)[0]
    want = naive(module, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad((got * w).sum(), [q, k, v, *params])
    refs = torch.autograd.grad((want * w).sum(), [q, k, v, *params])
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def logits_as_generated(model, ids, new: int):
    out = model.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1)


def test_generation_reads_the_prompt_as_the_forward_and_then_its_bounded_slot():
    """The first new token's logits are the model's forward on the prompt; with a window as long as the sequence
    (the bound then holds every key: its ring), each later token's too, so the nested slot's steps lose nothing."""
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    model = mixed()
    with torch.no_grad():
        seq, logits = logits_as_generated(model, ids, 3)
        torch.testing.assert_close(logits[:, 0], model(ids).logits[:, -1], rtol=1e-4, atol=1e-4)
    model = tiny()
    linearize(model, [6] * 3, Attention(window=16, sink=1), kept=Kept(select=4, select_observe=3, select_pool=3),
              layers=[0, 1, 2], seed=1, exact_heads=((1, 2), (), (0, 3)))
    with torch.no_grad():
        seq, logits = logits_as_generated(model, ids, 4)
        torch.testing.assert_close(logits, model(seq).logits[:, 8:-1], rtol=1e-4, atol=1e-4)
        assert isinstance(model(ids, use_cache=True).past_key_values.layers[0].exact, BoundedKVLayer)


def test_a_prompt_read_in_chunks_is_read_as_one_call():
    model = mixed()
    ids = torch.randint(3, 300, (2, 14), generator=torch.Generator().manual_seed(6))
    runs = []
    for chunk in (0, 4):
        set_prompt_chunk(model, chunk)
        with torch.no_grad():
            runs.append(logits_as_generated(model, ids, 5))
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-4)


def test_left_padded_rows_generate_what_they_generate_alone():
    model = mixed()
    g = torch.Generator().manual_seed(7)
    long, short = torch.randint(3, 300, (1, 12), generator=g), torch.randint(3, 300, (1, 8), generator=g)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)])
    mask = torch.cat([torch.ones(1, 12), torch.cat([torch.zeros(1, 4), torch.ones(1, 8)], 1)]).long()
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        alone = [model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0) for x in (long, short)]
    assert torch.equal(together[0, 12:], alone[0][0, 12:]) and torch.equal(together[1, 12:], alone[1][0, 8:])


def test_static_decoding_gives_the_tokens_and_slots_of_generate():
    from dofattn.engine import StaticDecoder

    model = mixed()
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=7, do_sample=False, pad_token_id=0)
        decoder = StaticDecoder(model)
        got = decoder.generate(ids, 7)
    assert torch.equal(got, want)
    slots = [layer.exact for layer in decoder.cache.layers if getattr(layer, "exact", None) is not None]
    assert len(slots) == 2


def test_the_bounded_slot_holds_sink_selected_and_window_keys_only():
    model = mixed(select=4)
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    slot = out.past_key_values.layers[0].exact
    assert isinstance(slot, BoundedKVLayer)
    assert slot.keys.shape == (1, 2, 1 + 4 + 3, 8)          # exact kv heads 1 and 2: sink 1, 4 chosen, window 3


def saved_and_exported(model, tmp_path, tokenizer, **spec) -> StudentSpec:
    """Save `model` as a student of `tiny()` with these spec fields, load it back and export it: both give the
    model's logits. Returns the spec as loaded."""
    from dofattn.jobs.export import ExportConfig, run as export
    from dofattn.model.exported import load_any
    from dofattn.model.student import fingerprint, load_student, save_student

    base = tmp_path / "base"
    tiny().save_pretrained(base)
    tokenizer.save_pretrained(base)
    save_student(model, tmp_path / "student", StudentSpec(base_model=str(base), base=fingerprint(model), **spec))
    loaded, _, again = load_student(tmp_path / "student")
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-5, atol=1e-5)
    export(ExportConfig(model=str(tmp_path / "student"), out=str(tmp_path / "export")))
    exported, _, _ = load_any(tmp_path / "export")
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, want, rtol=1e-5, atol=1e-5)
    return again


def test_save_load_and_export_keep_the_exact_heads(tmp_path, tokenizer):
    again = saved_and_exported(mixed(), tmp_path, tokenizer, dims=(6,) * 3, layers=(0, 1, 2), attention=ATTENTION,
                               kept=Kept(select=4, select_observe=3, select_pool=3), seed=1,
                               exact_heads=((1, 2), (), (0, 3)))
    assert again.exact_heads == ((1, 2), (), (0, 3))


@pytest.mark.parametrize("exact,kept,match", [
    (((0,), (), ()), Kept(), "set student.select"),
    (((0, 1, 2, 3), (), ()), Kept(select=4), "keeps at least one"),
    (((4,), (), ()), Kept(select=4), "keeps at least one|4 key/value heads"),
    (((0,), ()), Kept(select=4), "gives 2 layers"),
])
def test_bad_exact_heads_are_refused_in_one_line(exact, kept, match):
    with pytest.raises(UserError, match=match):
        linearize(tiny(), [6] * 3, ATTENTION, kept=kept, layers=[0, 1, 2], exact_heads=exact)


def test_exact_heads_in_a_kept_layer_are_refused():
    with pytest.raises(UserError, match="not linear"):
        StudentSpec(base_model="x", dims=(6,) * 3, layers=(0, 2), attention=ATTENTION, kept=Kept(select=4),
                    exact_heads=((), (1,), ()))


def test_the_heads_chosen_are_the_best_scored_with_one_linear_head_left(tmp_path):
    """`choose.exact_heads` ranks key/value heads by their best query head's score, passes over a head that would
    leave its layer no linear one, and takes a share of all the model's key/value heads as a count."""
    import json

    from dofattn import recipe as recipes
    from dofattn.distill.choose import exact_count, exact_heads

    model = tiny()                                                   # 8 query heads on 4 kv heads, 3 layers
    scores = [[0.0] * 8 for _ in range(3)]
    for layer, head, value in ((0, 0, 0.9), (0, 2, 0.8), (0, 4, 0.7), (0, 6, 0.6), (2, 7, 0.5), (1, 1, 0.4)):
        scores[layer][head] = value                                  # query head h is kv head h // 2's
    (tmp_path / "copy_scores.json").write_text(json.dumps({"heads": scores}))
    recipe = recipes.load("long-context", overrides={"student.keep_softmax": 0, "student.exact_heads": 5})
    chosen = exact_heads(recipe, model, None, tmp_path, [0, 1, 2])
    assert chosen == [[0, 1, 2], [0], [3]]                           # layer 0's fourth head passed over
    assert exact_count(0.1, 3, 30) == 9 and exact_count(0.001, 3, 30) == 1 and exact_count(9.0, 3, 30) == 9


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2",
                                    "gpt2", "gpt_neox"])
def test_every_family_runs_exact_heads(family):
    """In each supported family (GQA, biases, q/k norms, soft caps on the eager path, sliding-window layers kept,
    fused projections, partial rotary): the first new token's logits are the forward's, and left-padded rows
    generate what they generate alone."""
    from tests.test_attention import assert_batched_as_alone
    from tests.test_families import LAYERS, student_layers, tiny as family_model

    model = family_model(family)
    layers = student_layers(family)
    exact = [(0,) if i == layers[0] else () for i in range(LAYERS)]
    linearize(model, [6] * LAYERS, ATTENTION, kept=Kept(select=4, select_observe=3, select_pool=3), layers=layers,
              seed=1, exact_heads=exact)
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        seq, logits = logits_as_generated(model, ids, 3)
        torch.testing.assert_close(logits[:, 0], model(ids).logits[:, -1], rtol=1e-4, atol=1e-4)
    assert_batched_as_alone(model, new_tokens=4)


def test_exact_heads_attend_as_the_same_heads_of_a_whole_kept_layer():
    """The whole-layer choice is the special case: the exact heads of a linear layer give, at the prompt and at every
    step after it (sink, chosen and window keys), what the same heads give when their whole layer is kept bounded."""
    kept = Kept(select=4, select_observe=3, select_pool=3)
    whole, mixed_ = tiny(), tiny()
    linearize(whole, [6] * 3, ATTENTION, kept=kept, layers=[1, 2], seed=1)               # layer 0 kept whole
    linearize(mixed_, [6] * 3, ATTENTION, kept=kept, layers=[0, 1, 2], seed=1, exact_heads=((0, 1, 2), (), ()))
    ids = torch.randint(3, 300, (2, 30), generator=torch.Generator().manual_seed(13))
    steps = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(14))
    outs = []
    for model in (whole, mixed_):
        seen = []
        hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
            for t in range(steps.shape[1]):
                cache = model(steps[:, t:t + 1], past_key_values=cache, use_cache=True).past_key_values
        hook.remove()
        outs.append(torch.cat(seen, 1)[..., :6 * 8])                  # query heads 0-5: key/value heads 0, 1, 2
    assert outs[0].shape == (2, 36, 48)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exact", [((1, 2), (), (0, 3)), ()])
def test_the_teacher_mode_reads_a_prompt_in_chunks_as_the_teacher(exact):
    """`evaluate.teacher_mode` (eval's teacher on lm-eval's tasks) makes a student its base model: a prompt read in
    chunks then fills a plain KV cache in every layer, a linear layer's with exact heads too, and generates what the
    untouched teacher generates."""
    from dofattn.evaluate import teacher_mode

    teacher, student = tiny(), tiny()
    linearize(student, [6] * 3, ATTENTION, kept=Kept(select=4, select_observe=3, select_pool=3),
              layers=[0, 1, 2] if exact else [1, 2], seed=1, exact_heads=exact)
    set_prompt_chunk(student, 4)
    ids = torch.randint(3, 300, (2, 14), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        want = logits_as_generated(teacher, ids, 4)
        with teacher_mode(student):
            got = logits_as_generated(student, ids, 4)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
