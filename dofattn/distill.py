"""Distillation of the linear student from its softmax teacher: layerwise, direct, or layerwise then direct.

    dofattn distill                                       # the default job (SmolLM2, wiki-sample, DoF dims, PRF)
    dofattn distill --loss l2 --dims fix --out runs/fix-l2
    torchrun --nproc_per_node 2 -m dofattn distill ...   # layers split across processes, DDP for direct

Stages, each resumable from the run folder (`--out`):
1. dims: `dof`/`clip` run the DoF estimate on the training split and save it as `dof.json` in the run folder;
   `fix[:C]` or a dof.json path give them directly.
2. teacher activations: one teacher forward per batch of training blocks; each layer's q/k/v are streamed to its
   own float32 file (`teacher/layer_XX.npy`), so memory holds one batch, never all layers.
3. layerwise (`--loss softmax|l2`): each layer's feature map is trained alone on its teacher's q/k/v, Adam with
   the paper's learning rates (directions 0.02, weights 0.2). softmax: KL between the teacher's causal attention
   rows and the student's normalised linear-attention rows. l2: squared error of kernel values on causal pairs,
   each query's row scaled by its largest exact kernel value (raw values reach e^15 and would swamp the mean).
   output: squared error of the layer's attention output against the teacher's (relative to its mean square);
   softmax+output: the sum of the two. With `--window W` every loss sees the hybrid (l2: only pairs beyond W).
   Each layer's result is saved to `layers/layer_XX.safetensors` as soon as it is done.
4. direct (`--loss direct`, or `--then-direct-steps N` after layerwise): `--lm-weight` × next-token cross-entropy
   of the whole student, plus `--kd-weight` × KL(teacher ‖ student) on the logits (and `--hidden-weight` × each
   layer's residual-stream error to the teacher's); only feature parameters train. Checkpoints
   (features, Adam state, step) every `--checkpoint-every` steps. It reads `--direct-blocks` blocks (default:
   `--train-blocks`) of `--direct-seq-len` tokens (`--recipe dofattn`: the evaluation length; paper: `--seq-len`),
   so it can train at the evaluation length on more text than the teacher cache holds.
5. the student is saved (`dofattn.json`, `features.safetensors`) and evaluated on the validation split next to
   the teacher and an untrained Performer of the same budget; `log.json` is written and the teacher activations
   (about 1 GB for the default job) are deleted. Rerunning a finished run prints its results.

Determinism: layer l trains with a generator seeded by (seed, l) and direct step i draws its batch from (seed, i),
so a run killed at any point and restarted with the same arguments ends with the same weights.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from dofattn.attention import CONV_NAMES, DECAY_START, DELTA_NAMES, LinearAttention
from dofattn.capture import AttentionInputs, capture, run_forward
from dofattn.errors import UserError
from dofattn.evaluate import perplexity, teacher_mode
from dofattn.features import FEATURES, PositiveRandomFeatures
from dofattn.ops.naive import gate_log, log_decay_matrix, segment_sums
from dofattn.ops.window import first_keys, window_logits
from dofattn.student import CONFIG_FILE, WEIGHTS_FILE, attention_modules, head_layout

LOSSES = ("softmax", "l2", "output", "softmax+output", "direct")
TINY = torch.finfo(torch.float32).tiny


# --- teacher activations --------------------------------------------------------------------------------------

class TeacherCache:
    """q/k/v of every layer on the training blocks, one float32 file per layer: [N, T, H + 2·Hkv, D]."""

    def __init__(self, folder: Path, num_layers: int, shape: tuple[int, int], heads: tuple[int, int, int]):
        self.folder, self.num_layers = folder, num_layers
        (self.N, self.T), (self.H, self.Hkv, self.D) = shape, heads

    def path(self, layer: int) -> Path:
        return self.folder / f"layer_{layer:02d}.npy"

    @property
    def done(self) -> bool:
        return (self.folder / "done").is_file()

    def build(self, model, blocks: torch.Tensor, batch_size: int, progress: bool = True) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        width = self.H + 2 * self.Hkv
        files = [np.lib.format.open_memmap(self.path(i), mode="w+", dtype=np.float32,
                                           shape=(self.N, self.T, width, self.D)) for i in range(self.num_layers)]
        offset = 0

        def sink(a: AttentionInputs) -> None:
            qkv = torch.cat([a.query, a.key, a.value], dim=2).float().cpu().numpy()  # [B, T, H+2Hkv, D]
            files[a.layer][offset:offset + qkv.shape[0]] = qkv

        device = next(model.parameters()).device
        with teacher_mode(model), capture(model, sink):
            for offset in tqdm(range(0, self.N, batch_size), desc="teacher q/k/v", unit="batch",
                               disable=not progress):
                run_forward(model, blocks[offset:offset + batch_size].to(device))
        for f in files:
            f.flush()
        (self.folder / "done").write_text("ok")

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, T, H, D], k and v [N, T, Hkv, D] of `layer` (read from disk)."""
        qkv = torch.from_numpy(np.load(self.path(layer)))
        return qkv[:, :, :self.H], qkv[:, :, self.H:self.H + self.Hkv], qkv[:, :, self.H + self.Hkv:]


# --- layerwise losses -------------------------------------------------------------------------------------------

