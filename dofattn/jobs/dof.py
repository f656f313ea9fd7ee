"""The `dofattn dof` job: a model's per-layer DoF estimated from its real queries and keys, and the feature dims
allocated in proportion under a budget, as one `DofConfig` asks; written as JSON (input to the recipe key
`student.dims` and `generate --dims`) and optionally a figure.

    result = run(DofConfig(model="smollm2-135m", out="dof.json"), progress=print)   # what `dofattn dof` does
    result.dims, [layer.dof for layer in result.layers]

The estimator is `dof`'s (`sample_points`, `allocate_dims`); a distillation run samples as the defaults here do
(`DOF_BLOCKS`, `DOF_SEQ_LEN`, `DOF_POINTS`, read by `distill.choose`). Importing this module loads no model code,
so `dofattn dof --help` stays quick.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

from dofattn.recipe import DOF_BLOCKS, DOF_POINTS, DOF_SEQ_LEN
from dofattn.errors import UserError
from dofattn.options import DATA_HELP, Machine, option



@dataclass
class DofConfig(Machine):
    """What `run` estimates, on what, and where it writes; the fields are `dofattn dof`'s options of the same names."""

    model: str = option("smollm2-135m", "built-in alias (smollm2-135m, gemma3-270m), hub id, model folder, or "
                                        ".gguf file")
    data: str = option("wiki-sample", DATA_HELP)
    split: str = option("train", "data split to sample from: train, validation or all")
    points: int = option(DOF_POINTS, "J: query/key points sampled per head (cost grows as J^3)", was="samples")
    repeats: int = option(1, "pool R estimates on R disjoint sets of J points each (R·J points are sampled): the "
                             "allocation uses the mean DoF and the table shows its spread")
    lam: float = option(2.0 ** -8, "λ; with --lam-scale trace it is relative to the Gram matrix's trace")
    lam_auto: bool = option(False, "choose λ (trace-relative, 2^-2 ... 2^-14) whose dims give the least kernel "
                                   "error of random features at the budget, on 512 held-out points per head "
                                   "(uniform dims are shown for comparison); --lam is then ignored")
    lam_scale: str = option("trace", "trace: λ relative to tr G (scale-free, default); raw: the paper's "
                                     "absolute λ", choices=("trace", "raw"))
    budget: int | None = option(None, "mean feature dimension per layer; the total budget x layers is kept "
                                      "exactly (default: the head size)")
    clip: bool = option(False, "cap every layer's dimension at the head size (the paper's DoF+clip)")
    attention: bool = option(False, "also the DoF of each layer's attention matrices (mean over heads and "
                                    "blocks, at --lam relative to their trace), which student.keep_softmax_by = dof "
                                    "follows: shown beside the kernel's, with its top layers, and kept in the "
                                    "JSON. Costs a T³ SVD per head and block")
    num_blocks: int = option(DOF_BLOCKS, "number of token blocks to run through the model")
    seq_len: int = option(DOF_SEQ_LEN, "tokens per block")
    batch_size: int = option(4, "blocks per forward pass")
    seed: int = option(0, "seed for the data order and the point sample")
    out: str = option("dof.json", "where to write the JSON result")
    plot: str | None = option(None, "also write a figure of DoF and dims per layer (.png, .pdf or .svg)")


