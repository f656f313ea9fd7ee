"""Beam search and batch surgery on a student's cache: `generate(num_beams=3)` reorders the linear layers' states
(`LinearStateLayer.reorder_cache`) every step and must return the beams that a beam search over full forwards,
with no cache at all, finds, with their scores; a cache whose rows are repeated and picked
(`batch_repeat_interleave`, `batch_select_indices`) continues each row as the full forward of its own sequence.

Tiny Llamas (tests/test_families.py's) linearized three ways: a window + sink hybrid, pure linear attention, and
pure linear attention with a short convolution beside a kept softmax layer (a KV cache reordered with the states).
"""

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from dofattn.attention import LinearStateLayer
from dofattn.attention.cache import cache_kwargs
from dofattn.spec import Attention
from dofattn.model.student import linearize
from tests.test_families import LAYERS, ids, tiny

BEAMS, NEW_TOKENS = 3, 6
STUDENTS = {   # name: (attention, linearized layers); prompts of 10 tokens run past the window and sink
    "hybrid": (Attention(window=4, sink=1), list(range(LAYERS))),
    "linear": (Attention(window=0, sink=0), list(range(LAYERS))),
    "linear-conv-softmax": (Attention(window=0, sink=0, conv=2), [0, 2, 3]),
}


def student(name: str):
    """A tiny Llama student with moved features (not a fresh build's) and calibrated key shifts, in eval mode."""
    attention, layers = STUDENTS[name]
    model = tiny("llama", seed=3)
    linearize(model, [12] * LAYERS, attention, layers=layers, seed=1)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if ".dofattn." in param_name:
                p.add_(0.1 * torch.randn_like(p))
        model(input_ids=ids(2, 16, seed=9), use_cache=False)          # the key shifts, fixed from here on
    return model.eval()


def next_log_probs(model, sequence: list[int]) -> torch.Tensor:
    """log p(next token | sequence) [V], float32, from a full forward of the sequence, without a cache."""
    logits = model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


def beam_search_without_cache(model, prompt: list[int], beams: int, new_tokens: int):
    """Beam search as `generate` does it with no EOS token (the best `beams` of every beam's continuations, each
    step), every step's candidates scored by full forwards: [(summed log-prob, tokens)], best first, and whether
    some step's survivors came from the beams in another order than 0, 1, 2 (a reorder that matters)."""
    running, reordered = [(0.0, prompt)], False
    for _ in range(new_tokens):
        candidates = []
        for parent, (score, sequence) in enumerate(running):
            top = next_log_probs(model, sequence).topk(beams)
            candidates += [(score + float(lp), sequence + [int(t)], parent) for lp, t in zip(*top)]
        candidates.sort(key=lambda c: -c[0])
        reordered |= [parent for *_, parent in candidates[:beams]] != list(range(beams))
        running = [(score, sequence) for score, sequence, _ in candidates[:beams]]
    return running, reordered


@pytest.mark.parametrize("name", STUDENTS)
def test_beam_search_returns_the_beams_of_full_forwards(name, monkeypatch):
    model = student(name)
    prompts = ids(2, 10, seed=4)
    orders = []
    reorder = LinearStateLayer.reorder_cache

    def recording(self, beam_idx):
        orders.append(beam_idx.tolist())
        reorder(self, beam_idx)

    monkeypatch.setattr(LinearStateLayer, "reorder_cache", recording)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=NEW_TOKENS, num_beams=BEAMS, num_return_sequences=BEAMS,
                             do_sample=False, length_penalty=0.0, early_stopping=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
        expected = [beam_search_without_cache(model, row.tolist(), BEAMS, NEW_TOKENS) for row in prompts]
    linear = len(STUDENTS[name][1])
    assert len(orders) == NEW_TOKENS * linear and all(len(order) == 2 * BEAMS for order in orders)
    assert any(order != list(range(2 * BEAMS)) for order in orders)      # beams were moved between rows
    assert all(reordered for _, reordered in expected)
    kinds = {type(layer) for layer in out.cache.layers}
    assert kinds == ({LinearStateLayer} if linear == LAYERS else {LinearStateLayer, DynamicLayer})
    got = out.sequences.view(2, BEAMS, -1)
    for row, (beams, _) in enumerate(expected):
        assert got[row].tolist() == [sequence for _, sequence in beams], f"prompt {row}"
        torch.testing.assert_close(out.sequences_scores.view(2, BEAMS)[row],
                                   torch.tensor([score for score, _ in beams]), atol=1e-4, rtol=0)
        with torch.no_grad():      # the best beam's score is its summed log-prob under one full forward
            best = got[row, 0]
            log_probs = torch.log_softmax(model(input_ids=best[None], use_cache=False).logits[0].float(), -1)
            summed = log_probs[prompts.shape[1] - 1:-1].gather(-1, best[prompts.shape[1]:, None]).sum()
        torch.testing.assert_close(out.sequences_scores.view(2, BEAMS)[row, 0], summed, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", STUDENTS)
def test_a_cache_with_rows_repeated_and_picked_continues_each_row(name):
    """Two prompts prefilled, each row repeated twice, then rows 3, 0 and 1 kept: one more token on each row gives
    what the full forward of that row's prompt and token gives."""
    model = student(name)
    prompts, tokens = ids(2, 10, seed=5), torch.tensor([7, 11, 13])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=prompts, **cache_kwargs(model, cache))
        cache.batch_repeat_interleave(2)
        cache.batch_select_indices(torch.tensor([3, 0, 1]))
        rows = prompts[[1, 0, 0]]
        step = model(input_ids=tokens[:, None], attention_mask=torch.ones(3, rows.shape[1] + 1, dtype=torch.long),
                     **cache_kwargs(model, cache)).logits[:, -1]
        full = model(input_ids=torch.cat([rows, tokens[:, None]], 1), use_cache=False).logits[:, -1]
    assert all(isinstance(cache.layers[i], LinearStateLayer) for i in STUDENTS[name][1])
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)
