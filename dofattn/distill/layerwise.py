"""The layerwise stage: each linearized layer's feature map trained alone against the teacher's attention.

Layer l trains with a generator seeded by (seed, l) on batches of the teacher's own q/k/v (`TeacherStream`, which
makes them layer by layer from the blocks' hidden states; on long blocks the softmax loss reads a sample of rows, `layerwise.rows`), Adam at the paper's learning rates (directions
and projections `lr`, PRF weights `lr_weights`). Each layer's result is saved to `layers/layer_XX.safetensors` as
soon as it is done, so a killed run redoes at most one layer.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dofattn.attention import LinearAttention
from dofattn.distill.losses import LOSSES, sample_rows
from dofattn.distill.teacher import TeacherStream
from dofattn.distill.world import barrier, world
from dofattn.io import read_safetensors, save_tensors
from dofattn.ops.softmax import expand_kv
from dofattn.recipe import Layerwise
from dofattn.model.attach import bounded_of
from dofattn.model.student import attention_modules, linear_parts


def param_groups(linear: LinearAttention, lr: float, lr_weights: float) -> list[dict]:
    """PRF weights (log α) at `lr_weights`, every other trainable parameter at `lr`; none of a part that the layerwise
    stage does not fit (`Part.layerwise`: a convolution of the inputs trains end to end)."""
    weights, rest = [], []
    end_to_end_only = {id(p) for part in linear.parts() if not part.layerwise for p in part.parameters()}
    for name, p in linear.named_parameters():
        if p.requires_grad and id(p) not in end_to_end_only:
            (weights if name.endswith("log_weights") else rest).append(p)
    return [g for g in ({"params": rest, "lr": lr}, {"params": weights, "lr": lr_weights}) if g["params"]]


def train_layer(linear: LinearAttention, acts, scaling: float, config: Layerwise, seed: int, desc: str = "",
                progress: bool = True) -> dict:
    """Adam on one layer's feature map against its teacher activations (q, k, v) [N, T, ...]; returns a log."""
    q_all, k_all, v_all = acts
    device = next(itertools.chain(linear.parameters(), linear.buffers())).device
    loss_fn = LOSSES[config.loss]

    def batch(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, and k and v with their kv heads repeated for every query head, on the layer's device."""
        heads = q_all.shape[2]
        return q_all[idx].to(device), expand_kv(k_all[idx], heads).to(device), expand_kv(v_all[idx], heads).to(device)

    groups = param_groups(linear, config.lr, config.lr_weights)
    steps = config.steps if groups else 0            # nothing to train (performer): only the loss is reported
    optimizer = torch.optim.Adam(groups) if groups else None
    fixed = torch.arange(min(config.batch_size, len(q_all)))
    gen = torch.Generator().manual_seed(seed)
    losses, skipped, start = [], [], time.perf_counter()
    linear.train()
    if linear.needs_gain_calibration():           # the linear part put on the exact keys' scale first
        q, k, _ = batch(fixed)
        linear.calibrate_gain(q, k)
    T = q_all.shape[1]

    exact = 0  # the leading rows the student reads exactly (no linear pair): nothing to learn there
    if 0 < config.rows < T:
        has_linear = linear.attention.linear_pairs(T).any(-1)
        exact = int(has_linear.float().argmax()) if has_linear.any() else T

    def rows(generator: torch.Generator) -> dict:
        """The softmax loss's sampled rows (`layerwise.rows`, `losses.sample_rows`), or nothing: every row."""
        if not 0 < config.rows < T:
            return {}
        return {"at": sample_rows(T, config.rows, generator, device, exact=exact)}

    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False)
    for _ in bar:
        picked = batch(torch.randint(len(q_all), (config.batch_size,), generator=gen))
        value = loss_fn(linear, *picked, scaling, **rows(gen))
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        if all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in linear.parameters()):
            optimizer.step()
        else:                        # an inf/NaN gradient (keys far below the PRF shift) would make the layer NaN
            skipped.append(len(losses))
        losses.append(value.item())
        bar.set_postfix(loss=f"{value.item():.4f}")
    linear.eval()
    with torch.no_grad():  # the loss on a fixed batch, for the log
        q, k, v = batch(fixed)
        final = loss_fn(linear, q, k, v, scaling, **rows(torch.Generator().manual_seed(seed))).item()
        alive = keys_with_features(linear, k)
    tail = losses[-max(1, len(losses) // 10):] if losses else [final]
    return {"steps": steps, "first_loss": losses[0] if losses else final, "last_loss": sum(tail) / len(tail),
            "fixed_batch_loss": final, "keys_with_features": alive, "seconds": round(time.perf_counter() - start, 2),
            **({"skipped_steps": skipped} if skipped else {})}


DEAD_KEYS = 0.5   # a layer whose keys are mostly without a feature gets a warning (`keys_with_features`)


def keys_with_features(linear: LinearAttention, k: torch.Tensor) -> float:
    """The share of keys k [B, T, H, D] (on query heads) with at least one feature above 0 in float32: below 1 where
    a PRF map's one key shift per head leaves long keys hundreds of nats under it (Gemma 3's layer 11, QK-norm:
    0.7%; then the linear branch reads nothing and the layer is its window and sink)."""
    phi = linear.feature_map(k, "key")                                                # [B, T, H, M]
    return (phi.amax(-1) > 0).float().mean().item()


def layer_file(out: Path, layer: int) -> Path:
    return out / "layers" / f"layer_{layer:02d}.safetensors"


def save_layer(out: Path, layer: int, linear: LinearAttention, log: dict) -> None:
    path = layer_file(out, layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in linear.state_dict().items()}
    save_tensors(state, path, metadata={"log": json.dumps(log)})


def load_layer(out: Path, layer: int, linear: LinearAttention) -> dict:
    state, metadata = read_safetensors(layer_file(out, layer))
    linear.load_state_dict(state)
    return json.loads(metadata["log"])


def layerwise(model, stream: TeacherStream, out: Path, config: Layerwise, seed: int, progress: bool = True) -> dict:
    """Train every linearized layer (this rank's share: layer l on rank l mod size) on the teacher's q/k/v, which
    `stream` makes layer by layer; finished layer files are loaded, not trained again. Every rank ends with every
    layer. Returns the logs by layer."""
    rank, size = world()
    modules, linear = attention_modules(model), linear_parts(model)
    logs = {i: load_layer(out, i, part) for i, part in linear.items()
            if i % size == rank and layer_file(out, i).is_file()}
    for layer, acts in stream.walk([i for i in linear if i % size == rank and i not in logs]):
        bounded = bounded_of(modules[layer])
        if bounded is not None:              # exact heads beside the linear ones: the linear heads' q/k/v
            acts = bounded.heads.split(*acts, dim=2)[1]
        log = train_layer(linear[layer], acts, modules[layer].scaling, config, seed=seed * 100_003 + layer,
                          desc=f"layer {layer:2d} ({config.loss})", progress=progress)
        del acts                             # before the stream makes the next layer's
        if progress:
            print(f"layer {layer:2d}: {config.loss} loss {log['first_loss']:.4f} -> {log['last_loss']:.4f} "
                  f"({log['seconds']:.0f} s)", flush=True)
        if log["keys_with_features"] < DEAD_KEYS:
            print(f"WARNING: layer {layer}: {1 - log['keys_with_features']:.1%} of its keys have no feature in "
                  f"float32's range (keys far longer than the queries, as QK-norm makes them): its linear branch "
                  f"reads almost nothing, so it acts as its window and sink; keep it as softmax "
                  f"(student.keep_softmax) or give it a window that covers what it reads", flush=True)
        if log.get("skipped_steps"):
            print(f"WARNING: layer {layer}: {len(log['skipped_steps'])} of {log['steps']} steps skipped, their "
                  f"gradients not finite", flush=True)
        save_layer(out, layer, linear[layer], log)
        logs[layer] = log
    barrier()
    for layer, part in linear.items():       # every rank ends with every layer
        if layer not in logs:
            logs[layer] = load_layer(out, layer, part)
    return dict(sorted(logs.items()))
