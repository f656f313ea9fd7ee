"""A long prompt read in chunks (`model.prompt`): the outputs, the cache and the kept layers' choice of one call."""

import importlib

import pytest
import torch
from transformers import DynamicCache

from dofattn.model.bounded import BoundedKVLayer, PromptKVLayer
from dofattn.model.prompt import set_prompt_chunk
from dofattn.attention.cache import cache_kwargs
from dofattn.spec import Attention, Kept
from dofattn.model.student import linearize
from tests.conftest import tiny_model

FAMILIES = ["llama", "gpt2", "gpt_neox"]
T = 41                     # a prompt of 41 tokens, read in chunks of 6 (the last one 5), 13 and 40 (the last 1)


HYBRID = Attention(window=4, sink=2, decay="head", conv=4)
PURE = Attention(window=0, sink=0, decay="head", conv=4)


def student(family: str, select: int = 5, attention: Attention = HYBRID):
    """Layers 0 and 2 linear (by default a window of 4, a sink of 2, a decay, a convolution); layer 1 kept, bounded
    to a sink, `select` chosen keys (0: every key) and a window after the prompt."""
    model = tiny_model(family)
    kept = Kept(select=select, select_observe=3, select_pool=3) if select else Kept()
    linearize(model, [4] * 3, attention, kept=kept, layers=[0, 2], seed=1)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():                   # the convolutions start as the identity: make them mix
        for module in model.modules():
            if isinstance(getattr(module, "dofattn", None), torch.nn.Module):
                for name in ("conv_q", "conv_k", "conv_v"):
                    weight = getattr(module.dofattn.conv, name)
                    weight.copy_(0.6 * torch.randn(weight.shape, generator=g))
    return model


def prompt(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 300, (batch, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(batch, T, dtype=torch.long)
    mask[1, :7] = 0                                        # left padding in the second row
    return ids, mask


def generated(model, chunk: int):
    set_prompt_chunk(model, chunk)
    ids, mask = prompt()
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [6, 13, 40])
@pytest.mark.parametrize("select,attention", [(0, HYBRID), (5, HYBRID), (0, PURE)], ids=["kept", "bounded", "pure"])
def test_generate_in_chunks_gives_the_outputs_and_cache_of_one_call(family, chunk, select, attention):
    """Also: the padding (7 tokens in the second row) spans chunks, which a decay without a window continues."""
    model = student(family, select, attention)
    whole, chunked = generated(model, 0), generated(model, chunk)
    assert torch.equal(chunked.sequences, whole.sequences)
    torch.testing.assert_close(torch.stack(chunked.logits), torch.stack(whole.logits), rtol=1e-4, atol=1e-4)
    one, read = whole.past_key_values.layers, chunked.past_key_values.layers
    assert [type(slot) for slot in read] == [type(slot) for slot in one]
    if select:                               # the same keys chosen, from the whole prompt, in the same slots
        assert isinstance(read[1], BoundedKVLayer) and read[1].seen == T + 8
        for name in BoundedKVLayer.NAMES:
            torch.testing.assert_close(getattr(read[1], name), getattr(one[1], name), rtol=1e-4, atol=1e-4)
    for i in (0, 2):
        for name, tensor in one[i].tensors().items():
            torch.testing.assert_close(read[i].tensors()[name], tensor, rtol=1e-4, atol=1e-4)


def test_a_forward_with_a_cache_in_chunks_gives_every_asked_logit():
    model = student("llama")
    ids, mask = prompt()
    outs = {}
    with torch.no_grad():
        for chunk in (0, 6):
            set_prompt_chunk(model, chunk)
            every = model(ids, attention_mask=mask, use_cache=True)
            last = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=8)
            plain = model(ids, None, None, None, None, None, True, 0, return_dict=False)
            outs[chunk] = every.logits, last.logits, plain[0], every.past_key_values.layers[1]
    for whole, chunked in zip(outs[0], outs[6]):
        if isinstance(whole, torch.Tensor):
            assert chunked.shape == whole.shape
            torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    assert outs[6][1].shape[1] == 8 and isinstance(outs[6][3], BoundedKVLayer)