def run(cfg: DofConfig, progress=None):
    """`dofattn dof`: the `dof.DofResult` of `cfg.model` (also written to `cfg.out`, and a figure to `cfg.plot`).
    `progress(text)` gets each table as it is ready and each file written (print, say; None: quiet)."""
    from dofattn.data import check_source, check_split, token_blocks
    from dofattn.io import check_output, write_atomic

    say = progress or (lambda text: None)
    # everything that can be checked on the options alone is checked before torch and the model code are imported
    out = check_output(cfg.out, "--out", (".json",))
    plot = check_output(cfg.plot, "--plot", (".png", ".pdf", ".svg")) if cfg.plot else None
    if cfg.points < 2:
        raise UserError(f"--points must be at least 2, got {cfg.points}")
    if cfg.lam <= 0:
        raise UserError(f"--lam must be positive, got {cfg.lam:g}")
    if cfg.budget is not None and cfg.budget < 1:
        raise UserError(f"--budget is the mean feature dimension per layer and must be >= 1, got {cfg.budget}")
    check_source(cfg.data)
    check_split(cfg.split, "--split")
    if cfg.num_blocks < 1 or cfg.batch_size < 1:
        raise UserError("--num-blocks and --batch-size must be at least 1")
    if cfg.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {cfg.repeats}")
    if cfg.lam_auto and cfg.lam_scale != "trace":
        raise UserError("--lam-auto searches trace-relative λ; drop --lam-scale raw")
    from dofattn.dof import (HELDOUT_POINTS, allocate_dims, allocate_dims_auto, attention_dofs, check_sample_size,
                             sample_points)
    from dofattn.model.hf import load_model, machine_dtype, refuse_config_only, resolve_device, use_threads

    refuse_config_only(cfg.model, "dof (queries and keys of a trained model)")
    heldout = HELDOUT_POINTS if cfg.lam_auto else 0
    check_sample_size(cfg.points * cfg.repeats + heldout, cfg.num_blocks, cfg.seq_len)
    device = resolve_device(cfg.device)
    dtype = machine_dtype(cfg.dtype, device)
    use_threads(cfg.threads)

    start = time.perf_counter()
    model, tokenizer = load_model(cfg.model, dtype=dtype, device=device)
    blocks = token_blocks(cfg.data, tokenizer, cfg.seq_len, cfg.num_blocks, split=cfg.split, seed=cfg.seed)
    sample = sample_points(model, blocks, cfg.points * cfg.repeats + heldout, cfg.batch_size, cfg.seed)
    budget = cfg.budget or sample.head_dim
    meta = {"model": cfg.model, "data": cfg.data, "num_blocks": cfg.num_blocks, "seq_len": cfg.seq_len}
    if cfg.lam_auto:
        train, held = sample.split(cfg.points * cfg.repeats)
        result = allocate_dims_auto(train, held, budget, cfg.clip, cfg.repeats, progress=True, **meta)
        say(format_lam_search(result))
    else:
        result = allocate_dims(sample, cfg.lam, budget, cfg.clip, cfg.lam_scale, progress=True,
                               repeats=cfg.repeats, **meta)
    if cfg.attention:
        for layer, heads in zip(result.layers, attention_dofs(model, blocks, result.lam)):
            layer.attention_dof = sum(heads) / len(heads)
    elapsed = time.perf_counter() - start

    say(format_table(result))
    if cfg.attention:
        order = sorted(result.layers, key=lambda layer: (-layer.attention_dof, layer.layer))
        say("largest attention DoF (what student.keep_softmax = K keeps): layers "
              f"{', '.join(str(layer.layer) for layer in order[:5])}")
    say(f"total dim {sum(result.dims)} = {len(result.dims)} layers x mean {sum(result.dims) / len(result.dims):g}"
          f"{' (clipped)' if cfg.clip else ''}; {elapsed:.1f} s")
    for warning in result.warnings():
        print(f"WARNING: {warning}", file=sys.stderr)
    write_atomic(out, result.to_json())
    say(f"wrote {out}")
    if plot:
        from dofattn.plots import plot_dof

        plot_dof(result, plot)
        say(f"wrote {plot}")
    return result


def format_lam_search(result) -> str:
    """The λ search of `dof.allocate_dims_auto`: each λ's held-out error, DoF spread and dims."""
    rows = [f"{'λ':>10}  {'held-out attention error':>24}  {'DoF max/min':>11}  {'dims':>9}"]
    for row in result.lam_search:
        lam = "uniform" if row["lam"] is None else f"2^{math.log2(row['lam']):.0f}"
        mark = " <- chosen" if row["lam"] == result.lam else ""
        rows.append(f"{lam:>10}  {row['attention_error']:>24.4g}  {row['dof_spread']:>11.2f}  "
                    f"{min(row['dims']):>4}-{max(row['dims']):<4}{mark}")
    return "\n".join(rows)


def format_table(result) -> str:
    """A `dof.DofResult` per layer: DoF max (± its spread over repeats), min, dim, attention DoF."""
    spread = result.repeats > 1
    attention = any(layer.attention_dof is not None for layer in result.layers)
    std_header = f"  {'± std':>6}" if spread else ""
    attention_header = f"  {'attn DoF':>8}" if attention else ""
    rows = [f"{'layer':>5}  {'DoF max':>8}{std_header}  {'DoF min':>8}  {'dim':>5}{attention_header}"]
    for layer in result.layers:
        std = f"  {layer.dof_std:>6.2f}" if spread else ""
        attn = f"  {layer.attention_dof:>8.2f}" if attention else ""
        rows.append(f"{layer.layer:>5}  {layer.dof:>8.2f}{std}  {min(layer.head_dof):>8.2f}  {layer.dim:>5}{attn}")
    return "\n".join(rows)
