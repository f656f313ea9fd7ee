"""The `dofattn` command line: one verb per stage, each verb's options a dataclass whose field help is `--help`.

    dofattn dof                                   # DoF per layer of SmolLM2-135M on the Wikipedia sample
    dofattn dof --model gpt2 --lam 0.0625 --out gpt2-dof.json --plot gpt2-dof.png

Errors in what was asked for print one line (`dofattn: error: ...`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dofattn import __version__
from dofattn.errors import UserError


DATA_HELP = ("wiki-sample, a .txt/.jsonl/.parquet file or folder, hf:NAME[:CONFIG[:SPLIT]], or several of these "
             "joined by + (pooled)")


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class DofArgs:
    """Estimate the degrees of freedom of every attention head's softmax kernel and allocate feature dims.

    Runs the model over a data sample, keeps J query/key points per head, and computes
    DoF(λ) = tr G(G+λI)⁻¹ of the kernel exp(qᵀk/√d) on them. Each layer's DoF is the max over its heads; layers
    get feature dimensions proportional to their DoF, with mean --budget. Writes a JSON file (input to
    `--dims` of later stages) and optionally a plot, and prints a per-layer table.
    """

    model: str = _opt("smollm2-135m", "built-in alias (smollm2-135m), hub id, model folder, or .gguf file")
    data: str = _opt("wiki-sample", DATA_HELP)
    split: str = _opt("train", "data split to sample from: train, validation or all")
    samples: int = _opt(1024, "J: query/key points sampled per head (cost grows as J^3)")
    repeats: int = _opt(1, "pool R estimates on R disjoint sets of J points each (R·J points are sampled): the "
                           "allocation uses the mean DoF and the table shows its spread; R=4 steadies the dims")
    lam: float = _opt(2.0 ** -8, "λ; with --lam-scale trace it is relative to the Gram matrix's trace")
    lam_auto: bool = _opt(False, "choose λ (trace-relative, 2^-2 ... 2^-14) whose dims give the least kernel error "
                                 "of random features at the budget, on 512 held-out points per head (uniform "
                                 "dims are shown for comparison); --lam is then ignored")
    lam_scale: str = _opt("trace", "trace: λ relative to tr G (scale-free, default); raw: the paper's absolute λ",
                          choices=("trace", "raw"))
    budget: int | None = _opt(None, "mean feature dimension per layer; the total budget x layers is kept exactly "
                                    "(default: the head size)")
    clip: bool = _opt(False, "cap every layer's dimension at the head size (the paper's DoF+clip)")
    attention: bool = _opt(False, "also the DoF of each layer's attention matrices (mean over heads and blocks, at "
                                  "--lam relative to their trace), which --keep-by attn-dof follows: shown beside "
                                  "the kernel's, with its top layers, and kept in the JSON. Costs a T³ SVD per head "
                                  "and block")
    num_blocks: int = _opt(32, "number of token blocks to run through the model")
    seq_len: int = _opt(256, "tokens per block")
    batch_size: int = _opt(4, "blocks per forward pass")
    seed: int = _opt(0, "seed for the data order and the point sample")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "model dtype: float32 or bfloat16 (DoF is always computed in float64)")
    out: str = _opt("dof.json", "where to write the JSON result")
    plot: str | None = _opt(None, "also write a figure of DoF and dims per layer (.png, .pdf or .svg)")


@dataclass
class GenerateArgs:
    """Generate text with a linearized student (or any supported model) and its constant-size state.

    --model takes a student folder written by `dofattn distill` (or `dofattn.student.save_student`), or a base model
    (alias, hub id, folder, .gguf). With a base model, --dims linearizes it on the fly with untrained features
    (useful to check plumbing and speed, not quality); without --dims the base model generates as it is.
    """

    model: str = _opt("smollm2-135m", "student folder, or a base model: alias, hub id, folder or .gguf file")
    prompt: str = _opt("The history of mathematics", "text to continue")
    max_new_tokens: int = _opt(40, "number of tokens to generate")
    dims: str | None = _opt(None, "linearize a base model first: fix, fix:C or a dof.json file")
    feature: str = _opt("prf", "feature map when linearizing with --dims: prf, performer, hedgehog or dijiang")
    temperature: float = _opt(0.0, "0 for greedy decoding, > 0 to sample")
    static: bool = _opt(False, "greedy decoding on static buffers (dofattn.engine): a CUDA graph per token on CUDA; "
                               "needs every layer linear and --temperature 0")
    seed: int = _opt(0, "seed for sampling and for untrained features")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "model dtype: float32 or bfloat16")


def run_generate(args: GenerateArgs) -> int:
    """The `generate` verb."""
    import torch

    from dofattn.hf import load_model, parse_dtype
    from dofattn.student import is_student, linearize, load_student, resolve_dims

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature:g}")
    if args.static and args.temperature > 0:
        raise UserError("--static decodes greedily; drop --temperature or --static")
    device, dtype = _resolve_device(args.device), parse_dtype(args.dtype)
    if is_student(args.model):
        if args.dims:
            raise UserError(f"{args.model} is already a student; drop --dims")
        model, tokenizer, config = load_student(args.model, dtype=dtype, device=device, merge_lora=True)
        what = f"student of {config.base_model} ({config.feature}, dims {min(config.dims)}-{max(config.dims)})"
    else:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
        what = args.model
        if args.dims:
            dims = resolve_dims(args.dims, model, args.model)
            linearize(model, dims, args.feature, seed=args.seed)
            what += f" linearized with untrained {args.feature} features, dims {min(dims)}-{max(dims)}"
    torch.manual_seed(args.seed)
    inputs = tokenizer(args.prompt, return_tensors="pt").to(device)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    start = time.perf_counter()
    if args.static:
        from dofattn.engine import StaticDecoder

        out = StaticDecoder(model).generate(inputs["input_ids"], args.max_new_tokens, tokenizer.eos_token_id)
        what += ", static decoding" + (" with a CUDA graph" if device.startswith("cuda") else "")
    else:
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 **sampling)
    elapsed = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1]:]
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
    print(f"[{what}: {len(new)} tokens in {elapsed:.2f} s, {len(new) / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


@dataclass
class DistillArgs:
    """Distil a linear-attention student from its softmax teacher; the default job of dofattn.

    Layerwise (--loss softmax or l2): every attention layer's feature map is trained alone on the teacher's own
    queries and keys, then optionally the whole student end to end (--then-direct-steps). Direct (--loss direct):
    end-to-end only. The run folder (--out) ends up a loadable student (`dofattn generate --model OUT`) with
    log.json; rerunning the same command resumes an interrupted run. Ends with validation perplexity of the
    teacher, the student and an untrained Performer of the same feature budget. By default (--recipe dofattn) every
    linear layer also attends exactly to its last 64 tokens (--window) and to the first 4 of the sequence (--sink),
    and the end-to-end phase trains on blocks of the evaluation length; on the CPU-sized default job that takes
    SmolLM2 from 8.2x to 1.17x the teacher's perplexity. --recipe long adds LoRA and an end-to-end phase 27 times
    longer: 1.04x after a tenth of it (3 seeds), about 2 hours on a 2-core CPU for all of it. --recipe paper is the
    published, pure linear recipe.
    """

    model: str = _opt("smollm2-135m", "built-in alias (smollm2-135m), hub id, model folder, or .gguf file")
    data: str = _opt("wiki-sample", DATA_HELP)
    dims: str = _opt("dof", "feature dims per layer: dof (estimated here), clip (dof capped at the head size), "
                            "attn-dof (∝ the DoF of the teacher's attention matrices, as for --keep-by attn-dof; "
                            "the same total as fix), linear-dof (the same, of the part of the attention beyond the "
                            "window and the sink: what the features produce), fix, fix:C, or a dof.json file")
    feature: str = _opt("prf", "feature map: prf, performer, hedgehog or dijiang")
    per_head: bool = _opt(False, "give every head its own feature count from the DoF allocation over all heads "
                                 "(same total budget); each layer computes its largest (prf, performer)")
    loss: str = _opt("softmax", "layerwise: softmax (KL of attention rows), l2 (kernel values), output (the "
                                "attention output's squared error) or softmax+output; or direct (end to end)")
    steps: int = _opt(150, "training steps per layer (layerwise) or in total (direct)")
    tokens: int | None = _opt(None, "alternative to --steps: training tokens per layer / in total")
    batch_size: int = _opt(4, "blocks per step")
    seq_len: int = _opt(256, "tokens per block")
    train_blocks: int = _opt(64, "training blocks drawn from the train split (steps sample from them)")
    lr: float = _opt(0.02, "Adam learning rate of feature directions/projections (layerwise)")
    lr_weights: float = _opt(0.2, "Adam learning rate of the PRF weights (layerwise)")
    recipe: str = _opt("dofattn", "dofattn: the paper's method plus the softmax window and sink that close most of "
                                  "the gap to the teacher (--window 64 --sink 4); long: dofattn with LoRA rank 8 "
                                  "and a long end-to-end phase (400 steps of 2 blocks of --eval-seq-len tokens from "
                                  "1200 blocks), the closest student measured, hours on a CPU and minutes on a GPU; "
                                  "paper: the paper's recipe as published (pure linear attention, --window 0)",
                       choices=("dofattn", "long", "paper"))
    window: int | None = _opt(None, "exact softmax attention over the last W tokens beside the linear part, in one "
                                    "normalisation (0: pure linear attention); generation keeps W keys plus the "
                                    "state. Default: set by --recipe (64 for dofattn and long, 0 for paper)")
    sink: int | None = _opt(None, "beside the window, keep the first S real tokens of each sequence exact for every "
                                  "query (an attention sink: late layers put much of each row there) and out of "
                                  "the linear part; generation keeps their S keys too. Needs --window >= 1; not "
                                  "with --decay (0: none). Default: set by --recipe (4 for dofattn and long beside "
                                  "a window without --decay, else 0)")
    decay: bool = _opt(False, "a learned decay per head in the linear part: each past token's weight shrinks by a "
                              "factor γ per step (beyond the window, if any; half-lives start at 180-1400 tokens); "
                              "still O(1) state in generation. Batches must be padded on the left")
    gate: bool = _opt(False, "make the decay depend on each token (implies --decay; needs --window 0): a learned "
                             "projection of the token's value vector sets how much of the state it keeps, from all "
                             "to nothing, as in gated linear attention. Starts equal to --decay. Runs on the "
                             "PyTorch chunk op, on CUDA too")
    conv: int = _opt(0, "pass each linear layer's q, k and v through a short causal convolution over the last K "
                        "tokens (one learned filter per channel, started as the identity, trained in the "
                        "end-to-end phase), as in Mamba or gated DeltaNet: a token's key and value can carry its "
                        "neighbours'. Generation keeps K-1 more q, k and v per layer. 0: none; e.g. 4")
    conv_lr: float | None = _opt(None, "Adam learning rate of the --conv filters in the end-to-end phase (default: "
                                       "--direct-lr, at which they stay near the identity); the cooldown scales it "
                                       "too")
    delta: bool = _opt(False, "write each linear layer's state by the delta rule (needs --window 0): before a token "
                              "adds its key and value, it erases part of what the state holds along its key, so a "
                              "new key can replace an old, similar one instead of piling onto it, as in DeltaNet. "
                              "The erase strength is read off the token's value, starts near 0 and trains in the "
                              "end-to-end phase. Combines with --decay or --gate (as in gated DeltaNet); "
                              "--continue-from may add it to a trained student. Runs on PyTorch ops, on CUDA too")
    delta_lr: float | None = _opt(None, "Adam learning rate of the --delta rule's parameters in the end-to-end phase "
                                        "(default: --direct-lr, at which they barely leave their start); the "
                                        "cooldown scales it too")
    keep_softmax: int = _opt(0, "keep K layers as exact softmax attention (chosen by --keep-by); the rest are "
                                "linearized")
    keep_by: str = _opt("attn-dof", "which layers --keep-softmax keeps: attn-dof (the K whose attention matrices "
                                    "have the largest DoF: sharp, position-bound attention counts high, a sink low; "
                                    "measured on 8 training blocks of up to 512 tokens), dof (the K with the largest "
                                    "DoF of the softmax kernel), first (layers 0..K-1), random (K drawn with --seed) "
                                    "or gain (measured after layerwise training: the K whose exact attention, given "
                                    "back alone, lowers the student's KL to the teacher most on training text)",
                        choices=("attn-dof", "dof", "first", "random", "gain"))
    progressive: bool = _opt(False, "layerwise training in layer order on the student's own q/k/v (earlier layers "
                                    "already linear) instead of the teacher's: each layer sees what it will get")
    lora_rank: int | None = _opt(None, "LoRA adapters of this rank on the attention projections (q, k, v, o), "
                                       "trained in the end-to-end phase with the features and saved with the "
                                       "student (needs peft; 0: none). Default: set by --recipe (8 for long, "
                                       "else 0)")
    lora_targets: str = _opt("attention", "what --lora-rank adapts: attention (q, k, v, o) or all (the MLP "
                                          "projections too: more capacity to make up for what the linear "
                                          "attention misses; 2.65 times the adapter weights on SmolLM2)",
                             choices=("attention", "all"))
    then_direct_steps: int | None = _opt(None, "after layerwise training, this many end-to-end steps; the same "
                                               "command with a larger value goes on from a finished run. Default: "
                                               "set by --recipe (400 for long, else 30)")
    direct_batch_size: int | None = _opt(None, "blocks per end-to-end step. Default: set by --recipe (1 for "
                                               "dofattn, 2 for long and paper)")
    direct_seq_len: int | None = _opt(None, "tokens per end-to-end block; training at the evaluation length lets the "
                                            "linear part learn the distances it is scored on. Default: set by "
                                            "--recipe (--eval-seq-len for dofattn and long, --seq-len for paper)")
    direct_blocks: int | None = _opt(None, "training blocks of the end-to-end phase; the layerwise stage keeps the "
                                           "teacher's q/k/v for --train-blocks only, so a long end-to-end phase "
                                           "can read far more text than it. Default: set by --recipe (1200 for "
                                           "long, else --train-blocks)")
    direct_lr: float = _opt(2e-3, "Adam learning rate of the end-to-end phase")
    cooldown_steps: int = _opt(0, "lower the end-to-end learning rate linearly towards 0 over the phase's last N "
                                  "steps (0: constant). A run given more --then-direct-steps after its cooldown "
                                  "began differs from one made with that many at once")
    kd_weight: float = _opt(1.0, "weight of KL(teacher || student) on the logits in the end-to-end phase")
    lm_weight: float = _opt(1.0, "weight of the student's next-token cross-entropy on the training text in the "
                                 "end-to-end phase. 0: learn from the teacher's logits alone, which keeps a long "
                                 "phase from fitting the training text itself")
    hidden_weight: float = _opt(0.0, "weight of the residual stream's error in the end-to-end phase: after every "
                                     "layer, the student's squared distance to the teacher's stream, relative to "
                                     "its size, averaged over tokens and layers (a signal for every layer, not "
                                     "only through the logits). 0: none")
    checkpoint_every: int = _opt(10, "end-to-end steps between checkpoints")
    eval_data: str | None = _opt(None, "the text scored (its validation split) when it is not --data's: e.g. "
                                       "--data wiki-sample+teacher.jsonl (pooled with `dofattn sample`'s text) "
                                       "--eval-data wiki-sample. Default: --data")
    continue_from: str | None = _opt(None, "start from a copy of this run folder's student (its layerwise "
                                           "stage and its end-to-end checkpoint, optimizer included) and go on "
                                           "with the end-to-end phase in --out, e.g. on more text: only --data, "
                                           "--direct-blocks, --then-direct-steps (at least the steps the run "
                                           "made), --cooldown-steps, --hidden-weight, --eval-every, "
                                           "--checkpoint-every and "
                                           "--time-limit may differ from the run's, and the validation text "
                                           "must be the same")
    eval_every: int = _opt(0, "measure validation perplexity every N end-to-end steps (log.json: direct.curve, "
                              "perplexity against training tokens); 0: only at the end")
    time_limit: float = _opt(0.0, "stop the end-to-end phase after this many minutes of it, then save and evaluate "
                                  "the student as it is (log.json: direct.stopped); the same command later goes "
                                  "on to the remaining steps. 0: no limit")
    lam: float = _opt(2.0 ** -8, "λ of the DoF estimate (trace-relative) when --dims is dof, clip or attn-dof, or "
                                 "--keep-by dof or attn-dof")
    lam_auto: bool = _opt(False, "choose the DoF estimate's λ instead (like `dofattn dof --lam-auto`): the one "
                                 "whose dims give the least held-out attention error at the budget; printed and "
                                 "kept in the run's dof.json")
    dof_repeats: int = _opt(1, "pool the DoF estimate over this many disjoint sets of 1024 points per head "
                               "(like `dofattn dof --repeats`)")
    eval_blocks: int = _opt(8, "validation blocks for the final perplexities")
    eval_seq_len: int = _opt(512, "tokens per validation block")
    seed: int = _opt(0, "seed for initialisation, data order and the DoF sample")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "the frozen model's dtype: float32 or bfloat16. bfloat16 runs the end-to-end "
                                 "phase about 2x faster on a CPU with AVX512-BF16 or AMX; the "
                                 "trained tensors (features, LoRA) stay float32 and the attention sums in float32")
    out: str = _opt("runs/distill", "run folder: created, or resumed when it holds a run with the same arguments")


def run_distill(args: DistillArgs) -> int:
    """The `distill` verb."""
    from dofattn.distill import run

    args.device = _resolve_device(args.device)
    log = run(args)
    ev = log.get("evaluation")
    if ev:
        print(format_evaluation(args, log))
        print(f"student saved in {args.out} (dofattn generate --model {args.out})")
    return 0


def format_evaluation(args: DistillArgs, log: dict) -> str:
    """The perplexity table `dofattn distill` ends with."""
    ev = log["evaluation"]
    trained = f"student ({args.feature}, {args.loss}"
    if args.loss != "direct" and args.then_direct_steps:
        trained += f" + {args.then_direct_steps} direct"
    rows = [("teacher", ev["teacher_ppl"], None)]
    if "layerwise_student_ppl" in ev:
        rows.append(("student after layerwise only", ev["layerwise_student_ppl"], ev["layerwise_vs_teacher"]))
    rows.append((trained + ")", ev["student_ppl"], ev["student_vs_teacher"]))
    rows.append((f"untrained performer ({ev['performer_dim']})", ev["performer_ppl"], ev["performer_vs_teacher"]))
    lines = [f"\nvalidation perplexity ({ev['tokens']} tokens, blocks of {ev['seq_len']}):"]
    for label, ppl, ratio in rows:
        lines.append(f"  {label:<40}{ppl:10.2f}" + (f"  ({ratio:.2f}x teacher)" if ratio else ""))
    lines.append(f"  dims per layer ({args.dims}): {' '.join(map(str, log['dims']))}")
    lines.append("  wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in log["seconds"].items()))
    return "\n".join(lines)


@dataclass
class EvalArgs:
    """Evaluate a linearized student against its teacher on held-out text.

    Reports perplexity of both, the mean per-token KL(teacher || student), top-1 agreement of their next-token
    predictions, and per layer (on the teacher's own queries, keys and values) the relative error of the linear
    attention output against softmax attention and the L2 kernel error of PRF features. Also by context length:
    the predictions that see 1, 2-3, 4-7, ... tokens, each bucket's perplexities and KL, which tell a student that
    falls behind at long range (a gap growing with the context) from one that is off everywhere. Writes
    everything to --out and, with --plot / --plot-positions, figures of the per-layer errors and of the buckets.
    Without --teacher the teacher is the student's own base model.
    """

    model: str = _opt("runs/distill", "student folder (from dofattn distill), or any supported model")
    teacher: str | None = _opt(None, "another model to compare against (same tokenizer); default: the base model")
    data: str = _opt("wiki-sample", DATA_HELP)
    split: str | None = _opt(None, "train, validation or all (default: validation where --data has wiki-sample "
                                   "or hf: in it, all for files alone)")
    seq_len: int = _opt(512, "tokens per block")
    num_blocks: int = _opt(8, "blocks to evaluate")
    layer_blocks: int = _opt(2, "blocks used for the per-layer errors")
    batch_size: int = _opt(2, "blocks per forward pass")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "model dtype: float32 or bfloat16")
    tasks: str | None = _opt(None, "also run zero-shot lm-eval tasks, comma-separated (piqa,arc_easy,arc_challenge,"
                                   "winogrande,logiqa,wsc273,mmlu need the hub; local ones via --task-path)")
    task_path: str | None = _opt(None, "folder of local lm-eval task YAMLs")
    limit: int | None = _opt(None, "evaluate at most this many examples per lm-eval task")
    out: str = _opt("eval.json", "where to write the JSON result")
    plot: str | None = _opt(None, "also write a figure of the per-layer errors (.png, .pdf or .svg)")
    plot_positions: str | None = _opt(None, "also write a figure of perplexity and KL by context length (.png, .pdf "
                                            "or .svg)")


def run_eval(args: EvalArgs) -> int:
    """The `eval` verb."""
    import json

    from dofattn.data import WIKI_SAMPLE, check_source, sources, token_blocks
    from dofattn.evaluate import compare, layer_errors
    from dofattn.hf import load_model, parse_dtype
    from dofattn.student import is_student, load_student

    out = _check_output(args.out, "--out", (".json",))
    plot = _check_output(args.plot, "--plot", (".png", ".pdf", ".svg")) if args.plot else None
    plot_positions = (_check_output(args.plot_positions, "--plot-positions", (".png", ".pdf", ".svg"))
                      if args.plot_positions else None)
    check_source(args.data)
    if args.task_path and not Path(args.task_path).is_dir():
        raise UserError(f"--task-path {args.task_path} is not a folder of lm-eval task YAMLs")
    if args.num_blocks < 1 or args.layer_blocks < 0 or args.batch_size < 1:
        raise UserError("--num-blocks and --batch-size must be >= 1, --layer-blocks >= 0")
    held_out = any(part == WIKI_SAMPLE or part.startswith("hf:") for part in sources(args.data))
    split = args.split or ("validation" if held_out else "all")
    device, dtype = _resolve_device(args.device), parse_dtype(args.dtype)
    if is_student(args.model):
        model, tokenizer, _ = load_student(args.model, dtype=dtype, device=device)
    else:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    teacher = load_model(args.teacher, dtype=dtype, device=device)[0] if args.teacher else None
    blocks = token_blocks(args.data, tokenizer, args.seq_len, args.num_blocks, split=split, seed=0)
    result = {"model": args.model, "teacher": args.teacher or "base model", "data": args.data, "split": split,
              "seq_len": args.seq_len, **compare(model, blocks, teacher, args.batch_size)}
    errors = layer_errors(model, blocks[:args.layer_blocks]) if args.layer_blocks else {}
    result.update(errors)
    print(f"{'':>22}{'student':>12}{'teacher':>12}")
    ratio = result["ppl"] / result["teacher_ppl"]
    print(f"{'perplexity':>22}{result['ppl']:12.2f}{result['teacher_ppl']:12.2f}   ({ratio:.2f}x)")
    print(f"{'KL(teacher||student)':>22}{result['kl']:12.4f}")
    print(f"{'top-1 agreement':>22}{result['top1_agreement']:12.3f}")
    print(format_positions(result["by_position"]))
    if errors:
        print(f"\n{'layer':>5}  {'output error':>12}  {'kernel error':>12}")
        for i, (o, k) in enumerate(zip(errors["output_error"], errors["kernel_error"])):
            print(f"{i:>5}  {'softmax' if o is None else f'{o:.4f}':>12}  {'-' if k is None else f'{k:.3g}':>12}")
    if args.tasks:
        from dofattn.evaluate import lm_eval_tasks

        result["tasks"] = lm_eval_tasks(model, tokenizer, [t.strip() for t in args.tasks.split(",") if t.strip()],
                                        args.task_path, args.limit, args.batch_size)
        print()
        for task, metrics in result["tasks"].items():
            print(f"{task:>22}  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    _write_atomic(out, json.dumps(result, indent=2))
    print(f"wrote {out}")
    if plot and errors:
        from dofattn.plots import plot_layer_errors

        plot_layer_errors(errors, plot, title=f"{args.model} vs {result['teacher']}")
        print(f"wrote {plot}")
    if plot_positions:
        from dofattn.plots import plot_by_position

        plot_by_position({args.model: result["by_position"]}, plot_positions,
                         title=f"{args.data} ({split}), blocks of {args.seq_len} tokens")
        print(f"wrote {plot_positions}")
    return 0


def format_positions(rows: dict) -> str:
    """The `by_position` buckets as a table: context length, predictions, both perplexities, their ratio, KL."""
    lines = [f"\n{'context':>11}{'tokens':>8}{'student':>10}{'teacher':>10}{'ratio':>8}{'KL':>8}"]
    for a, b, n, s, t, r, kl in zip(*(rows[k] for k in ("context_from", "context_to", "tokens", "ppl",
                                                          "teacher_ppl", "ratio", "kl"))):
        span = f"{a}" if a == b else f"{a}-{b}"
        lines.append(f"{span:>11}{n:>8}{s:10.2f}{t:10.2f}{r:8.3f}{kl:8.3f}")
    return "\n".join(lines)


def _add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        shown = f"{f.default:g}" if isinstance(f.default, float) else f.default
        suffix = f" (default: {shown})" if f.default is not None else ""
        parser.add_argument(flag, type=kind, default=f.default, help=help_text + suffix, **meta)


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} was asked for but no CUDA device is available; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto")
    return name


def _check_output(path: str, what: str, suffixes: tuple[str, ...]) -> Path:
    out = Path(path)
    if out.suffix.lower() not in suffixes:
        raise UserError(f"{what} {path} should end in {' or '.join(suffixes)}")
    if out.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file name")
    if not out.parent.is_dir():
        raise UserError(f"{what} folder {out.parent} does not exist; create it first")
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_dof(args: DofArgs) -> int:
    """The `dof` verb: capture, spectra, allocation, table, JSON, plot."""
    from dofattn.data import SPLITS, check_source, token_blocks
    from dofattn.dof import (HELDOUT_POINTS, allocate_dims, allocate_dims_auto, attention_dofs, check_sample_size,
                             sample_points)
    from dofattn.hf import load_model, parse_dtype

    # everything that can be checked without the model is checked before it loads
    out = _check_output(args.out, "--out", (".json",))
    plot = _check_output(args.plot, "--plot", (".png", ".pdf", ".svg")) if args.plot else None
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
    device, dtype = _resolve_device(args.device), parse_dtype(args.dtype)

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
        print("largest attention DoF (what --keep-softmax K keeps): layers "
              f"{', '.join(str(layer.layer) for layer in order[:5])}")
    print(f"total dim {sum(result.dims)} = {len(result.dims)} layers x mean {sum(result.dims) / len(result.dims):g}"
          f"{' (clipped)' if args.clip else ''}; {elapsed:.1f} s")
    for warning in result.warnings():
        print(f"WARNING: {warning}", file=sys.stderr)
    _write_atomic(out, result.to_json())
    print(f"wrote {out}")
    if plot:
        from dofattn.plots import plot_dof

        plot_dof(result, plot)
        print(f"wrote {plot}")
    return 0


def format_lam_search(result) -> str:
    rows = [f"{'λ':>10}  {'held-out attention error':>24}  {'DoF max/min':>11}  {'dims':>9}"]
    for row in result.lam_search:
        lam = "uniform" if row["lam"] is None else f"2^{math.log2(row['lam']):.0f}"
        mark = " <- chosen" if row["lam"] == result.lam else ""
        rows.append(f"{lam:>10}  {row['attention_error']:>24.4g}  {row['dof_spread']:>11.2f}  "
                    f"{min(row['dims']):>4}-{max(row['dims']):<4}{mark}")
    return "\n".join(rows)


def format_table(result) -> str:
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


@dataclass
class BenchArgs:
    """Time the student's attention and generation against softmax attention (SDPA) on this machine.

    Prefill: one layer's causal attention over T tokens (SDPA vs PRF features + linear attention, the linear op
    alone, and the sliding-window hybrid). Decode: one token against a context of T (SDPA over a KV cache vs one
    step on the constant-size state). Generation: --model and its linearized student (untrained features; speed
    does not depend on training) prefill a prompt and generate greedily. Medians of --repeats runs; a JSON with the
    hardware goes to --out.
    """

    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("auto", "float32 or bfloat16; auto: bfloat16 on CUDA, float32 on CPU")
    seq_lens: str = _opt("auto", "comma-separated T for prefill and decode; auto: 512,2048 on CPU, "
                                 "2048,8192,32768,131072 on CUDA")
    heads: int = _opt(9, "attention heads of the op benchmarks")
    head_dim: int = _opt(64, "head size of the op benchmarks")
    features: int = _opt(64, "feature dimension M of the student")
    window: int = _opt(64, "window of the hybrid rows (0: skip them)")
    sink: int = _opt(4, "sink tokens of the second hybrid row, beside the window (0: skip it)")
    decode_batch: int = _opt(1, "batch size of the decode benchmark")
    repeats: int = _opt(5, "timed runs per measurement (the median is reported)")
    model: str = _opt("smollm2-135m", "model for the generation benchmark; 'none' skips it")
    gen_contexts: str = _opt("auto", "comma-separated prompt lengths for generation; auto: 512 on CPU, 2048,8192,32768 "
                                     "on CUDA")
    new_tokens: int = _opt(16, "tokens generated after each prompt")
    parts: str = _opt("prefill,decode,generation", "which measurements to run (comma-separated)")
    out: str = _opt("bench.json", "where to write the JSON result (rewritten after each part)")


def run_bench(args: BenchArgs) -> int:
    """The `bench` verb."""
    from dofattn.bench import BenchConfig, bench, format_tables, parse_ints

    out = _check_output(args.out, "--out", (".json",))
    device = _resolve_device(args.device)
    cuda = device.startswith("cuda")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    seq_lens = parse_ints(args.seq_lens if args.seq_lens != "auto" else
                          ("2048,8192,32768,131072" if cuda else "512,2048"), "--seq-lens")
    contexts = parse_ints(args.gen_contexts if args.gen_contexts != "auto" else
                          ("2048,8192,32768" if cuda else "512"), "--gen-contexts")
    cfg = BenchConfig(device=device, dtype=dtype, seq_lens=seq_lens, heads=args.heads, head_dim=args.head_dim,
                      features=args.features, window=args.window, sink=args.sink, decode_batch=args.decode_batch,
                      repeats=args.repeats, model=None if args.model == "none" else args.model,
                      gen_contexts=contexts, new_tokens=args.new_tokens,
                      parts=[p.strip() for p in args.parts.split(",") if p.strip()])
    result = bench(cfg, save=lambda partial: _write_atomic(out, json.dumps(partial, indent=2)))
    print(format_tables(result))
    _write_atomic(out, json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


@dataclass
class SampleArgs:
    """Write text sampled from the teacher, as a .jsonl training source for `dofattn distill --data`.

    Each sample is a prompt cut from the train split of --data (never its validation split), continued by the model
    for --new-tokens tokens at --temperature (1 samples the model's own distribution). Pool it with the real text
    and keep scoring on held-out real text:

        dofattn sample --samples 2000 --out teacher.jsonl
        dofattn distill --data wiki-sample+teacher.jsonl --eval-data wiki-sample ...

    Samples are appended one batch at a time; the same command goes on after an interruption.
    """

    model: str = _opt("smollm2-135m", "the teacher: alias, hub id, folder or .gguf file")
    data: str = _opt("wiki-sample", "where the prompts come from (its train split): " + DATA_HELP)
    samples: int = _opt(1000, "number of samples to write in all")
    prompt_tokens: int = _opt(32, "tokens of real text each sample starts from")
    new_tokens: int = _opt(480, "tokens the model adds to each prompt")
    temperature: float = _opt(1.0, "sampling temperature (> 0)")
    batch_size: int = _opt(32, "samples generated together")
    seed: int = _opt(0, "seed for the prompts and the sampling")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    dtype: str = _opt("float32", "model dtype: float32 or bfloat16 (sample with the teacher a bfloat16 distill "
                                 "run compares against)")
    out: str = _opt("teacher-text.jsonl", "the .jsonl file to write or go on with")


def run_sample(args: SampleArgs) -> int:
    """The `sample` verb."""
    from dofattn.data import check_source
    from dofattn.hf import load_model, parse_dtype
    from dofattn.sample import SampleSpec, check, done_samples, sample_text

    out = Path(args.out).expanduser()
    if out.suffix != ".jsonl":
        raise UserError(f"--out {args.out} must end in .jsonl")
    check_source(args.data)
    spec = SampleSpec(model=args.model, data=args.data, prompt_tokens=args.prompt_tokens,
                      new_tokens=args.new_tokens, temperature=args.temperature, batch_size=args.batch_size,
                      seed=args.seed)
    check(spec, args.samples)
    done_samples(out, spec)                        # refuse a foreign file before loading the model
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=_resolve_device(args.device))
    start = time.perf_counter()
    result = sample_text(model, tokenizer, spec, args.samples, out)
    elapsed = time.perf_counter() - start
    tokens = result["new"] * args.new_tokens
    rate = f", {tokens / elapsed:.0f} new tokens/s" if result["new"] else ""
    print(f"{out}: {result['samples']} samples of {args.prompt_tokens}+{args.new_tokens} tokens "
          f"({result['new']} new in {elapsed:.0f} s{rate})")
    return 0


VERBS = {"dof": (DofArgs, run_dof), "distill": (DistillArgs, run_distill), "eval": (EvalArgs, run_eval),
         "generate": (GenerateArgs, run_generate), "bench": (BenchArgs, run_bench),
         "sample": (SampleArgs, run_sample)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dofattn",
        description="Turn a pretrained softmax-attention LM into a linear-attention one, with feature "
                    "dimensions allocated by the degrees of freedom of each layer's attention kernel.")
    parser.add_argument("--version", action="version", version=f"dofattn {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (cls, _) in VERBS.items():
        doc = (cls.__doc__ or "").strip()
        sub = verbs.add_parser(name, help=doc.splitlines()[0], description=doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_arguments(sub, cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.verb is None:
        parser.print_help()
        return 2
    cls, run = VERBS[ns.verb]
    args = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
    try:
        return run(args)
    except UserError as err:
        print(f"dofattn: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dofattn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