def test_prompt_layer_holds_the_keys_until_the_last_chunk_and_training_reads_in_one_call():
    model = student("llama")
    set_prompt_chunk(model, 6)
    ids, _ = prompt()
    calls, slots = [], []
    kept = model.model.layers[1].self_attn
    kept.register_forward_hook(lambda m, args, kwargs, out: slots.append(type(kwargs["cache"].layers[1]))
                               if kwargs["cache"] is not None else None, with_kwargs=True)
    model.model.register_forward_hook(lambda *_: calls.append(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    assert len(calls) == 7 and slots == [PromptKVLayer] * 6 + [BoundedKVLayer]
    calls.clear()
    model.train()
    model(ids, labels=ids, use_cache=False).loss.backward()     # training: one call, gradients as always
    model(ids, use_cache=True).logits.sum().backward()
    assert len(calls) == 2


def test_hf_prefill_chunks_are_read_as_one_prompt():
    """HF's `prefill_chunk_size` sets the chunk for the call: the kept layer chooses from the whole prompt."""
    model = student("llama")
    whole = generated(model, 0)
    ids, mask = prompt()
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0, prefill_chunk_size=6)
    assert torch.equal(hf.sequences, whole.sequences) and model.prompt_chunk == 0
    for name in BoundedKVLayer.NAMES:
        torch.testing.assert_close(getattr(hf.past_key_values.layers[1], name),
                                   getattr(whole.past_key_values.layers[1], name), rtol=1e-4, atol=1e-4)


def test_a_kept_layer_reads_a_chunk_in_query_blocks(monkeypatch):
    """A chunk after the first: the kept layer's queries in blocks (here 4) against every key so far, kv heads
    shared in the kernel: the outputs of one call."""
    monkeypatch.setattr(importlib.import_module("dofattn.model.install"), "QUERY_BLOCK", 4)
    model = student("llama", select=0)
    whole, chunked = generated(model, 0), generated(model, 13)
    assert torch.equal(chunked.sequences, whole.sequences)
    torch.testing.assert_close(torch.stack(chunked.logits), torch.stack(whole.logits), rtol=1e-4, atol=1e-4)


def test_a_bounded_student_read_as_its_teacher_generates_past_its_prompt():
    """In `teacher_mode` (how `eval` scores the teacher) a bounded student's prompt, read in chunks, announces its
    length as always; nothing bounds the slot, and the tokens generated after the prompt go on past it: the
    teacher's own greedy tokens."""
    from dofattn.evaluate import teacher_mode

    model = student("llama")
    ids = prompt()[0][:1]
    with torch.no_grad(), teacher_mode(model):
        set_prompt_chunk(model, 6)
        chunked = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
        set_prompt_chunk(model, 0)
        whole = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(chunked, whole)


def test_reading_progress_reports_each_chunk():
    """`reading_progress`: a prompt of 41 tokens read in chunks of 13 reports 13, 26, 39 and 41 of 41; outside it
    nothing is called, and a decode step reports nothing."""
    from dofattn.model.prompt import reading_progress

    model = student("llama")
    set_prompt_chunk(model, 13)
    ids, mask = prompt()
    seen = []
    with torch.no_grad():
        with reading_progress(lambda done, total: seen.append((done, total))):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                           pad_token_id=0)
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert seen == [(13, T), (26, T), (39, T), (41, T)]


def test_generate_times_the_prompt_apart_from_the_new_tokens(model_dirs, monkeypatch):
    """`dofattn generate`'s job: the prompt's time (to its first new token) and the rate of the tokens after it,
    with a progress bar over the chunks of a long prompt."""
    from dofattn.jobs.generate import GenerateConfig, run

    monkeypatch.setattr("dofattn.model.prompt.PROMPT_CHUNK", 4)
    lines = []
    result = run(GenerateConfig(model=str(model_dirs["llama"]), student="window", prompt="the quick brown fox " * 5,
                                max_new_tokens=5), progress=lines.append)
    assert result["prompt_tokens"] > 4 and 0 < result["prompt_s"] < result["seconds"]
    later = result["new_tokens"] - 1
    assert later < 1 or result["tokens_per_s"] == pytest.approx(later / (result["seconds"] - result["prompt_s"]))
    assert any("generating with" in line for line in lines)
