"""The end-to-end phase over two processes equals one process on the combined batch.

Each end-to-end step draws `batch_size × processes` blocks from (seed, step); rank r trains on every other one from
the r-th, and the gradients are averaged. So one plain SGD step of two gloo processes must move every student tensor
exactly as one process does on all the step's blocks (up to float rounding): a missing all-reduce leaves each rank
with half the batch's gradient, a sum without the division doubles the step. Adam would hide both (its step does
not scale with the gradient), hence SGD here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

SCRIPT = r'''
import sys
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from dofattn.distill.end_to_end import train
from dofattn.distill.world import join, world
from dofattn.hf import load_model
from dofattn.recipe import EndToEnd
from dofattn.student import is_student_tensor, linearize

model_dir, out, batch_size = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
join("cpu")
torch.manual_seed(0)
model, _ = load_model(model_dir)
linearize(model, [8, 8, 8], "hedgehog", seed=0, window=4, sink=1)
for name, p in model.named_parameters():
    p.requires_grad_(is_student_tensor(name))
blocks = torch.randint(0, 300, (6, 24), generator=torch.Generator().manual_seed(1))
if world()[0] == 0:
    save_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters() if is_student_tensor(n)},
              str(out / "start.safetensors"))
config = EndToEnd(steps=2, batch_size=batch_size, seq_len=24, lr=0.5, checkpoint_every=10)
train(model, blocks, out, config, seed=0, eval_blocks=blocks[:1], progress=False,
      optimizer_class=partial(torch.optim.SGD, lr=0.5))
if world()[0] == 0:
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if is_student_tensor(n)},
              str(out / "trained.safetensors"))
'''


def test_two_processes_take_the_step_one_process_takes_on_the_combined_batch(model_dirs, tmp_path):
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    one, two = tmp_path / "one", tmp_path / "two"
    runs = [(one, [sys.executable, str(script), str(model_dirs["llama"]), str(one), "4"]),
            (two, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(script), str(model_dirs["llama"]), str(two), "2"])]
    for folder, cmd in runs:
        folder.mkdir()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (load_file(str(f / "trained.safetensors")) for f in (one, two))
    start = load_file(str(one / "start.safetensors"))
    assert sorted(a) == sorted(b) == sorted(start) and a
    for name in a:
        step = (a[name] - start[name]).abs().max().item()
        differ = (b[name] - a[name]).abs().max().item()
        assert step > 0 and differ <= 1e-3 * step + 1e-7, (name, step, differ)   # float rounding, not a share
    losses = [json.loads((f / "end_to_end" / "state.json").read_text())["losses"] for f in (one, two)]
    assert len(losses[0]) == len(losses[1]) == 2
