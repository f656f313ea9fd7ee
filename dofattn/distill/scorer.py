"""The scorers of a streaming bounded cache (`student.select_by = stream`), trained with the backbone frozen.

    log = train_scorers(model, blocks, recipe.scorer, seed=0)     # blocks [N, T]: training text

For every kept layer that streams (`BoundedSoftmax` with a `KeyScorer`), the teacher's own queries, keys and values
on the training blocks give pairs (query i, key j) with i beyond j's window, PAIRS per key drawn at random, and their
target: log(a_ij + FLOOR), a_ij the attention query i pays key j summed over the kv head's query heads. The scorer
predicts it as content_j − rate · (i − j) / SPAN (`KeyScorer`), so the keys it keeps are those the teacher's later
queries are expected to want most. The layer's own weights and the rest of the student do not move.

The log says, on held-out blocks, how much of the attention that queries pay beyond their window lands on keys the
cache still holds (`retained`), for the scorer and for a cache that keeps the most recent keys instead.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from dofattn.attention.bounded import arriving_kinds
from dofattn.attention.scorer import SPAN
from dofattn.capture import AttentionInputs, capture, run_forward
from dofattn.evaluate import teacher_mode
from dofattn.ops.stream import stream_visible
from dofattn.student import attention_modules

FLOOR = 1e-3       # targets below this are all "not wanted": the scorer spends nothing on ranking them
HELD_OUT = 0.25    # the share of blocks that only measure
PAIRS = 16         # far queries drawn per key


def streaming_layers(model) -> dict[int, torch.nn.Module]:
    """{layer: its BoundedSoftmax} of the kept layers that stream."""
    return {i: m.dofattn_bounded for i, m in enumerate(attention_modules(model))
            if getattr(getattr(m, "dofattn_bounded", None), "streams", False)}


def group_attention(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [T, H, D], k [T, Hkv, D] of one block -> [Hkv, T, T]: causal softmax attention, summed over each kv head's
    query heads."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    logits = scaling * torch.einsum("thd,shd->hts", q.float(), k.float().repeat_interleave(H // Hkv, 1))
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(logits.masked_fill(~causal, -torch.inf), -1).reshape(Hkv, H // Hkv, T, T).sum(1)


def far_pairs(attention: torch.Tensor, window: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """For each key j with a query beyond its window, PAIRS queries i >= j + window drawn at random from one block's
    `group_attention` [Hkv, T, T]: (keys [n], distances [n, PAIRS], targets log(a_ij + FLOOR) [Hkv, n, PAIRS])."""
    T = attention.shape[-1]
    keys = torch.arange(max(T - window, 0))
    room = (T - window - keys).float()                                                  # far queries of each key
    i = keys[:, None] + window + (torch.rand(len(keys), PAIRS, generator=generator) * room[:, None]).long()
    target = torch.log(attention[:, i, keys[:, None]] + FLOOR)                          # [Hkv, n, PAIRS]
    return keys, (i - keys[:, None]).float(), target


def retained(weights: torch.Tensor, score: torch.Tensor, bounded) -> float:
    """The share of the attention that queries pay beyond their window (sink aside) which lands on keys a streaming
    cache with these scores [Hkv, T] still holds, on one block (its `group_attention` weights [Hkv, T, T])."""
    Hkv, T, _ = weights.shape
    kind, _ = arriving_kinds(torch.ones(1, T, dtype=torch.bool), torch.zeros(1, dtype=torch.long), bounded.sink)
    pos = torch.arange(T).expand(1, Hkv, T)
    seen = stream_visible(pos, score[None], kind[:, None].expand(1, Hkv, T), torch.arange(T), bounded.width,
                          bounded.count)[0]                                               # [Hkv, T, T]
    far = torch.ones(T, T, dtype=torch.bool).tril(-bounded.width) & (torch.arange(T) >= bounded.sink)
    return float((weights * (far & seen)).sum() / (weights * far).sum().clamp_min(1e-30))


def train_scorers(model, blocks: torch.Tensor, config, seed: int = 0, progress: bool = True) -> dict:
    """Train every streaming layer's scorer on `blocks` [N, T] (see the module docstring); returns the log."""
    layers = streaming_layers(model)
    if not layers or not config.steps:
        return {}
    device = next(model.parameters()).device
    inputs = {i: [] for i in layers}

    def keep(a: AttentionInputs) -> None:
        inputs[a.layer].append((a.query[0].detach().float().cpu(), a.key[0].detach().float().cpu(),
                                a.value[0].detach().float().cpu(), a.scaling))

    with torch.no_grad(), teacher_mode(model), capture(model, keep, layers=list(layers)):
        for block in tqdm(blocks, desc="scorer: teacher q/k/v", unit="block", disable=not progress):
            run_forward(model, block[None].to(device))
    split = max(1, math.ceil(len(blocks) * (1 - HELD_OUT))) if len(blocks) > 1 else 1
    generator = torch.Generator().manual_seed(seed)
    log = {}
    for i, bounded in tqdm(layers.items(), desc="scorer: layers", unit="layer", disable=not progress):
        scorer = bounded.scorer
        held = range(split, len(inputs[i])) or range(1)      # too few blocks: the first one measures
        data, weights = [], []     # the held blocks' pairs are drawn too: a block's pairs do not depend on the split
        for n, (q, k, v, s) in enumerate(inputs[i]):
            attention = group_attention(q, k, s)                                        # [Hkv, T, T]
            data.append((k, v, far_pairs(attention, bounded.width, generator)))
            if n in held:
                weights.append((k, v, attention))
        train = data[:split]
        params = list(scorer.parameters())
        was = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=config.lr)
        losses = []
        with torch.enable_grad():
            for _ in range(config.steps):
                k, v, (keys, distance, target) = train[int(torch.randint(len(train), (1,), generator=generator))]
                content = scorer.content(k[None].to(device), v[None].to(device))[0][:, keys]     # [Hkv, n]
                guess = content[..., None] - scorer.rate()[:, None, None] * distance.to(device) / SPAN
                loss = (guess - target.to(device)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        for p, g in zip(params, was):
            p.requires_grad_(g)
        with torch.no_grad():
            kept = [retained(a, scorer(k[None].to(device), v[None].to(device))[0].cpu(), bounded)
                    for k, v, a in weights]
            recent = [retained(a, torch.arange(k.shape[0], dtype=torch.float32).expand(k.shape[1], -1), bounded)
                      for k, v, a in weights]
        log[str(i)] = {"loss_first": round(sum(losses[:10]) / len(losses[:10]), 4),
                       "loss_last": round(sum(losses[-10:]) / len(losses[-10:]), 4),
                       "retained": round(sum(kept) / len(kept), 4),
                       "retained_recent": round(sum(recent) / len(recent), 4),
                       "rate": [round(float(r), 4) for r in scorer.rate().detach()]}
    return log
