"""The dry run's memory plan against one measured end-to-end step of the same student, on CPU or CUDA.

    python benchmarks/plan_memory.py --model tests/configs/qwen2.5-1.5b --device cuda --dtype bfloat16 \
        --set end_to_end.seq_len=2048 --out plan_memory.json
    python benchmarks/plan_memory.py --model tests/configs/qwen2.5-1.5b --layers 4 --set end_to_end.seq_len=256

The model is built from its config.json with random weights (no download; `--layers N` keeps its first N layers),
made the student a run of the recipe trains (`Recipe.student_spec`: DoF dims at the budget's mean, the softmax layers
the plan assumes), and takes one step as `dofattn distill` does: the loss (teacher and student, in chunks,
checkpointed layers if the recipe says so), its backward pass and Adam's step, in one process. Measured: on CUDA the
rise of `torch.cuda.max_memory_allocated` over what the model holds; on CPU the most bytes of tensors alive at once
(`memory.LiveBytes`, which the plan runs over fake tensors). Printed beside the plan's total less the weights and
student tensors (`dofattn.distill.plan`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM

    from dofattn import recipe as recipes
    from dofattn.distill.end_to_end import layers_checkpointed, loss
    from dofattn.distill.plan import make_plan
    from dofattn.model.hf import model_config, softmax_implementation
    from dofattn.memory import LiveBytes
    from dofattn.model.student import attention_modules, build, is_student_tensor

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a folder with config.json (or anything run.model takes)")
    parser.add_argument("--recipe", default="default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    recipe = recipes.load(args.recipe, args.set, {"run.model": args.model, "run.dtype": args.dtype})
    config = model_config(args.model)
    if args.layers:
        config.num_hidden_layers = args.layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:args.layers]
    plan = make_plan(recipe, 1, config=config)
    memory, e2e = plan.memory, recipe.end_to_end
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=softmax_implementation(config))
    model = model.to(args.device).eval()
    dims = plan.layers.dims or [round(plan.layers.mean_dim)] * plan.layers.count
    build(model, recipe.student_spec(dims, plan.layers.linear))
    for name, p in model.named_parameters():
        p.requires_grad_(is_student_tensor(name))
    for module in attention_modules(model):
        if hasattr(module, "dofattn"):
            module.dofattn.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trained, lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (e2e.batch_size, e2e.seq_len), device=args.device)
    cuda = args.device.startswith("cuda")
    live = contextlib.nullcontext() if cuda else LiveBytes([*model.parameters(), *model.buffers(), ids])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with layers_checkpointed(model) if e2e.activation_checkpointing else contextlib.nullcontext(), live:
        loss(model, ids, e2e.kd_weight, e2e.loss_chunk).backward()
        optimizer.step()
    if cuda:
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
    else:
        measured = live.peak
    planned = memory.total - memory.weights - memory.student
    row = {"model": args.model, "layers": plan.layers.count, "device": args.device, "dtype": args.dtype,
           "recipe": recipe.name, "sets": args.set, "batch_size": e2e.batch_size, "seq_len": e2e.seq_len,
           "loss_chunk": e2e.loss_chunk, "activation_checkpointing": e2e.activation_checkpointing,
           "planned_mib": round(planned / 2**20, 1), "measured_mib": round(measured / 2**20, 1),
           "ratio": round(planned / measured, 3), "plan": {k: round(v / 2**20, 1) for k, v in
                                                          (("activations", memory.activations),
                                                           ("recompute", memory.recompute), ("loss", memory.loss),
                                                           ("gradients", memory.gradients), ("adam", memory.adam))},
           "step_seconds": round(time.perf_counter() - start, 2)}
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
