"""Which keys a streaming bounded cache holds: each key scored once as it arrives, the best C kept as they leave the
window.

    visible = stream_visible(pos, score, kind, query_pos, window=64, count=256)   # [B, Hkv, Tq, P] bool

A kept softmax layer reading a long text in fixed memory (`student.select_by = stream`) keeps, for every query at
position i: the sink (the first S real tokens), the keys of its window (i - W < j <= i), and of the keys that have
left the window (j <= i - W) the C that score highest (ties: the earlier key). A key's score never changes, so once C
better keys have left the window a key is gone for good: the set is what a cache of S + C + W keys per kv head can
hold, whatever the text's length and however it is fed (one call, chunks, token by token).

The keys are a pool per kv head: pos [B, Hkv, P] (positions in the sequence), score [B, Hkv, P] and kind [B, Hkv, P]
(PAD: never seen, SINK: always seen, KEY: competes). Without a cache the pool is the call's keys; with one it is what
the cache kept (its sink, its C chosen keys, its window) and the call's new keys, and the rule above gives the same
answer from either, because a key dropped earlier is beaten by every key the cache kept.

    stream_visible         the fast form: for each key, the position of the C-th key that beats it
    naive_stream_visible   the spec: per query, the top C of the keys that have left its window
    keep_after             which pool entries a cache keeps after a call (`attention.bounded.StreamKVLayer`)
"""

from __future__ import annotations

import torch

__all__ = ["PAD", "SINK", "KEY", "stream_visible", "naive_stream_visible", "keep_after"]

PAD, SINK, KEY = 0, 1, 2
NEVER = torch.iinfo(torch.long).max // 4       # the position of a C-th better key that never comes


def check_stream_inputs(pos, score, kind, query_pos, window: int, count: int) -> None:
    """ValueError saying what is wrong unless the shapes and sizes are as the module docstring says."""
    if pos.dim() != 3 or score.shape != pos.shape or kind.shape != pos.shape:
        raise ValueError(f"pos, score and kind must be [B, Hkv, P] alike, got {tuple(pos.shape)}, "
                         f"{tuple(score.shape)}, {tuple(kind.shape)}")
    if query_pos.dim() != 1:
        raise ValueError(f"query_pos must be [Tq], got {tuple(query_pos.shape)}")
    if window < 1 or count < 1:
        raise ValueError(f"window and count must be >= 1, got {window}, {count}")


def _beaten_at(pos, score, kind, count: int, rows: int = 512) -> torch.Tensor:
    """[B, Hkv, P] long: for each KEY entry, the position of the count-th KEY (in position order) that beats it
    (a higher score, or the same and earlier); NEVER if fewer do. In blocks of `rows` entries: P × P at most."""
    B, Hkv, P = pos.shape
    competes = kind == KEY
    s = score.float().masked_fill(~competes, -torch.inf)
    out = torch.full_like(pos, NEVER)
    if count > P:
        return out
    for lo in range(0, P, rows):
        sj, pj = s[..., lo:lo + rows, None], pos[..., lo:lo + rows, None]          # [B, Hkv, R, 1]
        beats = competes[..., None, :] & ((s[..., None, :] > sj) | ((s[..., None, :] == sj) & (pos[..., None, :] < pj)))
        at = torch.where(beats, pos[..., None, :], NEVER)                              # [B, Hkv, R, P]
        out[..., lo:lo + rows] = at.kthvalue(count, dim=-1).values
    return out


def stream_visible(pos, score, kind, query_pos, window: int, count: int) -> torch.Tensor:
    """The fast form (see the module docstring): [B, Hkv, Tq, P] bool, whether query i (at query_pos) sees entry j."""
    check_stream_inputs(pos, score, kind, query_pos, window, count)
    i, j = query_pos[None, None, :, None], pos[..., None, :]                     # [1, 1, Tq, 1], [B, Hkv, 1, P]
    causal = j <= i
    near = causal & (j > i - window)
    held = (j <= i - window) & (_beaten_at(pos, score, kind, count)[..., None, :] > i - window)
    sink, key = (kind == SINK)[..., None, :], (kind == KEY)[..., None, :]
    return (sink & causal) | (key & (near | held))


@torch.no_grad()
def naive_stream_visible(pos, score, kind, query_pos, window: int, count: int) -> torch.Tensor:
    """The spec, one row, kv head and query at a time: the top `count` of the keys that have left the query's
    window, by score and then position."""
    check_stream_inputs(pos, score, kind, query_pos, window, count)
    B, Hkv, P = pos.shape
    out = torch.zeros(B, Hkv, len(query_pos), P, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv):
            entries = [(int(pos[b, h, e]), float(score[b, h, e]), int(kind[b, h, e]), e) for e in range(P)]
            for t, i in enumerate(query_pos.tolist()):
                left = sorted((e for e in entries if e[2] == KEY and e[0] <= i - window), key=lambda e: (-e[1], e[0]))
                held = {e[3] for e in left[:count]}
                for p, _, k, e in entries:
                    out[b, h, t, e] = p <= i and (k == SINK or (k == KEY and (p > i - window or e in held)))
    return out


def keep_after(pos, score, kind, end: int, window: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """After a call whose last position is `end - 1`: which pool entries a cache keeps for the queries from `end`
    on. Returns (held [B, Hkv, S + count] indices into the pool, sorted by position within each kv head, with
    their kinds; PAD where a slot is empty) for the sink and chosen keys that have left the window; the window's
    entries (pos > end - window) are kept by the caller as they are. S: the most SINK entries a row has."""
    B, Hkv, P = pos.shape
    gone = pos <= end - window
    sinks = (kind == SINK) & gone
    keys = (kind == KEY) & gone
    # rank: the sink first, then the keys by score and position; the rest last
    s = score.float().masked_fill(~keys, -torch.inf)
    order = torch.argsort(pos, dim=-1, stable=True)
    order = order.gather(-1, torch.argsort(-s.gather(-1, order), dim=-1, stable=True))   # score desc, then pos
    rank_key = torch.empty_like(order).scatter_(-1, order, torch.arange(P, device=pos.device).expand_as(order))
    chosen = keys & (rank_key < count)
    wanted = sinks | chosen
    S = int(sinks.sum(-1).max()) if sinks.any() else 0
    slots = min(S + count, P)
    key = torch.where(wanted, pos, NEVER)                            # kept entries by position, the rest after
    held = torch.argsort(key, dim=-1, stable=True)[..., :slots]
    held_kind = torch.where(wanted.gather(-1, held), kind.gather(-1, held), PAD)
    return held, held_kind
