"""Evaluation against the teacher: perplexity, and the teacher's own numbers from the same model object.

    with teacher_mode(student):            # linear layers bypassed: the original softmax model
        teacher_ppl = perplexity(student, blocks)
    student_ppl = perplexity(student, blocks)

`teacher_mode` works because a linearized model keeps every original weight: switching the attention
implementation back to SDPA skips the linear layers entirely, so no second copy of the model is needed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from dofattn.attention import IMPLEMENTATION


@contextlib.contextmanager
def teacher_mode(model) -> Iterator[None]:
    """While active, `model` computes softmax attention in every layer (its linear layers are ignored)."""
    current = model.config._attn_implementation
    if current != IMPLEMENTATION:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 4, desc: str = "perplexity",
               progress: bool = True) -> float:
    """exp(mean next-token cross-entropy) over `blocks` [N, T] (T−1 predictions per block)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in tqdm(range(0, len(blocks), batch_size), desc=desc, unit="batch", disable=not progress,
                      leave=False):
        ids = blocks[start:start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="sum")
        total += nll.item()
        count += ids[:, 1:].numel()
    return math.exp(total / count)
