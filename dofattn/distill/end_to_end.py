"""The end-to-end phase: the whole student against the frozen teacher, on text, resumable from checkpoints.

The loss is the student's next-token cross-entropy on the text plus `kd_weight` × KL(teacher ‖ student) on the logits
(`loss`): the body runs once for each model, the LM head on `loss_chunk` positions at a time (each chunk recomputed in
the backward pass), so neither model's full logits are ever kept. `activation_checkpointing` replays each decoder
layer in the backward pass too (`layers_checkpointed`). Only student tensors train (feature maps, window gains,
decays, filters, LoRA adapters). Step i trains on blocks drawn from (seed, i) alone (`draw`), so a resumed,
continued or longer run draws what one run made at once would.

With several processes (torchrun) each takes its share of a step's blocks, and the model is sharded over them with
FSDP2 (`shard`): each decoder layer's weights, the teacher's frozen ones included, the student's tensors and their
Adam state; gradients are averaged in float32. Checkpoints gather the student whole and rank 0 writes them, in the
same files one process writes; after the phase rank 0 builds the student whole from the last one (run.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from dofattn.attention import Part
from dofattn.distill.world import all_max, all_mean, barrier, rank0_decides, world
from dofattn.errors import UserError
from dofattn.evaluate import head, hidden_states, perplexity, teacher_mode, vocabulary
from dofattn.io import read_safetensors, save_tensors, write_json
from dofattn.model.hf import decoder_layers
from dofattn.recipe import EndToEnd
from dofattn.model.student import is_student_tensor, linear_parts


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    """What the phase trains: the student's tensors that require a gradient."""
    return [(n, p) for n, p in model.named_parameters() if is_student_tensor(n) and p.requires_grad]


def own_rates(model, config) -> dict[int, float]:
    """Parameter id -> the learning rate its part has of its own: a part's `rate` names a key of `end_to_end` (the
    convolution's `conv_lr`), which the recipe set."""
    return {id(p): rate for m in model.modules() if isinstance(m, Part) and m.rate is not None
            and (rate := getattr(config, m.rate)) is not None for p in m.parameters()}


def param_groups(named: list[tuple[str, torch.nn.Parameter]], lr: float,
                 own: dict[int, float]) -> tuple[list[str], list[dict]]:
    """(names in the optimizer's order, Adam groups): everything at `lr`, then a group for each rate of `own`
    (`own_rates`). Each group keeps its rate as "base_lr" for the cooldown."""
    parts = [([(n, p) for n, p in named if id(p) not in own], lr),
             *(([(n, p) for n, p in named if own.get(id(p)) == rate], rate) for rate in dict.fromkeys(own.values()))]
    return ([n for part, _ in parts for n, _ in part],
            [{"params": [p for _, p in part], "lr": rate, "base_lr": rate} for part, rate in parts if part])


def _chunk_loss(model, hidden: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None,
                kd_weight: float) -> torch.Tensor:
    """Summed CE + kd_weight × summed KL(teacher ‖ student) over one chunk: hidden [B, c, d], targets [B, c],
    teacher the teacher's hidden states [B, c, d] or None."""
    logp = torch.log_softmax(head(model, hidden).float(), -1)                           # [B, c, vocab]
    value = F.nll_loss(logp.flatten(0, 1), targets.flatten(), reduction="sum")
    if teacher is not None:
        with torch.no_grad():
            target = torch.log_softmax(head(model, teacher).float(), -1)
        value = value + kd_weight * F.kl_div(logp, target, log_target=True, reduction="sum")
    return value


LOSS_VALUES = 1024 * 49_152   # logits of one chunk of the loss, each model's: 1,024 positions at SmolLM2's vocabulary
                              # of 49,152 (0.2 GB in float32), 192 at Gemma 3's 262,144


