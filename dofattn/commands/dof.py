"""Estimate the degrees of freedom of every attention head's softmax kernel and allocate feature dims.

Runs the model over a data sample, keeps J query/key points per head, and computes
DoF(λ) = tr G(G+λI)⁻¹ of the kernel exp(qᵀk/√d) on them. Each layer's DoF is the max over its heads; layers
get feature dimensions proportional to their DoF, with mean --budget. Writes a JSON file (input to
`--dims` of later stages) and optionally a plot, and prints a per-layer table.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass

from dofattn.commands import DATA_HELP, add_verb, config, option
from dofattn.errors import UserError


def options() -> list[type]:
    """The options: `DofArgs`, whose sample defaults are the ones a distillation run uses (`choose.DOF_*`)."""
    return [dof_args()]


@functools.cache
def dof_args() -> type:
    """The dof verb's options (dof.py has no config of its own); made on first use, as the defaults read
    `distill.choose`."""
    from dofattn.distill.choose import DOF_BLOCKS, DOF_POINTS, DOF_SEQ_LEN

    @dataclass
    class DofArgs:
        model: str = option("smollm2-135m", "built-in alias (smollm2-135m), hub id, model folder, or .gguf file")
        data: str = option("wiki-sample", DATA_HELP)
        split: str = option("train", "data split to sample from: train, validation or all")
        samples: int = option(DOF_POINTS, "J: query/key points sampled per head (cost grows as J^3)")
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
                                        "blocks, at --lam relative to their trace), which --keep-by attn-dof "
                                        "follows: shown beside the kernel's, with its top layers, and kept in the "
                                        "JSON. Costs a T³ SVD per head and block")
        num_blocks: int = option(DOF_BLOCKS, "number of token blocks to run through the model")
        seq_len: int = option(DOF_SEQ_LEN, "tokens per block")
        batch_size: int = option(4, "blocks per forward pass")
        seed: int = option(0, "seed for the data order and the point sample")
        device: str = option("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
        dtype: str = option("float32", "model dtype: float32 or bfloat16 (DoF is always computed in float64)")
        out: str = option("dof.json", "where to write the JSON result")
        plot: str | None = option(None, "also write a figure of DoF and dims per layer (.png, .pdf or .svg)")

    return DofArgs


def add_parser(verbs):
    return add_verb(verbs, "dof", __doc__, options())


def run(ns) -> int:
    """The `dof` verb: capture, spectra, allocation, table, JSON, plot."""
    from dofattn.data import SPLITS, check_source, token_blocks
    from dofattn.dof import (HELDOUT_POINTS, allocate_dims, allocate_dims_auto, attention_dofs, check_sample_size,
                             sample_points)
    from dofattn.hf import resolve_device
    from dofattn.io import check_output
    from dofattn.hf import load_model, parse_dtype
    from dofattn.io import write_atomic

    args = config(dof_args(), ns)
    # everything that can be checked without the model is checked before it loads
    out = check_output(args.out, "--out", (".json",))
    plot = check_output(args.plot, "--plot", (".png", ".pdf", ".svg")) if args.plot else None
    if args.samples < 2:
        raise UserError(f"--samples must be at least 2, got {args.samples}")
    if args.lam <= 0:
        raise UserError(f"--lam must be positive, got {args.lam:g}")
    if args.budget is not None and args.budget < 1:
        raise UserError(f"--budget is the mean feature dimension per layer and must be >= 1, got {args.budget}")
    check_source(args.data)
    if args.split not in SPLITS:
        raise UserError(f"unknown --split {args.split!r}; use one of {', '.join(SPLITS)}")
    if args.num_blocks < 1 or args.batch_size < 1:
        raise UserError("--num-blocks and --batch-size must be at least 1")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    if args.lam_auto and args.lam_scale != "trace":
        raise UserError("--lam-auto searches trace-relative λ; drop --lam-scale raw")
    heldout = HELDOUT_POINTS if args.lam_auto else 0
    check_sample_size(args.samples * args.repeats + heldout, args.num_blocks, args.seq_len)
    device, dtype = resolve_device(args.device), parse_dtype(args.dtype)

    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    blocks = token_blocks(args.data, tokenizer, args.seq_len, args.num_blocks, split=args.split, seed=args.seed)
    sample = sample_points(model, blocks, args.samples * args.repeats + heldout, args.batch_size, args.seed)
    budget = args.budget or sample.head_dim
    meta = {"model": args.model, "data": args.data, "num_blocks": args.num_blocks, "seq_len": args.seq_len}
    if args.lam_auto:
        train, held = sample.split(args.samples * args.repeats)
        result = allocate_dims_auto(train, held, budget, args.clip, args.repeats, progress=True, **meta)
        print(format_lam_search(result))
    else:
        result = allocate_dims(sample, args.lam, budget, args.clip, args.lam_scale, progress=True,
                               repeats=args.repeats, **meta)
    if args.attention:
        for layer, heads in zip(result.layers, attention_dofs(model, blocks, result.lam)):
            layer.attention_dof = sum(heads) / len(heads)
    elapsed = time.perf_counter() - start

    print(format_table(result))
    if args.attention:
        order = sorted(result.layers, key=lambda layer: (-layer.attention_dof, layer.layer))
        print("largest attention DoF (what student.keep_softmax = K keeps): layers "
              f"{', '.join(str(layer.layer) for layer in order[:5])}")
    print(f"total dim {sum(result.dims)} = {len(result.dims)} layers x mean {sum(result.dims) / len(result.dims):g}"
          f"{' (clipped)' if args.clip else ''}; {elapsed:.1f} s")
    for warning in result.warnings():
        print(f"WARNING: {warning}", file=sys.stderr)
    write_atomic(out, result.to_json())
    print(f"wrote {out}")
    if plot:
        from dofattn.plots import plot_dof

        plot_dof(result, plot)
        print(f"wrote {plot}")
    return 0


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
    """A `dof.DofResult` per layer: DoF max (± its spread over repeats), min, dim, head dims, attention DoF."""
    spread = result.repeats > 1
    attention = any(layer.attention_dof is not None for layer in result.layers)
    std_header = f"  {'± std':>6}" if spread else ""
    attention_header = f"  {'attn DoF':>8}" if attention else ""
    rows = [f"{'layer':>5}  {'DoF max':>8}{std_header}  {'DoF min':>8}  {'dim':>5}  {'head dims':>12}"
            f"{attention_header}"]
    for layer in result.layers:
        heads = f"{min(layer.head_dims)}-{max(layer.head_dims)}"
        std = f"  {layer.dof_std:>6.2f}" if spread else ""
        attn = f"  {layer.attention_dof:>8.2f}" if attention else ""
        rows.append(f"{layer.layer:>5}  {layer.dof:>8.2f}{std}  {min(layer.head_dof):>8.2f}  {layer.dim:>5}  "
                    f"{heads:>12}{attn}")
    return "\n".join(rows)