def _causal(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def log_pair_decay(linear: LinearAttention, v: torch.Tensor) -> torch.Tensor:
    """The log of the decay a layer's linear part puts on the pair (t, s), 0 for s ≥ t, for values v [B, T, H, D]:
    with a gate Σ_{s<j≤t} log g_j ([B, H, T, T]); else (t - s) log γ_h, beside a window (t - W - s) log γ_h counted
    from its edge, and 0 inside it ([H, T, T])."""
    if linear.gate:
        return segment_sums(gate_log(linear.log_gates(v), torch.float32))
    return log_decay_matrix(linear.log_decay(), v.shape[1], offset=-linear.window)[0]


def softmax_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """Mean KL(teacher row ‖ student row) over causal attention rows. q, k, v [B, T, H, D] (v unused).

    For a window hybrid the student's row is the hybrid's: exact weights on the last W keys, linear beyond.
    """
    if linear.window:
        return _window_softmax_loss(linear, q, k, scaling)
    fmap = linear.feature_map
    phi_q, phi_k = fmap(q, "query"), fmap(k, "key")                               # [B, T, H, M]
    mask = _causal(q.shape[1], q.device)
    scores = torch.einsum("bthm,bshm->bhts", phi_q, phi_k).masked_fill(~mask, 0)  # [B, H, T, T]
    log_scores = torch.log(scores.clamp_min(TINY))
    if linear.decay:  # the weight of a pair is its score times its decay, taken in log space for far pairs
        log_factor = log_pair_decay(linear, v)
        log_scores = log_scores + log_factor
        scores = scores * log_factor.exp()                                        # scores are 0 above it already
    log_student = log_scores - torch.log(scores.sum(-1, keepdim=True).clamp_min(TINY))
    logits = (scaling * torch.einsum("bthd,bshd->bhts", q.float(), k.float())).masked_fill(~mask, -math.inf)
    log_teacher = torch.log_softmax(logits, -1)
    teacher = log_teacher.exp()
    kl = (teacher * (log_teacher - log_student)).masked_fill(~mask, 0).sum(-1)    # [B, H, T]
    return kl.mean()


def _window_softmax_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    phi_q, q_scale = linear.feature_map.features(q, "query")
    phi_k, k_scale = linear.feature_map.features(k, "key")
    sink = first_keys(None, k.shape[0], k.shape[1], linear.sink, k.device) if linear.sink else None
    logits, _ = window_logits(q, k, phi_q, phi_k, q_scale, k_scale + linear.log_gain, scaling, linear.window,
                              log_decay=linear.log_decay(), sink_mask=sink)
    mask = _causal(q.shape[1], q.device)
    log_student = torch.log_softmax(logits, -1).clamp_min(math.log(TINY))       # [B, H, T, T]
    teacher_logits = (scaling * torch.einsum("bthd,bshd->bhts", q.float(), k.float())).masked_fill(~mask, -math.inf)
    log_teacher = torch.log_softmax(teacher_logits, -1)
    kl = (log_teacher.exp() * (log_teacher - log_student)).masked_fill(~mask, 0).sum(-1)
    return kl.mean()


def l2_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scaling: float) -> torch.Tensor:
    """Mean squared kernel error on causal pairs, each row scaled by its largest exact kernel value (PRF only)."""
    fmap = linear.feature_map
    if not isinstance(fmap, PositiveRandomFeatures):
        raise UserError("--loss l2 compares kernel values and needs prf or performer features")
    e_q, e_k = fmap.exponent(q), fmap.exponent(k)                                 # [B, T, H, M]
    c_q = e_q.amax(-1, keepdim=True).detach()
    c_k = e_k.amax(dim=(0, 1, 3), keepdim=True).detach()
    dot = torch.einsum("bthm,bshm->bhts", torch.exp(e_q - c_q), torch.exp(e_k - c_k))
    log_kernel_hat = (torch.log(dot.clamp_min(TINY)) + c_q.squeeze(-1).permute(0, 2, 1)[..., None]
                      + c_k.reshape(1, -1, 1, 1) - fmap.log_dims.reshape(1, -1, 1, 1))   # [B, H, T, T]
    if linear.decay:  # the student's weight of a pair is its kernel estimate times its decay
        log_kernel_hat = log_kernel_hat + log_pair_decay(linear, v)
    mask = _causal(q.shape[1], q.device)
    if linear.window:  # the features only ever see pairs beyond the window (and not the sink)
        mask = mask.tril(-linear.window) & (torch.arange(q.shape[1], device=q.device) >= linear.sink)
        if not mask.any():
            raise UserError(f"--loss l2 with --window {linear.window} needs --seq-len > {linear.window}")
    log_kernel = (scaling * torch.einsum("bthd,bshd->bhts", q.float(), k.float())).masked_fill(~mask, -math.inf)
    row_max = log_kernel.amax(-1, keepdim=True).clamp_min(-1e30)                    # rows with no pair: finite
    log_kernel_hat = log_kernel_hat.masked_fill(~mask, -math.inf)
    diff = torch.exp(log_kernel - row_max) - torch.exp(log_kernel_hat - row_max)   # 0 off the mask
    return diff.square().sum() / (mask.sum() * q.shape[0] * q.shape[2])


def output_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """Squared error of the attention output against the teacher's, relative to the teacher output's mean square.

    q, k, v [B, T, H, D]: the student attends with the teacher's own inputs (not its earlier layers' outputs).
    """
    o = linear.attend(q, k, v)[0].float()                                          # [B, T, H, D]
    with torch.no_grad():
        exact = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                               v.transpose(1, 2).float(), is_causal=True,
                                               scale=scaling).transpose(1, 2)
    return (o - exact).square().mean() / exact.square().mean().clamp_min(TINY)


def softmax_output_loss(linear: LinearAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scaling: float) -> torch.Tensor:
    """softmax_loss + output_loss: the rows' shape and what they produce."""
    return softmax_loss(linear, q, k, v, scaling) + output_loss(linear, q, k, v, scaling)


LAYER_LOSSES = {"softmax": softmax_loss, "l2": l2_loss, "output": output_loss, "softmax+output": softmax_output_loss}


def param_groups(linear: LinearAttention, lr: float, lr_weights: float) -> list[dict]:
    """PRF weights (log α) at `lr_weights`, every other trainable feature parameter at `lr`."""
    weights, rest = [], []
    for name, p in linear.named_parameters():
        if p.requires_grad:
            (weights if name.endswith("log_weights") else rest).append(p)
    return [g for g in ({"params": rest, "lr": lr}, {"params": weights, "lr": lr_weights}) if g["params"]]