def loss_positions(chunk: int, length: int, vocab: int, batch: int = 1) -> int:
    """Positions per chunk of the loss over `length` predictions of `batch` blocks: the recipe's `chunk`
    (end_to_end.loss_chunk; 0: all at once), and at most `LOSS_VALUES` logits over the batch at a vocabulary of
    `vocab` (at least one position)."""
    if not chunk:
        return length
    return max(1, min(chunk, length, LOSS_VALUES // (vocab * batch)))


def loss(model, ids: torch.Tensor, kd_weight: float, chunk: int = 0) -> torch.Tensor:
    """The student's mean next-token cross-entropy on `ids` [B, T], plus kd_weight × the mean KL(teacher ‖ student)
    per token (the teacher is the same model in `teacher_mode`).

    The body runs once for the student and once, without autograd, for the teacher; the LM head then runs on
    `chunk` positions at a time, fewer where the vocabulary is large (`loss_positions`). Each chunk is checkpointed
    (its logits are recomputed in the backward pass), so at most one chunk's logits of each model exist at a time;
    with `chunk` 0 all T−1 positions go at once and autograd keeps their logits, as the model's own forward would.
    """
    teacher = None
    if kd_weight > 0:
        with torch.no_grad(), teacher_mode(model):
            teacher = hidden_states(model, ids)[:, :-1]                                  # [B, T-1, d]
    student = hidden_states(model, ids)[:, :-1]                                          # [B, T-1, d]
    targets = ids[:, 1:]
    size = loss_positions(chunk, targets.shape[1], vocabulary(model), targets.shape[0])
    value = student.new_zeros((), dtype=torch.float32)
    for s in range(0, targets.shape[1], size):
        part = (model, student[:, s:s + size], targets[:, s:s + size],
                None if teacher is None else teacher[:, s:s + size], kd_weight)
        value = value + (checkpoint(_chunk_loss, *part, use_reentrant=False) if chunk and student.requires_grad
                         else _chunk_loss(*part))
    return value / targets.numel()


@contextlib.contextmanager
def layers_checkpointed(model) -> Iterator[None]:
    """While active, each decoder layer keeps only its input for the backward pass and runs again there (HF's
    activation checkpointing, non-reentrant). HF checkpoints a layer only in training mode, so each layer module's
    own flag is set; its children stay in eval mode (no dropout), and no supported layer's forward reads the flag."""
    layers = decoder_layers(model)
    if not model.supports_gradient_checkpointing or not layers:
        raise UserError(f"end_to_end.activation_checkpointing: transformers cannot checkpoint the layers of a "
                        f"{model.config.model_type!r} model; set it to false")
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.disable_input_require_grads()            # only the reentrant form needs the embeddings to need grads
    flags = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer, flag in zip(layers, flags):
            layer.training = flag
        model.activation_checkpointing_disable()


def cooldown_lr(lr: float, step: int, steps: int, cooldown: int) -> float:
    """The learning rate of 0-based `step` of `steps`: constant, then over the last `cooldown` steps down in a
    straight line towards 0 (the last step's is lr / cooldown)."""
    return lr * min(1.0, (steps - step) / cooldown) if cooldown else lr


def draw(seed: int, step: int, num_blocks: int, count: int) -> torch.Tensor:
    """The blocks step `step` trains on: `count` indices drawn with replacement, from (seed, step) alone."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(num_blocks, (count,), generator=gen)


# --- checkpoints ----------------------------------------------------------------------------------------------------

def whole(t: torch.Tensor) -> torch.Tensor:
    """`t` entire: an FSDP shard gathered from every process (all must call), else `t` itself."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous()


def like(value: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`value` (entire) as `t` holds it: this process's shard of it if `t` is an FSDP shard, on `t`'s device."""
    value = value.to(device=t.device, dtype=t.dtype)
    return distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None) if isinstance(t, DTensor) \
        else value


def save_optimizer(optimizer: torch.optim.Adam, names: list[str], path: Path | None, step: int) -> None:
    """Adam's state by parameter name, gathered whole; written by the process given a `path`."""
    tensors = {}
    for name, p in zip(names, [p for g in optimizer.param_groups for p in g["params"]]):
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{name}::{key}"] = whole(state[key])
        if "step" in state:
            tensors[f"{name}::step"] = torch.as_tensor(state["step"]).reshape(1).float()
    if path is not None:
        save_tensors(tensors, path, metadata={"step": str(step)})


def load_optimizer(optimizer: torch.optim.Adam, names: list[str], path: Path) -> None:
    tensors, _ = read_safetensors(path)
    for name, p in zip(names, [p for g in optimizer.param_groups for p in g["params"]]):
        if f"{name}::exp_avg" in tensors:
            optimizer.state[p] = {"step": tensors[f"{name}::step"].reshape(()),
                                  "exp_avg": like(tensors[f"{name}::exp_avg"], p),
                                  "exp_avg_sq": like(tensors[f"{name}::exp_avg_sq"], p)}


def save_checkpoint(ckpt: Path, step: int, losses: list[float], tensors: list, optimizer, names,
                    curve: list[dict], skipped: list[int] = ()) -> None:
    """A complete checkpoint in its own folder, then `state.json` pointing at it (atomic), then old folders go.
    Every process calls it (FSDP shards are gathered); rank 0 writes."""
    folder = ckpt / f"step_{step:06d}"
    write = world()[0] == 0
    if write:
        folder.mkdir(parents=True, exist_ok=True)
    features = {n: whole(t) for n, t in tensors}
    save_optimizer(optimizer, names, folder / "optimizer.safetensors" if write else None, step)
    if not write:
        return
    save_tensors(features, folder / "features.safetensors")
    write_json(ckpt / "state.json", {"step": step, "folder": folder.name, "losses": losses, "curve": curve,
                                     "skipped": list(skipped)})
    for old in ckpt.glob("step_*"):
        if old.name != folder.name:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()


def load_checkpoint(ckpt: Path, tensors: list, optimizer, names) -> tuple[int, list[float], list[dict], list[int]]:
    """(step, losses, curve, skipped steps) of the checkpoint in `ckpt`, its tensors and Adam state loaded;
    (0, [], [], []) if none."""
    if not (ckpt / "state.json").is_file():          # written last: it names a complete checkpoint folder
        return 0, [], [], []
    meta = json.loads((ckpt / "state.json").read_text())
    state, _ = read_safetensors(ckpt / meta["folder"] / "features.safetensors")
    missing = [n for n, _ in tensors if n not in state]
    if missing:
        raise UserError(f"{ckpt} has no {missing[0]}: its student differs from this one; rerun with the run "
                        f"folder's own recipe.toml")
    with torch.no_grad():
        for n, t in tensors:
            t.copy_(like(state[n], t))
    load_optimizer(optimizer, names, ckpt / meta["folder"] / "optimizer.safetensors")
    return meta["step"], meta["losses"], meta.get("curve", []), meta.get("skipped", [])


def load_trained(model, out: Path) -> None:
    """The student tensors of the last checkpoint in `out/end_to_end` into `model` (whole, in one process)."""
    meta = json.loads((out / "end_to_end" / "state.json").read_text())
    state, _ = read_safetensors(out / "end_to_end" / meta["folder"] / "features.safetensors")
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for n, value in state.items():
            named[n].copy_(value)


# --- processes: FSDP ------------------------------------------------------------------------------------------------

class Root(torch.nn.Module):
    """FSDP's root unit: the model as its child, and a forward that calls a function of the model, so that the
    weights outside the decoder layers (embeddings, final norm, LM head) are gathered for the call and its backward
    pass (the loss runs the body and the head apart, and the teacher through the same modules)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def shard(model, device: torch.device) -> Root:
    """`model` sharded over the processes in place with FSDP2: each decoder layer a unit, the rest the root's.
    Each weight computes in its own dtype (a bfloat16 base model in bfloat16, the student's float32 tensors in
    float32, as in one process); gradients are averaged in float32. The teacher is the same modules: its frozen
    weights are sharded with them."""
    mesh = init_device_mesh(device.type, (world()[1],))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    root = Root(model)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    return root


# --- the phase ------------------------------------------------------------------------------------------------------

def finite_gradients(params: list[torch.Tensor], device) -> bool:
    """Whether every gradient of `params` is finite on every process (a step with an inf or NaN one is skipped, and
    the log's `skipped_steps` says which: the features of a key far below its shift, as QK-norm's long keys are,
    can give float32 gradients past its range)."""
    bad = torch.zeros(1, device=device)
    for p in params:
        g = p.grad
        if g is not None:
            g = g.to_local() if isinstance(g, DTensor) else g
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float().reshape(1))
    all_max([bad])
    return not bool(bad.item())


def train(model, blocks: torch.Tensor, out: Path, config: EndToEnd, seed: int, eval_blocks: torch.Tensor,
          time_limit: float = 0.0, progress: bool = True, optimizer_class=torch.optim.Adam) -> dict:
    """`config.steps` steps on `blocks`, resuming from the last checkpoint in `out/end_to_end`; returns the log.

    With several processes `model` is left sharded (FSDP): only the checkpoints hold its student whole
    (`load_trained`). With `config.eval_every` > 0 the validation perplexity on `eval_blocks` is measured every that
    many steps (the log's `curve`: step, training tokens of all processes, perplexity; with several processes each
    runs it). With `time_limit` > 0 (seconds) the phase stops after the first step that ends past it, checkpointed;
    the log then has `stopped` and `target_steps`, which the same command later goes on to. `optimizer_class` takes
    the param groups (tests use plain SGD, whose step shows a wrong gradient average that Adam's scale invariance
    would hide).
    """
    rank, size = world()
    if not trainable(model):
        return {"steps": 0, "note": "no trainable student tensors"}
    device = trainable(model)[0][1].device
    root = shard(model, device) if size > 1 else None

    def call(fn, *args, **kwargs):               # through FSDP's root where the model is sharded
        return root(fn, *args, **kwargs) if root is not None else fn(model, *args, **kwargs)

    named = trainable(model)
    steps, batch_size = config.steps, config.batch_size
    names, groups = param_groups(named, config.lr, own_rates(model, config))
    persistent = model.state_dict().keys()             # PRF key shifts move in training too; masks are fixed
    tensors = named + [(n, b) for n, b in model.named_buffers() if is_student_tensor(n) and n in persistent]
    shifts = [b for n, b in tensors if n.endswith("key_shift")]
    optimizer = optimizer_class(groups)
    ckpt = out / "end_to_end"
    start_step, losses, curve, skipped = load_checkpoint(ckpt, tensors, optimizer, names)
    linears = list(linear_parts(model).values())
    for linear in linears:            # the base model stays in eval mode: no dropout, a deterministic teacher
        linear.train()
    started = time.perf_counter()
    bar = tqdm(range(start_step, steps), desc="end-to-end", unit="step", disable=not progress or rank != 0,
               initial=start_step, total=steps)
    done = steps
    with layers_checkpointed(model) if config.activation_checkpointing else contextlib.nullcontext():
        for step in bar:
            idx = draw(seed, step, len(blocks), batch_size * size)[rank::size]
            value = call(loss, blocks[idx].to(device), config.kd_weight, config.loss_chunk)
            for group in optimizer.param_groups:
                group["lr"] = cooldown_lr(group["base_lr"], step, steps, config.cooldown_steps)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            if finite_gradients([p for _, p in named], device):
                optimizer.step()
            else:                             # one step's inf/NaN would make every tensor NaN from here on
                skipped.append(step)
            all_max(shifts)                   # each process raised its key shifts on its own blocks
            value = value.detach()
            all_mean([value])                 # the step's loss over all its blocks, not rank 0's share
            losses.append(round(value.item(), 5))
            bar.set_postfix(loss=f"{value.item():.4f}")
            if config.eval_every and ((step + 1) % config.eval_every == 0 or step + 1 == steps):
                for linear in linears:    # eval mode: validation text must not move the PRF key shifts
                    linear.eval()
                ppl = call(perplexity, eval_blocks, progress=False)   # every process: FSDP gathers the weights
                for linear in linears:
                    linear.train()
                tokens = (step + 1) * batch_size * size * blocks.shape[1]
                curve.append({"step": step + 1, "tokens": tokens,
                              "ppl": ppl})
                bar.set_postfix(loss=f"{value.item():.4f}", ppl=f"{ppl:.1f}")
            out_of_time = rank0_decides(bool(time_limit) and time.perf_counter() - started > time_limit
                                        and step + 1 < steps, device)
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == steps or out_of_time:
                save_checkpoint(ckpt, step + 1, losses, tensors, optimizer, names, curve, skipped)
            if out_of_time:
                done = step + 1
                break
    for linear in linears:
        linear.eval()
    barrier()
    result = {"steps": done, "first_loss": losses[0] if losses else None,
              "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None, "losses": losses,
              "curve": curve, "seconds": round(time.perf_counter() - started, 2)}
    if skipped:
        result["skipped_steps"] = skipped
    if done < steps:
        result.update(stopped="time limit", target_steps=steps)
    return result
