"""Prototype, not a part of the package: a student (or its teacher) read with another RoPE on one block of the
validation articles; prints perplexity by context length, as `capped_positions.py` does.

    python experiments/rope_scaling.py runs/lc-log8k yarn 4            # YaRN, factor 4 over SmolLM2's 8 K (11 min)
    python experiments/rope_scaling.py runs/lc-log8k default 1 1024    # check: the plain student on a 1 K block
    python experiments/rope_scaling.py runs/lc-log8k yarn 4 32768 '{"attention_factor": 1}'   # no temperature
    python experiments/rope_scaling.py runs/lc-log8k yarn 4 32768 '{"attention_factor": 1}' kept   # kept layers only

The rotary embedding is rebuilt from the config with `rope_type` and `factor` (original length: the model's
`max_position_embeddings`); every layer, kept, linear and their sinks, reads the new angles. The student was
trained with the default RoPE."""
import json
import math
import sys
import time

import torch

from dofattn import evaluate
from dofattn.data import token_blocks
from dofattn.model.student import load_student

run, kind, factor = sys.argv[1], sys.argv[2], float(sys.argv[3])
T_BLOCK = int(sys.argv[4]) if len(sys.argv) > 4 else 32768
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}     # more rope parameters, e.g. '{"attention_factor": 1}'
which = sys.argv[6] if len(sys.argv) > 6 else "all"              # the layers that read the new RoPE: all, kept, linear
model, tok, _ = load_student(run)
model.eval()
config = model.config
if kind != "default":
    config.rope_parameters = {**config.rope_parameters, "rope_type": kind, "factor": factor,
                              "original_max_position_embeddings": config.max_position_embeddings, **extra}
    other = type(model.model.rotary_emb)(config)
    if which == "all":
        model.model.rotary_emb = other
    else:       # the other layers keep the default angles: their decoder layers get the new (cos, sin) in its place
        def swap(layer, args, kwargs):
            kwargs["position_embeddings"] = other(args[0] if args else kwargs["hidden_states"], kwargs["position_ids"])
            return args, kwargs
        for layer in model.model.layers:
            kept = getattr(layer.self_attn, "dofattn", None) is None
            if kept == (which == "kept"):
                layer.register_forward_pre_hook(swap, with_kwargs=True)
    print("attention scaling", other.attention_scaling, "in", which, "layers")
print(config.rope_parameters)
ids = token_blocks("wiki-sample", tok, T_BLOCK, 1, split="validation", seed=0)        # [1, T_BLOCK]
start = time.time()
with torch.no_grad():
    lp = torch.cat(evaluate._log_probs(model, ids))
nll = -lp.gather(1, ids[0, 1:, None])[:, 0]
edges = [e for e in [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768] if e <= T_BLOCK]
res = {f"{a}-{b - 1}": round(math.exp(nll[a - 1:b - 1].mean().item()), 2) for a, b in zip(edges, edges[1:])}
print(json.dumps({"rope": kind, "factor": factor, "layers": which, **extra, "seconds": round(time.time() - start),
                  "ppl_by_context": res}))