def train_layer(linear: LinearAttention, acts, scaling: float, loss: str, steps: int, batch_size: int, lr: float,
                lr_weights: float, seed: int, desc: str = "", progress: bool = True) -> dict:
    """Adam on one layer's feature map against its teacher activations (q, k, v) [N, T, ...]; returns a log."""
    q_all, k_all, v_all = acts
    group = q_all.shape[2] // k_all.shape[2]
    loss_fn = LAYER_LOSSES[loss]
    groups = param_groups(linear, lr, lr_weights)
    gen = torch.Generator().manual_seed(seed)
    device = next(itertools.chain(linear.parameters(), linear.buffers())).device
    first = None
    losses = []
    start = time.perf_counter()
    if not groups:  # nothing to train (performer): just report the loss
        steps = 0
    optimizer = torch.optim.Adam(groups) if groups else None
    linear.train()
    if linear.window and not linear.feature_map.estimates_kernel:  # put the linear part on the window's scale
        idx = torch.arange(min(batch_size, len(q_all)))
        linear.calibrate_gain(q_all[idx].to(device), k_all[idx].repeat_interleave(group, 2).to(device))
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False)
    for _ in bar:
        idx = torch.randint(len(q_all), (batch_size,), generator=gen)
        q = q_all[idx].to(device)
        k = k_all[idx].repeat_interleave(group, dim=2).to(device)
        v = v_all[idx].repeat_interleave(group, dim=2).to(device)
        value = loss_fn(linear, q, k, v, scaling)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        losses.append(value.item())
        first = losses[0]
        bar.set_postfix(loss=f"{value.item():.4f}")
    linear.eval()
    with torch.no_grad():  # the loss on a fixed batch, for the log
        idx = torch.arange(min(batch_size, len(q_all)))
        final = loss_fn(linear, q_all[idx].to(device), k_all[idx].repeat_interleave(group, 2).to(device),
                        v_all[idx].repeat_interleave(group, 2).to(device), scaling).item()
    tail = losses[-max(1, len(losses) // 10):] if losses else [final]
    return {"steps": steps, "first_loss": first if first is not None else final,
            "last_loss": sum(tail) / len(tail), "fixed_batch_loss": final,
            "seconds": round(time.perf_counter() - start, 2)}


# --- direct training ---------------------------------------------------------------------------------------------

def feature_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """What the direct phase trains: feature maps, window gains and LoRA adapters."""
    from dofattn.student import is_student_tensor

    return [(n, p) for n, p in model.named_parameters() if is_student_tensor(n) and p.requires_grad]


def direct_groups(named: list[tuple[str, torch.nn.Parameter]], lr: float,
                  conv_lr: float | None = None, delta_lr: float | None = None) -> tuple[list[str], list[dict]]:
    """(names in the optimizer's order, Adam groups): everything at `lr`, with `conv_lr` the `--conv` filters and
    with `delta_lr` the delta rule's parameters in groups of their own at those rates. Each group keeps its rate
    as "base_lr" for the cooldown."""
    filters = tuple("." + name for name in CONV_NAMES) if conv_lr is not None else ()
    delta = DELTA_NAMES if delta_lr is not None else ()
    own = filters + delta
    groups = [([(n, p) for n, p in named if not n.endswith(own)], lr),
              ([(n, p) for n, p in named if filters and n.endswith(filters)], conv_lr),
              ([(n, p) for n, p in named if delta and n.endswith(delta)], delta_lr)]
    return ([n for part, _ in groups for n, _ in part],
            [{"params": [p for _, p in part], "lr": rate, "base_lr": rate} for part, rate in groups if part])


def direct_loss(model, ids: torch.Tensor, kd_weight: float, hidden_weight: float = 0.0,
                lm_weight: float = 1.0) -> torch.Tensor:
    """lm_weight × the student's next-token cross-entropy on the text, plus kd_weight × KL(teacher ‖ student) per
    token, plus hidden_weight × `hidden_error` of the student's residual stream against the teacher's."""
    hidden = hidden_weight > 0
    student = model(input_ids=ids, use_cache=False, output_hidden_states=hidden)
    logp = torch.log_softmax(student.logits[:, :-1].float(), -1)   # [B, T-1, vocab]
    loss = lm_weight * F.nll_loss(logp.reshape(-1, logp.shape[-1]), ids[:, 1:].reshape(-1))   # one log-softmax
    if kd_weight > 0 or hidden:
        with torch.no_grad(), teacher_mode(model):
            teacher = model(input_ids=ids, use_cache=False, output_hidden_states=hidden)
    if kd_weight > 0:
        kl = F.kl_div(logp, torch.log_softmax(teacher.logits[:, :-1].float(), -1), log_target=True,
                      reduction="none").sum(-1).mean()
        loss = loss + kd_weight * kl
    if hidden:
        loss = loss + hidden_weight * hidden_error(student.hidden_states[1:], teacher.hidden_states[1:])
    return loss


def hidden_error(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over layers and tokens of |h_student − h_teacher|² / |h_teacher|², each h a token's residual stream
    [B, T, D] after a layer. Relative per token: a few tokens (the first, often) carry streams hundreds of times
    larger than the rest, and would otherwise be all the loss sees."""
    errors = [((s.float() - t.float()).pow(2).sum(-1) / t.float().pow(2).sum(-1).clamp_min(1e-6)).mean()
              for s, t in zip(student, teacher, strict=True)]
    return torch.stack(errors).mean()


def save_optimizer(optimizer: torch.optim.Adam, names: list[str], path: Path, step: int) -> None:
    tensors = {}
    for name, p in zip(names, [p for g in optimizer.param_groups for p in g["params"]]):
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{name}::{key}"] = state[key].contiguous()
        if "step" in state:
            tensors[f"{name}::step"] = torch.as_tensor(state["step"]).reshape(1).float()
    save_file(tensors, str(path), metadata={"step": str(step)})


def load_optimizer(optimizer: torch.optim.Adam, names: list[str], path: Path) -> None:
    tensors = load_file(str(path))
    for name, p in zip(names, [p for g in optimizer.param_groups for p in g["params"]]):
        if f"{name}::exp_avg" in tensors:
            optimizer.state[p] = {"step": tensors[f"{name}::step"].reshape(()),
                                  "exp_avg": tensors[f"{name}::exp_avg"].to(p.device),
                                  "exp_avg_sq": tensors[f"{name}::exp_avg_sq"].to(p.device)}


# --- the run --------------------------------------------------------------------------------------------------------

@dataclass
class RunLog:
    """What `log.json` records."""

    args: dict = field(default_factory=dict)
    dims: list[int] = field(default_factory=list)
    softmax_layers: list[int] = field(default_factory=list)   # kept as softmax attention (--keep-softmax)
    layers: dict = field(default_factory=dict)       # layer -> train_layer log
    direct: dict = field(default_factory=dict)
    evaluation: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


def world() -> tuple[int, int]:
    """(rank, world size): torchrun's environment, or (0, 1)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


def layer_file(out: Path, layer: int) -> Path:
    return out / "layers" / f"layer_{layer:02d}.safetensors"


def save_layer(out: Path, layer: int, linear: LinearAttention, log: dict) -> None:
    path = layer_file(out, layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    state = {k: v.detach().contiguous() for k, v in linear.state_dict().items()}
    save_file(state, str(tmp), metadata={"log": json.dumps(log)})
    os.replace(tmp, path)


def load_layer(out: Path, layer: int, linear: LinearAttention) -> dict:
    from safetensors import safe_open

    path = layer_file(out, layer)
    linear.load_state_dict(load_file(str(path)))
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["log"])


@torch.no_grad()
def student_activations(model, blocks: torch.Tensor, layer: int, batch_size: int,
                        progress: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, T, H, D], k and v [N, T, Hkv, D] (float32, CPU) entering `layer` of the model as it is now: the
    layers before it already linearized and trained. The forward stops after `layer`."""
    parts = []
    device = next(model.parameters()).device

    def sink(a: AttentionInputs) -> None:
        parts.append(tuple(x.float().cpu() for x in (a.query, a.key, a.value)))

    with capture(model, sink, layers=[layer]):
        for start in tqdm(range(0, len(blocks), batch_size), desc=f"student q/k/v for layer {layer}",
                          unit="batch", disable=not progress, leave=False):
            run_forward(model, blocks[start:start + batch_size].to(device))
    return tuple(torch.cat(xs) for xs in zip(*parts))


def layerwise(model, cache: TeacherCache | None, out: Path, loss: str, steps: int, batch_size: int, lr: float,
              lr_weights: float, seed: int, progress: bool = True, blocks: torch.Tensor | None = None) -> dict:
    """Train every linearized layer (this rank's share), resuming from finished layer files.

    With a teacher `cache`, each layer trains on the teacher's q/k/v. Without one (`--progressive`), layers train
    in order on the q/k/v the student itself produces from `blocks`, its earlier layers already linear, so each
    layer learns to work on the inputs it will really see (one process only).
    """
    rank, size = world()
    modules = attention_modules(model)
    logs = {}
    for layer, module in enumerate(modules):
        linear = getattr(module, "dofattn", None)
        if linear is None or layer % size != rank:
            continue
        if layer_file(out, layer).is_file():
            logs[layer] = load_layer(out, layer, linear)
            continue
        acts = cache.layer(layer) if cache is not None else student_activations(model, blocks, layer, batch_size,
                                                                                progress)
        log = train_layer(linear, acts, module.scaling, loss, steps, batch_size, lr, lr_weights,
                          seed=seed * 100_003 + layer, desc=f"layer {layer:2d} ({loss})", progress=progress)
        if progress:
            print(f"layer {layer:2d}: {loss} loss {log['first_loss']:.4f} -> {log['last_loss']:.4f} "
                  f"({log['seconds']:.0f} s)", flush=True)
        save_layer(out, layer, linear, log)
        logs[layer] = log
    barrier()
    for layer, module in enumerate(modules):  # every rank ends with every layer
        if getattr(module, "dofattn", None) is not None and layer not in logs:
            logs[layer] = load_layer(out, layer, module.dofattn)
    return logs


def save_direct_checkpoint(ckpt: Path, step: int, losses: list[float], tensors: list, optimizer, names,
                           curve: list[dict] | None = None) -> None:
    """A complete checkpoint in its own folder, then `state.json` pointing at it (atomic), then old folders go."""
    folder = f"step_{step:06d}"
    (ckpt / folder).mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous() for n, t in tensors}, str(ckpt / folder / "features.safetensors"))
    save_optimizer(optimizer, names, ckpt / folder / "optimizer.safetensors", step)
    tmp = ckpt / "state.partial"
    tmp.write_text(json.dumps({"step": step, "folder": folder, "losses": losses, "curve": curve or []}))
    os.replace(tmp, ckpt / "state.json")
    for old in ckpt.glob("step_*"):
        if old.name != folder:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()


def cooldown_lr(lr: float, step: int, steps: int, cooldown: int) -> float:
    """The learning rate of 0-based `step` of `steps`: constant, then over the last `cooldown` steps down in a
    straight line towards 0 (the last step's is lr / cooldown)."""
    return lr * min(1.0, (steps - step) / cooldown) if cooldown else lr


def direct_draw(seed: int, step: int, num_blocks: int, count: int) -> torch.Tensor:
    """The blocks an end-to-end step trains on: `count` indices drawn with replacement, from (seed, step) alone, so
    a resumed or continued run draws what one run made at once would."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(num_blocks, (count,), generator=gen)


def direct(model, blocks: torch.Tensor, out: Path, steps: int, batch_size: int, lr: float, kd_weight: float,
           seed: int, checkpoint_every: int, progress: bool = True, eval_blocks: torch.Tensor | None = None,
           eval_every: int = 0, time_limit: float = 0.0, cooldown: int = 0, hidden_weight: float = 0.0,
           conv_lr: float | None = None, delta_lr: float | None = None, lm_weight: float = 1.0) -> dict:
    """End-to-end training of the feature parameters, resuming from the last checkpoint in `out/direct`.

    The loss is `direct_loss` (`lm_weight` on the text's cross-entropy; with `hidden_weight`, the residual streams'
    error too). The learning rate is `lr` (`conv_lr` for the `--conv` filters and `delta_lr` for the delta rule, if
    given), and with `cooldown` > 0 each falls linearly over the last `cooldown` steps (`cooldown_lr`).

    With `eval_every` > 0, the validation perplexity on `eval_blocks` is measured every that many steps (rank 0)
    and returned as `curve`: [{"step", "tokens", "ppl"}], tokens counting every process's training tokens.
    With `time_limit` > 0 (seconds), training stops after the first step that ends past it, checkpointed: the
    result then has `stopped` = "time limit" and `steps` < the `target_steps` a rerun goes on to.
    """
    rank, size = world()
    named = feature_parameters(model)
    if not named:
        return {"steps": 0, "note": "no trainable feature parameters"}
    names, groups = direct_groups(named, lr, conv_lr, delta_lr)
    params = [p for group in groups for p in group["params"]]
    persistent = model.state_dict().keys()  # PRF key shifts move in training too; masks are fixed
    buffers = [(n, b) for n, b in model.named_buffers() if ".dofattn." in n and n in persistent]
    optimizer = torch.optim.Adam(groups)
    ckpt = out / "direct"
    start_step, losses, curve = 0, [], []
    if (ckpt / "state.json").is_file():  # written last: it names a complete checkpoint folder
        meta = json.loads((ckpt / "state.json").read_text())
        start_step, losses, curve = meta["step"], meta["losses"], meta.get("curve", [])
        state = load_file(str(ckpt / meta["folder"] / "features.safetensors"))
        fresh = [n for n, _ in named + buffers if n not in state]
        if fresh and not all(n.endswith(DELTA_NAMES) for n in fresh):
            raise UserError(f"{ckpt} has no {fresh[0]}: its student differs from this one; rerun with the "
                            f"options of its run.json")
        if fresh and progress and rank == 0:          # --continue-from adding --delta
            print(f"{ckpt}: {len(fresh)} delta-rule tensors not in the checkpoint start from their start values",
                  flush=True)
        with torch.no_grad():
            for n, t in named + buffers:
                if n in state:
                    t.copy_(state[n])
        load_optimizer(optimizer, names, ckpt / meta["folder"] / "optimizer.safetensors")
    device = params[0].device
    linears = [m.dofattn for m in attention_modules(model) if hasattr(m, "dofattn")]
    for linear in linears:  # the base model stays in eval mode: no dropout, a deterministic KD teacher
        linear.train()
    started = time.perf_counter()
    bar = tqdm(range(start_step, steps), desc="direct", unit="step", disable=not progress or rank != 0,
               initial=start_step, total=steps)
    for step in bar:
        idx = direct_draw(seed, step, len(blocks), batch_size * size)[rank::size]
        loss = direct_loss(model, blocks[idx].to(device), kd_weight, hidden_weight, lm_weight)
        for group in optimizer.param_groups:
            group["lr"] = cooldown_lr(group["base_lr"], step, steps, cooldown)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if size > 1:
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= size
        optimizer.step()
        losses.append(round(loss.item(), 5))
        bar.set_postfix(loss=f"{loss.item():.4f}")
        if rank == 0 and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            for linear in linears:  # eval mode: validation text must not move the PRF key shifts
                linear.eval()
            ppl = perplexity(model, eval_blocks, progress=False)
            for linear in linears:
                linear.train()
            curve.append({"step": step + 1, "tokens": (step + 1) * batch_size * size * blocks.shape[1], "ppl": ppl})
            bar.set_postfix(loss=f"{loss.item():.4f}", ppl=f"{ppl:.1f}")
        out_of_time = bool(time_limit) and time.perf_counter() - started > time_limit and step + 1 < steps
        if size > 1 and time_limit:                   # rank 0's clock decides for everyone
            flag = torch.tensor([float(out_of_time)], device=device if dist.get_backend() == "nccl" else "cpu")
            dist.broadcast(flag, 0)
            out_of_time = bool(flag.item())
        if rank == 0 and ((step + 1) % checkpoint_every == 0 or step + 1 == steps or out_of_time):
            save_direct_checkpoint(ckpt, step + 1, losses, named + buffers, optimizer, names, curve)
        if out_of_time:
            done = step + 1
            break
    else:
        done = steps
    for linear in linears:
        linear.eval()
    barrier()
    result = {"steps": done, "first_loss": losses[0] if losses else None,
              "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None, "losses": losses,
              "curve": curve, "seconds": round(time.perf_counter() - started, 2)}
    if done < steps:
        result.update(stopped="time limit", target_steps=steps)
    return result


# --- orchestration ------------------------------------------------------------------------------------------------

RESUME_IRRELEVANT = ("device", "out", "time_limit")
# Options added later, with the value that reproduces a run folder written before they existed.
LATER_OPTIONS = {"window": 0, "keep_softmax": 0, "keep_by": "dof", "lora_rank": 0, "eval_every": 0,
                 "progressive": False, "per_head": False, "dof_repeats": 1, "recipe": "paper",
                 "direct_seq_len": None, "direct_blocks": None, "lam_auto": False, "decay": False,
                 "decay_start": None, "sink": 0, "eval_data": None, "continue_from": None,
                 "cooldown_steps": 0, "lora_targets": "attention", "gate": False, "hidden_weight": 0.0,
                 "conv": 0, "conv_lr": None, "delta": False, "delta_lr": None, "lm_weight": 1.0}
# What --continue-from lets differ from the run it copies: the text and length of the end-to-end phase, not the model.
# --delta may be added: the copied student goes on with a delta rule started at its start values (`LinearAttention`).
CONTINUE_MAY_CHANGE = ("data", "eval_data", "direct_blocks", "then_direct_steps", "eval_every", "checkpoint_every",
                       "continue_from", "cooldown_steps", "hidden_weight", "delta", "delta_lr", "lm_weight")
KEEP_BY = ("attn-dof", "dof", "first", "random", "gain")
SINK = 4                 # the dofattn and long recipes' --sink beside a window (not with --decay)
ATTENTION_DOF_BLOCKS = 8      # training blocks on which attn-dof (--keep-by, --dims) measures the teacher's attention
ATTENTION_DOF_SEQ_LEN = 512   # tokens per block, at most (else --eval-seq-len): each T x T matrix's SVD costs T³
GAIN_BLOCKS = 4          # training blocks on which --keep-by gain measures each layer
# What each --recipe sets for options left unset (None); a callable reads the value off the other options. "paper"
# is the published method; "dofattn" adds what measurably closes the gap to the teacher (docs/RESULTS.md): the
# 64-token window, the 4-token sink beside it (1.170x against 1.293x without, 3 seeds), and the end-to-end phase on
# blocks as long as the evaluation's, one per step (the same tokens). "long" is dofattn with LoRA and an end-to-end
# phase 27 times longer on 19 times more text: 1.042x at a tenth of its 400 steps (3 seeds; without the sink 1.121x
# there, and 1.047x at the end), at about 2 h against 9 min on a 2-core CPU.
RECIPES = {"dofattn": {"window": 64, "direct_seq_len": lambda args: args.eval_seq_len, "direct_batch_size": 1,
                       "lora_rank": 0, "then_direct_steps": 30,
                       "sink": lambda args: SINK if args.window and not args.decay else 0},
           "paper": {"window": 0, "direct_batch_size": 2, "lora_rank": 0, "then_direct_steps": 30, "sink": 0}}
RECIPES["long"] = {**RECIPES["dofattn"], "direct_batch_size": 2, "lora_rank": 8, "then_direct_steps": 400,
                   "direct_blocks": 1200}


def resolve_recipe(args) -> None:
    """Fill the options the user left unset (None) from `args.recipe`, in place."""
    if args.recipe not in RECIPES:
        raise UserError(f"unknown --recipe {args.recipe!r}; use one of {', '.join(RECIPES)}")
    for name, value in RECIPES[args.recipe].items():
        if getattr(args, name) is None:
            setattr(args, name, value(args) if callable(value) else value)


def inert_options(args: dict) -> set[str]:
    """Options that change nothing in a run with these arguments: --keep-by without softmax layers (so a folder from
    before its default changed still resumes), and --sink without a window (where it can only be 0, whatever a
    recipe would set beside a window)."""
    inert = set() if args.get("keep_softmax", LATER_OPTIONS["keep_softmax"]) else {"keep_by"}
    return inert if args.get("window", LATER_OPTIONS["window"]) else inert | {"sink"}


def run_record(args: dict) -> dict:
    """What run.json records of a run's arguments: all but those that cannot change its result."""
    return {k: v for k, v in args.items() if k not in RESUME_IRRELEVANT}


def changed_options(before: dict, record: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """The options whose values differ between two run records (an option missing from an older record has the
    value that reproduces it), less the inert ones and `ignore`."""
    return sorted(k for k in (set(before) | set(record)) - inert_options(record) - set(ignore)
                  if before.get(k, LATER_OPTIONS.get(k)) != record.get(k, LATER_OPTIONS.get(k)))


def refuse_foreign_folder(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not a dofattn run folder; give another --out")


def check_run_folder(out: Path, args: dict) -> None:
    """Refuse a run folder made with other arguments; record ours in a new one. More end-to-end steps than the
    folder's run had (--then-direct-steps) are allowed: the run goes on to them (the end-to-end phase draws each
    step's blocks from seed, step and the number of processes, so with as many processes as before and no
    --cooldown-steps begun, the result is the longer run's)."""
    record = run_record(args)
    path = out / "run.json"
    if path.is_file():
        before = json.loads(path.read_text())
        changed = changed_options(before, record)
        if changed == ["then_direct_steps"] and record["loss"] != "direct" and \
                record["then_direct_steps"] > before["then_direct_steps"]:
            path.write_text(json.dumps(record, indent=2))
            return
        if changed:
            more = (" (--then-direct-steps can only grow)" if "then_direct_steps" in changed and
                    record["then_direct_steps"] < before["then_direct_steps"] else "")
            raise UserError(f"run folder {out} holds a run with other arguments ({', '.join(changed)}){more}; "
                            f"give another --out, or delete the folder to start over")
        return
    refuse_foreign_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))


def check_continue(source: Path, out: Path, args: dict) -> None:
    """--continue-from: refuse a `source` that is not a run folder, or whose arguments differ from `args` outside
    CONTINUE_MAY_CHANGE (nothing is read but run.json; nothing is written). Nothing to check once `out` holds a
    run: a rerun of the same command resumes it."""
    if (out / "run.json").is_file():
        return
    refuse_foreign_folder(out)
    if not (source / "run.json").is_file() or not (source / "log.json").is_file():
        raise UserError(f"--continue-from {source} is not a finished (or time-limited) dofattn distill run folder: "
                        f"it needs run.json and log.json")
    if source.resolve() == out.resolve():
        raise UserError("--continue-from and --out are the same folder; to go on in place, rerun the run's own "
                        "command with a larger --then-direct-steps")
    before, record = json.loads((source / "run.json").read_text()), run_record(args)
    changed = changed_options(before, record, ignore=CONTINUE_MAY_CHANGE)
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise UserError(f"--continue-from {source} was run with other {flags}; give them as that run had them "
                        f"(its run.json)")
    scored = before.get("eval_data") or before["data"], record.get("eval_data") or record["data"]
    if scored[0] != scored[1]:
        raise UserError(f"--continue-from {source} was scored on {scored[0]!r}, this run on {scored[1]!r}: give "
                        f"--eval-data {scored[0]} so its perplexity curve goes on comparably")
    done = json.loads((source / "log.json").read_text()).get("direct", {}).get("steps", 0)
    if record["then_direct_steps"] < done:
        raise UserError(f"--then-direct-steps {record['then_direct_steps']} is fewer than the {done} end-to-end "
                        f"steps --continue-from {source} made; give at least {done}")


# What --continue-from copies: what `dofattn distill` wrote, less the teacher cache (files such as an eval.json that
# were written into the folder later are the source's, not the new run's).
RUN_FILES = ("run.json", "log.json", "dof.json", "attention_dof.json", "linear_dof.json", "keep.json", CONFIG_FILE,
             WEIGHTS_FILE, "layers", "direct")


def continue_run(source: Path, out: Path, args: dict) -> bool:
    """--continue-from: copy run folder `source`'s RUN_FILES to a new `out` whose run.json records `args`, which
    `check_continue` has accepted. Returns whether it copied: not once `out` holds a run."""
    if (out / "run.json").is_file():
        return False
    staging_dir = out.with_name(out.name + ".partial")
    shutil.rmtree(staging_dir, ignore_errors=True)
    staging_dir.mkdir(parents=True)
    for name in RUN_FILES:
        if (source / name).is_dir():
            shutil.copytree(source / name, staging_dir / name)
        elif (source / name).is_file():
            shutil.copy2(source / name, staging_dir / name)
    (staging_dir / "run.json").write_text(json.dumps(run_record(args), indent=2))
    if out.exists():
        out.rmdir()
    staging_dir.rename(out)
    return True


def direct_shape(args) -> tuple[int, int]:
    """(blocks, tokens per block) of the end-to-end phase's text: unset options mean the layerwise stage's."""
    return args.direct_blocks or args.train_blocks, args.direct_seq_len or args.seq_len


def tokens_per_step(args) -> int:
    """Training tokens in one step of the phase `--steps` / `--tokens` count: layerwise, or direct alone."""
    if args.loss == "direct":
        return args.direct_batch_size * direct_shape(args)[1]
    return args.batch_size * args.seq_len


def validate(args) -> None:
    if args.loss not in LOSSES:
        raise UserError(f"unknown --loss {args.loss!r}; use one of {', '.join(LOSSES)}")
    if args.feature not in FEATURES:
        raise UserError(f"unknown feature map {args.feature!r}; use one of {', '.join(FEATURES)}")
    if args.loss == "l2" and args.feature not in ("prf", "performer"):
        raise UserError("--loss l2 compares kernel values and needs --feature prf or performer")
    for name in ("steps", "batch_size", "direct_batch_size", "seq_len", "train_blocks", "eval_blocks",
                 "checkpoint_every"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.window < 0:
        raise UserError(f"--window must be >= 0 tokens (0: pure linear attention), got {args.window}")
    if args.sink < 0:
        raise UserError(f"--sink must be >= 0 tokens (0: none), got {args.sink}")
    if args.sink and not args.window:
        raise UserError(f"--sink {args.sink} keeps tokens exact beside a softmax window: give --window W >= 1 too "
                        f"(--recipe paper sets --window 0)")
    if args.sink and args.decay:
        raise UserError("--sink and --decay do not combine: drop one of them")
    if args.gate and args.window:
        raise UserError(f"--gate is for pure linear attention: add --window 0 (or drop --gate to keep the "
                        f"{args.window}-token window)")
    if args.delta and args.window:
        raise UserError(f"--delta is for pure linear attention: add --window 0 (or drop --delta to keep the "
                        f"{args.window}-token window)")
    if args.conv < 0 or args.conv == 1:
        raise UserError(f"--conv is a filter width of at least 2 tokens (0: none), got {args.conv}")
    if args.conv_lr is not None and not args.conv:
        raise UserError("--conv-lr is the learning rate of the --conv filters: give --conv K too, or drop it")
    if args.conv_lr is not None and not args.conv_lr > 0:
        raise UserError(f"--conv-lr must be a learning rate > 0, got {args.conv_lr:g}")
    if args.delta_lr is not None and not args.delta:
        raise UserError("--delta-lr is the learning rate of the --delta rule's parameters: give --delta too, or "
                        "drop it")
    if args.delta_lr is not None and not args.delta_lr > 0:
        raise UserError(f"--delta-lr must be a learning rate > 0, got {args.delta_lr:g}")
    if args.dims == "linear-dof" and not args.window:
        raise UserError("--dims linear-dof counts the attention beyond a softmax window: give --window W >= 1, or "
                        "use --dims attn-dof for the whole attention")
    if args.per_head and (args.dims in ("fix", "attn-dof", "linear-dof") or args.dims.startswith("fix:")):
        raise UserError("--per-head takes its per-head dims from the kernel's DoF allocation: use --dims dof, clip "
                        "or a dof.json file")
    if args.per_head and args.feature not in ("prf", "performer"):
        raise UserError(f"--per-head needs --feature prf or performer, not {args.feature!r}")
    if args.progressive and args.loss not in LAYER_LOSSES:
        raise UserError("--progressive is a layerwise mode; use it with --loss softmax, l2, output or softmax+output")
    if args.progressive and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--progressive trains the layers in order, each on the output of the ones before: run it "
                        "in one process, without torchrun")
    if not 1 <= args.dof_repeats <= 8:
        raise UserError(f"--dof-repeats must be between 1 and 8 (sets of 1024 points each), got {args.dof_repeats}")
    if args.direct_seq_len is not None and args.direct_seq_len < 2:
        raise UserError(f"--direct-seq-len must be at least 2 tokens, got {args.direct_seq_len}")
    if args.direct_blocks is not None and args.direct_blocks < 1:
        raise UserError(f"--direct-blocks must be at least 1 (leave it out to use --train-blocks), got "
                        f"{args.direct_blocks}")
    if args.lam_auto and args.dims not in ("dof", "clip") and not (args.keep_softmax and args.keep_by == "dof"):
        raise UserError("--lam-auto chooses the λ of a DoF estimate made here: use it with --dims dof or clip, or "
                        "--keep-softmax K --keep-by dof")
    if args.eval_every < 0:
        raise UserError(f"--eval-every must be >= 0 (0: only at the end), got {args.eval_every}")
    if args.cooldown_steps < 0:
        raise UserError(f"--cooldown-steps must be >= 0 (0: a constant learning rate), got {args.cooldown_steps}")
    if args.loss != "direct" and args.cooldown_steps > args.then_direct_steps:
        raise UserError(f"--cooldown-steps {args.cooldown_steps} is longer than the end-to-end phase "
                        f"(--then-direct-steps {args.then_direct_steps})")
    if args.time_limit < 0:
        raise UserError(f"--time-limit must be >= 0 minutes (0: none), got {args.time_limit:g}")
    if args.lora_rank < 0:
        raise UserError(f"--lora-rank must be >= 0 (0: no LoRA), got {args.lora_rank}")
    if args.lora_rank and args.loss != "direct" and args.then_direct_steps == 0:
        raise UserError("--lora-rank adapters train only in the end-to-end phase: use --loss direct or "
                        "--then-direct-steps N > 0")
    if args.lora_targets != "attention" and not args.lora_rank:
        raise UserError(f"--lora-targets {args.lora_targets} needs adapters: add --lora-rank R (R >= 1)")
    if args.lora_rank:                            # before hours of layerwise training, not after
        from dofattn.lora import require_peft
        require_peft()
    if args.keep_softmax < 0 or args.keep_by not in KEEP_BY:
        raise UserError(f"--keep-softmax must be >= 0 and --keep-by one of {', '.join(KEEP_BY)}; got "
                        f"{args.keep_softmax} and {args.keep_by!r}")
    if args.keep_softmax and args.keep_by == "gain" and (args.loss not in LAYER_LOSSES or args.progressive):
        raise UserError("--keep-by gain measures the layers of the layerwise-trained student, each trained on the "
                        "teacher's inputs: use a layerwise --loss (softmax, l2, output, softmax+output) without "
                        "--progressive, or another --keep-by")
    if args.loss == "l2" and args.window >= args.seq_len:
        raise UserError(f"--loss l2 with --window {args.window} needs --seq-len > {args.window}: the features "
                        f"are fitted only on pairs farther apart than the window")
    if args.then_direct_steps < 0 or not args.kd_weight >= 0 or args.lr <= 0 or args.lr_weights <= 0:
        raise UserError("--then-direct-steps and --kd-weight must be >= 0, --lr and --lr-weights > 0")
    if not args.hidden_weight >= 0:
        raise UserError(f"--hidden-weight must be >= 0 (0: logits only), got {args.hidden_weight:g}")
    if not args.lm_weight >= 0:
        raise UserError(f"--lm-weight must be >= 0 (0: the teacher's logits alone), got {args.lm_weight:g}")
    if args.lm_weight == 0 and args.kd_weight == 0 and args.hidden_weight == 0:
        raise UserError("--lm-weight, --kd-weight and --hidden-weight are all 0: the end-to-end phase would have "
                        "nothing to learn from; give one of them a weight above 0")
    if args.tokens is not None and args.tokens < tokens_per_step(args):
        raise UserError(f"--tokens {args.tokens} is less than one step's batch ({tokens_per_step(args)} tokens)")
    dims = args.dims
    if not (dims in ("dof", "clip", "attn-dof", "linear-dof") or dims == "fix" or dims.startswith("fix:")
            or dims.endswith(".json")):
        raise UserError(f"bad --dims {dims!r}; use dof, clip, attn-dof, linear-dof, fix, fix:C, or a dof.json file")


def dof_estimate(args, model, tokenizer, out: Path):
    """The DoF estimate (`DofResult`) for `--dims dof|clip` or `--keep-by dof`: read from `--dims` when that is a
    dof.json file, else computed once (rank 0) on the training split and kept as out/dof.json."""
    from dofattn.data import token_blocks
    from dofattn.dof import HELDOUT_POINTS, DofResult, allocate_dims, allocate_dims_auto, sample_points

    if args.dims.endswith(".json"):
        return DofResult.from_json(Path(args.dims).read_text())
    path = out / "dof.json"
    if world()[0] == 0 and not path.is_file():
        blocks = token_blocks(args.data, tokenizer, 256, 32, split="train", seed=args.seed)
        points = 1024 * args.dof_repeats
        sample = sample_points(model, blocks, samples=points + (HELDOUT_POINTS if args.lam_auto else 0),
                               seed=args.seed)
        _, _, head_dim = head_layout(model)
        meta = dict(model=args.model, data=args.data, num_blocks=32, seq_len=256)
        if args.lam_auto:
            train, heldout = sample.split(points)
            result = allocate_dims_auto(train, heldout, head_dim, args.dims == "clip", args.dof_repeats,
                                        progress=True, **meta)
            print(f"--lam-auto chose λ = 2^{math.log2(result.lam):.0f} (trace-relative)", flush=True)
        else:
            result = allocate_dims(sample, args.lam, head_dim, clip=args.dims == "clip", progress=True,
                                   repeats=args.dof_repeats, **meta)
        for warning in result.warnings():
            print(f"WARNING: {warning}", flush=True)
        tmp = path.with_suffix(".partial")
        tmp.write_text(result.to_json())
        os.replace(tmp, path)
    barrier()
    return DofResult.from_json(path.read_text())


def softmax_layers(args, num_layers: int, dof=None, attn_dof: list[float] | None = None) -> list[int]:
    """The layers `--keep-softmax K --keep-by dof|attn-dof|first|random` leaves as softmax attention, sorted (gain:
    later).

    dof: the K layers with the largest DoF of the kernel (ties: the earlier layer); attn-dof: the K with the
    largest DoF of the teacher's attention matrices (`attn_dof`, per layer); first: layers 0..K-1; random: K layers
    drawn with `--seed`. gain: none yet; `keep_by_gain` chooses them after layerwise training.
    """
    K = args.keep_softmax
    if K == 0 or args.keep_by == "gain":
        return []
    if args.keep_by == "first":
        return list(range(K))
    if args.keep_by == "random":
        return sorted(torch.randperm(num_layers, generator=torch.Generator().manual_seed(args.seed))[:K].tolist())
    score = attn_dof if args.keep_by == "attn-dof" else [layer.dof for layer in dof.layers]
    order = sorted(range(num_layers), key=lambda i: (-score[i], i))
    return sorted(order[:K])


def attention_dof_estimate(args, model, blocks: torch.Tensor, out: Path, window: int = 0,
                           sink: int = 0) -> list[float]:
    """`--keep-by attn-dof`, `--dims attn-dof`: per layer, the DoF of the teacher's causal attention matrices
    (`dof.attention_dofs`, mean over heads and `blocks`), at the run's --lam. Computed once (rank 0) and kept in
    out/attention_dof.json, so a resumed run keeps the same layers and dims. With a `window` (`--dims
    linear-dof`): the DoF of the part beyond the window and the sink, the part the features produce, kept in
    out/linear_dof.json."""
    from dofattn.dof import attention_dofs

    path = out / ("linear_dof.json" if window else "attention_dof.json")
    if world()[0] == 0 and not path.is_file():
        heads = attention_dofs(model, blocks, args.lam, progress=True, window=window, sink=sink)
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps({"lam": args.lam, "blocks": len(blocks), "seq_len": blocks.shape[1],
                                   "window": window, "sink": sink,
                                   "layers": [sum(h) / len(h) for h in heads], "heads": heads}, indent=2))
        os.replace(tmp, path)
    barrier()
    return json.loads(path.read_text())["layers"]


def keep_by_gain(args, model, blocks: torch.Tensor, out: Path) -> list[int]:
    """`--keep-by gain`: the K layers whose exact softmax attention, given back alone to the layerwise-trained
    student, lowers its KL to the teacher most on `GAIN_BLOCKS` training blocks (ties: the earlier layer). Measured
    once and kept in out/keep.json, so a resumed run keeps the same layers; their linear parts are taken off."""
    from dofattn.evaluate import restore_gains
    from dofattn.student import restore_softmax

    path, rank = out / "keep.json", world()[0]
    if rank == 0 and not path.is_file():
        gains = restore_gains(model, blocks[:GAIN_BLOCKS])
        order = sorted((i for i, g in enumerate(gains) if g is not None), key=lambda i: (-gains[i], i))
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps({"layers": sorted(order[:args.keep_softmax]), "kl_gain": gains,
                                   "blocks": min(GAIN_BLOCKS, len(blocks))}, indent=2))
        os.replace(tmp, path)
    barrier()
    kept = json.loads(path.read_text())["layers"]
    restore_softmax(model, kept)
    if rank == 0:
        print(f"--keep-by gain: layers {', '.join(map(str, kept))} keep softmax attention", flush=True)
    return kept


def run(args) -> dict:
    """The whole `dofattn distill` job; returns the run log (also written to out/log.json)."""
    from dofattn.data import check_source, token_blocks
    from dofattn.hf import load_model, parse_dtype
    from dofattn.student import StudentConfig, fingerprint, is_student_tensor, linearize, resolve_dims, save_student

    resolve_recipe(args)
    validate(args)
    check_source(args.data)
    if args.eval_data:
        check_source(args.eval_data)
    record = {**asdict(args), "decay_start": list(DECAY_START) if args.decay or args.gate else None}
    if args.continue_from:                         # before the model loads: a refused copy costs nothing
        check_continue(Path(args.continue_from), Path(args.out), record)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        from datetime import timedelta

        backend = "nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(hours=4))
    rank, size = world()
    out = Path(args.out)
    device = args.device
    if device.startswith("cuda") and size > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    torch.manual_seed(args.seed)
    log = RunLog(args=asdict(args))
    timer = time.perf_counter()

    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=device)
    # fixed dims are resolved before the run folder exists: a bad --dims (fix:0, another model's dof.json) leaves none
    dims = None if args.dims in ("dof", "clip", "attn-dof", "linear-dof") else resolve_dims(args.dims, model,
                                                                                              args.model)
    num_layers = len(attention_modules(model))
    if args.keep_softmax >= num_layers:
        raise UserError(f"--keep-softmax {args.keep_softmax} leaves no layer to linearize: the model has "
                        f"{num_layers} layers")
    steps = args.steps if args.tokens is None else math.ceil(args.tokens / tokens_per_step(args))
    direct_steps = steps if args.loss == "direct" else args.then_direct_steps
    # the text is read before the run folder exists too: asking for more than the data holds leaves none behind
    train = token_blocks(args.data, tokenizer, args.seq_len, args.train_blocks, split="train", seed=args.seed)
    direct_train = train                              # the end-to-end phase's blocks
    blocks, length = direct_shape(args)
    if direct_steps and (blocks, length) != tuple(train.shape):
        direct_train = token_blocks(args.data, tokenizer, length, blocks, split="train", seed=args.seed)
    valid = token_blocks(args.eval_data or args.data, tokenizer, args.eval_seq_len, args.eval_blocks,
                         split="validation", seed=0)
    attn_blocks = None
    if args.dims in ("attn-dof", "linear-dof") or (args.keep_softmax and args.keep_by == "attn-dof"):
        attn_blocks = token_blocks(args.data, tokenizer, min(args.eval_seq_len, ATTENTION_DOF_SEQ_LEN),
                                   ATTENTION_DOF_BLOCKS, split="train", seed=args.seed)
    copied = False
    if rank == 0:  # after the model loaded: a typo in --model leaves no run folder behind
        if args.continue_from:
            copied = continue_run(Path(args.continue_from), out, record)
        check_run_folder(out, record)
    barrier()
    finished = json.loads((out / "log.json").read_text()) if (out / "log.json").is_file() else None
    done = finished.get("direct", {}) if finished else {}
    done_steps, stopped = done.get("steps", 0), bool(done.get("stopped"))
    if finished and not stopped and done_steps >= direct_steps:
        if rank == 0:                                 # finished before, with these arguments
            print(f"{out} holds a finished run with these arguments; its results:", flush=True)
        return finished
    if finished and rank == 0 and copied:
        print(f"{out}: a copy of {args.continue_from}; its end-to-end phase goes on from step {done_steps} to "
              f"{direct_steps}", flush=True)
    elif finished and rank == 0:
        why = "stopped at its time limit" if stopped else "is asked for more"
        print(f"{out}: the end-to-end phase {why} after {done_steps} of {direct_steps} steps; going on", flush=True)
    dof = None
    if args.dims in ("dof", "clip") or args.per_head or (args.keep_softmax and args.keep_by == "dof"):
        dof = dof_estimate(args, model, tokenizer, out)
    attn_dof = None
    if args.dims == "attn-dof" or (args.keep_softmax and args.keep_by == "attn-dof"):
        attn_dof = attention_dof_estimate(args, model, attn_blocks, out)
    if args.dims in ("attn-dof", "linear-dof"):  # ∝ a DoF of the attention matrices, the same total as Fix
        from dofattn.dof import allocate

        weights = attn_dof if args.dims == "attn-dof" else attention_dof_estimate(args, model, attn_blocks, out,
                                                                                  args.window, args.sink)
        dims = allocate(weights, head_layout(model)[2] * num_layers)
    elif dims is None:
        dims = resolve_dims(dof.dims, model, args.model)
    head_dims = None
    if args.per_head:  # each head its own count from the allocation over all heads; the layer holds the largest
        head_dims = [layer.head_dims for layer in dof.layers]
        dims = [max(h) for h in head_dims]
    log.dims = dims
    kept = softmax_layers(args, num_layers, dof, attn_dof)
    log.softmax_layers = kept
    linearize(model, dims, args.feature, layers=[i for i in range(num_layers) if i not in kept], seed=args.seed,
              window=args.window, head_dims=head_dims, decay=args.decay, sink=args.sink, gate=args.gate,
              conv=args.conv, delta=args.delta)
    if args.lora_rank:
        from dofattn.lora import add_lora

        add_lora(model, args.lora_rank, seed=args.seed, targets=args.lora_targets)
    for name, p in model.named_parameters():  # only feature parameters (and LoRA adapters) ever train
        p.requires_grad_(is_student_tensor(name))
    log.seconds["setup"] = round(time.perf_counter() - timer, 1)

    if finished:  # going on with an end-to-end phase (time limit, or more steps): the layerwise stage is done
        log.layers, log.seconds = finished.get("layers", {}), {**finished["seconds"], **log.seconds}
        before = finished.get("evaluation", {})
        if "layerwise_student_ppl" in before:
            log.evaluation["layerwise_student_ppl"] = before["layerwise_student_ppl"]
        elif not done_steps and args.loss in LAYER_LOSSES and "student_ppl" in before:  # it had no end-to-end phase
            log.evaluation["layerwise_student_ppl"] = before["student_ppl"]
    elif args.loss in LAYER_LOSSES:
        timer = time.perf_counter()
        cache = None
        if not args.progressive:
            cache = TeacherCache(out / "teacher", len(dims), tuple(train.shape), head_layout(model))
            if rank == 0 and not cache.done:
                cache.build(model, train, args.batch_size, progress=True)
        barrier()
        log.layers = layerwise(model, cache, out, args.loss, steps, args.batch_size, args.lr, args.lr_weights,
                               args.seed, progress=rank == 0, blocks=train)
        log.seconds["layerwise"] = round(time.perf_counter() - timer, 1)
    if args.keep_softmax and args.keep_by == "gain":
        log.softmax_layers = keep_by_gain(args, model, train, out)
        log.layers = {k: v for k, v in log.layers.items() if int(k) not in log.softmax_layers}
    if finished and not done_steps:  # more steps for a run without an end-to-end phase: its saved student
        from dofattn.student import load_student_tensors

        load_student_tensors(model, out)
    if direct_steps and args.loss in LAYER_LOSSES and rank == 0 and not finished:  # what layerwise alone reached
        log.evaluation["layerwise_student_ppl"] = perplexity(model, valid, desc="layerwise student ppl")
    if direct_steps:
        timer = time.perf_counter()
        log.direct = direct(model, direct_train, out, direct_steps, args.direct_batch_size, args.direct_lr,
                            args.kd_weight, args.seed, args.checkpoint_every, progress=rank == 0,
                            eval_blocks=valid, eval_every=args.eval_every, time_limit=60 * args.time_limit,
                            cooldown=args.cooldown_steps, hidden_weight=args.hidden_weight,
                            conv_lr=args.conv_lr, delta_lr=args.delta_lr, lm_weight=args.lm_weight)
        log.seconds["direct"] = round(time.perf_counter() - timer + (finished["seconds"].get("direct", 0)
                                                                        if finished else 0), 1)
    if rank == 0:
        config = StudentConfig(args.model, args.feature, dims, [i for i, m in enumerate(attention_modules(model))
                                                                if hasattr(m, "dofattn")], args.seed,
                               fingerprint(model), window=args.window, lora_rank=args.lora_rank,
                               lora_alpha=float(args.lora_rank), lora_targets=args.lora_targets,
                               head_dims=head_dims, decay=args.decay, sink=args.sink, gate=args.gate,
                               conv=args.conv, delta=args.delta)
        save_student(model, out, config)
        timer = time.perf_counter()
        log.evaluation.update(evaluate_run(args, model, valid, dims))
        if "layerwise_student_ppl" in log.evaluation:
            log.evaluation["layerwise_vs_teacher"] = (log.evaluation["layerwise_student_ppl"]
                                                      / log.evaluation["teacher_ppl"])
        log.seconds["evaluate"] = round(time.perf_counter() - timer, 1)
        tmp = out / "log.partial"
        tmp.write_text(json.dumps(asdict(log), indent=2))
        os.replace(tmp, out / "log.json")
        shutil.rmtree(out / "teacher", ignore_errors=True)  # ~1 GB, only needed to resume layerwise training
    barrier()
    return asdict(log)


def evaluate_run(args, model, blocks: torch.Tensor, dims: list[int]) -> dict:
    """On validation `blocks`: perplexity of the teacher, the student and an untrained Performer with the same
    budget, and the student's KL to the teacher, top-1 agreement and those by context length (`by_position`)."""
    from dofattn.evaluate import compare
    from dofattn.hf import load_model, parse_dtype
    from dofattn.student import linearize

    device = next(model.parameters()).device
    against = compare(model, blocks)
    teacher, student = against["teacher_ppl"], against["ppl"]
    baseline_model, _ = load_model(args.model, dtype=parse_dtype(args.dtype), device=device)
    budget = round(sum(dims) / len(dims))
    linearize(baseline_model, [budget] * len(dims), "performer", seed=args.seed)
    performer = perplexity(baseline_model, blocks, desc="performer ppl")
    return {"tokens": blocks.numel(), "seq_len": args.eval_seq_len, "teacher_ppl": teacher, "student_ppl": student,
            "performer_ppl": performer, "performer_dim": budget, "student_vs_teacher": student / teacher,
            "performer_vs_teacher": performer / teacher, "kl": against["kl"],
            "top1_agreement": against["top1_agreement"], "by_position": against["by_position"]}
