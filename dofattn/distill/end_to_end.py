"""The end-to-end phase: the whole student against the frozen teacher, on text, resumable from checkpoints.

The loss is the student's next-token cross-entropy on the text plus `kd_weight` × KL(teacher ‖ student) on the logits
(`loss`); only student tensors train (feature maps, window gains, decays, filters, LoRA adapters). Step i trains on
blocks drawn from (seed, i) alone (`draw`), so a resumed, continued or longer run draws what one run made at once
would. With several processes each takes its share of a step's blocks and the gradients are averaged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dofattn.attention import CONV_NAMES
from dofattn.distill.world import all_mean, barrier, rank0_decides, world
from dofattn.errors import UserError
from dofattn.evaluate import perplexity, teacher_mode
from dofattn.io import read_safetensors, write_json
from dofattn.recipe import EndToEnd
from dofattn.student import attention_modules, is_student_tensor


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    """What the phase trains: the student's tensors that require a gradient."""
    return [(n, p) for n, p in model.named_parameters() if is_student_tensor(n) and p.requires_grad]


def param_groups(named: list[tuple[str, torch.nn.Parameter]], lr: float,
                 conv_lr: float | None = None) -> tuple[list[str], list[dict]]:
    """(names in the optimizer's order, Adam groups): everything at `lr`, with `conv_lr` the convolution filters in
    a group of their own. Each group keeps its rate as "base_lr" for the cooldown."""
    filters = tuple("." + name for name in CONV_NAMES) if conv_lr is not None else ()
    parts = [([(n, p) for n, p in named if not (filters and n.endswith(filters))], lr),
             ([(n, p) for n, p in named if filters and n.endswith(filters)], conv_lr)]
    return ([n for part, _ in parts for n, _ in part],
            [{"params": [p for _, p in part], "lr": rate, "base_lr": rate} for part, rate in parts if part])


def loss(model, ids: torch.Tensor, kd_weight: float) -> torch.Tensor:
    """The student's mean next-token cross-entropy on `ids`, plus kd_weight × the mean KL(teacher ‖ student) per
    token (the teacher is the same model in `teacher_mode`)."""
    logits = model(input_ids=ids, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)                    # [B, T-1, vocab]
    value = F.nll_loss(logp.reshape(-1, logp.shape[-1]), ids[:, 1:].reshape(-1))
    if kd_weight > 0:
        with torch.no_grad(), teacher_mode(model):
            teacher = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), -1)
        value = value + kd_weight * F.kl_div(logp, teacher, log_target=True, reduction="none").sum(-1).mean()
    return value


def cooldown_lr(lr: float, step: int, steps: int, cooldown: int) -> float:
    """The learning rate of 0-based `step` of `steps`: constant, then over the last `cooldown` steps down in a
    straight line towards 0 (the last step's is lr / cooldown)."""
    return lr * min(1.0, (steps - step) / cooldown) if cooldown else lr


