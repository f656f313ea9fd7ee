"""Prototype, not a part of the package: a student's kept softmax layers with capped RoPE distances (a pair more
than W tokens apart attends as if exactly W apart: its query rotated to position W, its key to position 0), on one
block of the validation articles; prints the student's perplexity by context length.

    python experiments/capped_positions.py runs/lc-log8k 8192          # one 32 K block, 11 min on the 2-core CPU
    python experiments/capped_positions.py runs/lc-log8k 1023 1024     # check: W = T - 1 caps nothing

Below 4 K tokens it also scores the plain student and prints the largest log-probability difference (W = T - 1:
5e-5). Queries in blocks of 256; each block's near keys (distance < W) and far keys (≥ W) share one softmax."""
import importlib
import json
import math
import sys
import time

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from dofattn import evaluate
from dofattn.data import token_blocks
from dofattn.model.student import load_student

inst = importlib.import_module("dofattn.model.install")   # the module (the package's `install` is a function)
run, W = sys.argv[1], int(sys.argv[2])
T_BLOCK = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
model, tok, _ = load_student(run)
model.eval()
rot = model.model.rotary_emb
plain = inst._softmax


def rotate(x, offsets):
    """x [B, H, T, D] rotated by `offsets` [T] more positions."""
    cos, sin = rot(x, offsets[None])
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


def capped(module, query, key, value, attention_mask, eager, **kw):
    B, H, T, D = query.shape
    if key.shape[2] != T or T <= W or module.training:
        return plain(module, query, key, value, attention_mask, eager, **kw)
    pos = torch.arange(T)
    rep = H // key.shape[1]
    k, v = key.repeat_interleave(rep, 1).float(), value.repeat_interleave(rep, 1).float()
    q = query.float()
    q_far = rotate(q, W - pos)         # the query as if at position W
    k_u = rotate(k, -pos)              # the keys as if at position 0
    scale = kw.get("scaling", module.scaling)
    out = torch.empty(B, T, H, D)
    for a in range(0, T, 256):
        b = min(T, a + 256)
        t = pos[a:b, None]
        lo = max(0, a - W + 1)
        s = pos[None, lo:b]
        near = torch.einsum("bhtd,bhsd->bhts", q[:, :, a:b], k[:, :, lo:b]) * scale
        near = near.masked_fill(~((s <= t) & (t - s < W)), -math.inf)
        parts, vals = [near], [v[:, :, lo:b]]
        hi = b - W
        if hi > 0:
            s2 = pos[None, :hi]
            far = torch.einsum("bhtd,bhsd->bhts", q_far[:, :, a:b], k_u[:, :, :hi]) * scale
            parts.append(far.masked_fill(~(t - s2 >= W), -math.inf))
            vals.append(v[:, :, :hi])
        p = torch.softmax(torch.cat(parts, -1), -1)
        out[:, a:b] = torch.einsum("bhts,bhsd->bthd", p, torch.cat(vals, 2))
    return out.to(query.dtype), None


ids = token_blocks("wiki-sample", tok, T_BLOCK, 1, split="validation", seed=0)        # [1, T_BLOCK]
if T_BLOCK < 4096:   # a check: W = T - 1 caps nothing, so the capped form must give the plain one's numbers
    with torch.no_grad():
        ref = torch.cat(evaluate._log_probs(model, ids))
inst._softmax = capped
start = time.time()
with torch.no_grad():
    lp = torch.cat(evaluate._log_probs(model, ids))
if T_BLOCK < 4096:
    print("max |diff| of log-probs against plain:", (lp - ref).abs().max().item())
nll = -lp.gather(1, ids[0, 1:, None])[:, 0]
edges = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
res = {}
for a, b in zip(edges, edges[1:]):   # the prediction at index i sees i + 1 tokens
    res[f"{a}-{b - 1}"] = round(math.exp(nll[a - 1:b - 1].mean().item()), 2)
print(json.dumps({"W": W, "seconds": round(time.time() - start), "student_ppl_by_context": res}))