def draw(seed: int, step: int, num_blocks: int, count: int) -> torch.Tensor:
    """The blocks step `step` trains on: `count` indices drawn with replacement, from (seed, step) alone."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(num_blocks, (count,), generator=gen)


# --- checkpoints ----------------------------------------------------------------------------------------------------

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
    tensors, _ = read_safetensors(path)
    for name, p in zip(names, [p for g in optimizer.param_groups for p in g["params"]]):
        if f"{name}::exp_avg" in tensors:
            optimizer.state[p] = {"step": tensors[f"{name}::step"].reshape(()),
                                  "exp_avg": tensors[f"{name}::exp_avg"].to(p.device),
                                  "exp_avg_sq": tensors[f"{name}::exp_avg_sq"].to(p.device)}


def save_checkpoint(ckpt: Path, step: int, losses: list[float], tensors: list, optimizer, names,
                    curve: list[dict]) -> None:
    """A complete checkpoint in its own folder, then `state.json` pointing at it (atomic), then old folders go."""
    folder = f"step_{step:06d}"
    (ckpt / folder).mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous() for n, t in tensors}, str(ckpt / folder / "features.safetensors"))
    save_optimizer(optimizer, names, ckpt / folder / "optimizer.safetensors", step)
    write_json(ckpt / "state.json", {"step": step, "folder": folder, "losses": losses, "curve": curve})
    for old in ckpt.glob("step_*"):
        if old.name != folder:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()


def load_checkpoint(ckpt: Path, tensors: list, optimizer, names) -> tuple[int, list[float], list[dict]]:
    """(step, losses, curve) of the checkpoint in `ckpt`, its tensors and Adam state loaded; (0, [], []) if none."""
    if not (ckpt / "state.json").is_file():          # written last: it names a complete checkpoint folder
        return 0, [], []
    meta = json.loads((ckpt / "state.json").read_text())
    state, _ = read_safetensors(ckpt / meta["folder"] / "features.safetensors")
    missing = [n for n, _ in tensors if n not in state]
    if missing:
        raise UserError(f"{ckpt} has no {missing[0]}: its student differs from this one; rerun with the run "
                        f"folder's own recipe.toml")
    with torch.no_grad():
        for n, t in tensors:
            t.copy_(state[n])
    load_optimizer(optimizer, names, ckpt / meta["folder"] / "optimizer.safetensors")
    return meta["step"], meta["losses"], meta.get("curve", [])


# --- the phase ------------------------------------------------------------------------------------------------------

def train(model, blocks: torch.Tensor, out: Path, config: EndToEnd, seed: int, eval_blocks: torch.Tensor,
          time_limit: float = 0.0, progress: bool = True, optimizer_class=torch.optim.Adam) -> dict:
    """`config.steps` steps on `blocks`, resuming from the last checkpoint in `out/end_to_end`; returns the log.

    With `config.eval_every` > 0 rank 0 measures the validation perplexity on `eval_blocks` every that many steps
    (the log's `curve`: step, training tokens of all processes, perplexity). With `time_limit` > 0 (seconds) the
    phase stops after the first step that ends past it, checkpointed; the log then has `stopped` and
    `target_steps`, which the same command later goes on to. `optimizer_class` takes the param groups (tests use
    plain SGD, whose step shows a wrong gradient average that Adam's scale invariance would hide).
    """
    rank, size = world()
    named = trainable(model)
    if not named:
        return {"steps": 0, "note": "no trainable student tensors"}
    steps, batch_size = config.steps, config.batch_size
    names, groups = param_groups(named, config.lr, config.conv_lr)
    params = [p for group in groups for p in group["params"]]
    persistent = model.state_dict().keys()             # PRF key shifts move in training too; masks are fixed
    tensors = named + [(n, b) for n, b in model.named_buffers() if ".dofattn." in n and n in persistent]
    optimizer = optimizer_class(groups)
    ckpt = out / "end_to_end"
    start_step, losses, curve = load_checkpoint(ckpt, tensors, optimizer, names)
    device = params[0].device
    linears = [m.dofattn for m in attention_modules(model) if hasattr(m, "dofattn")]
    for linear in linears:            # the base model stays in eval mode: no dropout, a deterministic teacher
        linear.train()
    started = time.perf_counter()
    bar = tqdm(range(start_step, steps), desc="end-to-end", unit="step", disable=not progress or rank != 0,
               initial=start_step, total=steps)
    done = steps
    for step in bar:
        idx = draw(seed, step, len(blocks), batch_size * size)[rank::size]
        value = loss(model, blocks[idx].to(device), config.kd_weight)
        for group in optimizer.param_groups:
            group["lr"] = cooldown_lr(group["base_lr"], step, steps, config.cooldown_steps)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        all_mean([p.grad for p in params])
        optimizer.step()
        losses.append(round(value.item(), 5))
        bar.set_postfix(loss=f"{value.item():.4f}")
        if rank == 0 and config.eval_every and ((step + 1) % config.eval_every == 0 or step + 1 == steps):
            for linear in linears:    # eval mode: validation text must not move the PRF key shifts
                linear.eval()
            ppl = perplexity(model, eval_blocks, progress=False)
            for linear in linears:
                linear.train()
            curve.append({"step": step + 1, "tokens": (step + 1) * batch_size * size * blocks.shape[1],
                          "ppl": ppl})
            bar.set_postfix(loss=f"{value.item():.4f}", ppl=f"{ppl:.1f}")
        out_of_time = rank0_decides(bool(time_limit) and time.perf_counter() - started > time_limit
                                    and step + 1 < steps, device)
        if rank == 0 and ((step + 1) % config.checkpoint_every == 0 or step + 1 == steps or out_of_time):
            save_checkpoint(ckpt, step + 1, losses, tensors, optimizer, names, curve)
        if out_of_time:
            done = step + 1
            break
    for linear in linears:
        linear.eval()
    barrier()
    result = {"steps": done, "first_loss": losses[0] if losses else None,
              "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None, "losses": losses,
              "curve": curve, "seconds": round(time.perf_counter() - started, 2)}
    if done < steps:
        result.update(stopped="time limit", target_steps=steps)
    return result
