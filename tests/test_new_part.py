"""A new stateful part is its module, a key of `spec.Attention` and a row of `layer.PARTS`, and nothing else.

The test adds one to a copy of the package, as a contributor would: `attention/echo.py` (each value gets `echo` times
the value before it, the last one carried in the cache), the key `echo` beside the other attention keys, the class
in `PARTS`. A fresh process then builds a tiny Llama student with it and checks every path: the part's own effect
(the student against the same student without it), generation with a cache against the full forward, save and load,
and an export loaded with transformers alone. Left out of either place, the same process fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dofattn"

ECHO = '''"""A throwaway part: each value gets `echo` times the one before it (the last carried in the cache)."""

from __future__ import annotations

import torch
from torch import nn

from dofattn.attention.cache import PartState, keep_buffer
from dofattn.attention.part import KERNELS, Part
from dofattn.ops.softmax import expand_kv


class EchoState(PartState):
    NAMES = ("last",)


class Echo(Part):
    name, State, layerwise = "echo", EchoState, False
    kernels = KERNELS

    @classmethod
    def build(cls, attention, num_heads, num_kv_heads, head_dim):
        return cls(attention.echo, num_kv_heads) if attention.echo else None

    def __init__(self, echo: float, heads: int):
        super().__init__()
        self.mix = nn.Parameter(torch.full((heads,), float(echo)))

    def inputs(self, q, k, v, key_valid, cache=None):
        if v is None:
            return q, k, v
        state = None if cache is None else cache.part(self.name)
        before = v.new_zeros(v[:, :1].shape) if state is None or state.last is None else state.last
        if state is not None:
            keep_buffer(state, "last", v[:, -1:])
        mix = expand_kv(self.mix.to(v.dtype)[None, :, None], v.shape[2], dim=1)
        return q, k, v + mix[:, None] * torch.cat([before, v[:, :-1]], 1)
'''

KEY = ('''    conv: int = option(0,''', '''    echo: float = option(0.0, "each value gets this much of the one before it (0: none)")
    conv: int = option(0,''')
ROW = ('''PARTS: tuple[type[Part], ...] = (Window, Sink, Decay, ShortConv)''',
       '''from dofattn.attention.echo import Echo

PARTS: tuple[type[Part], ...] = (Window, Sink, Decay, ShortConv, Echo)''')

# What the fresh process does, with the copy first on its path: every path a student takes, with the part.
CHECK = r'''
import sys
from pathlib import Path

import torch
import transformers as tf

import dofattn
from dofattn.jobs.export import export
from dofattn.spec import Attention, StudentSpec
from dofattn.model.student import attention_modules, build, fingerprint, load_student, save_student

assert Path(dofattn.__file__).parent == Path(sys.argv[1]), dofattn.__file__
tmp, base = Path(sys.argv[2]), sys.argv[3]                          # the tiny Llama of `model_dirs`
ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(1))


def student(**keys):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_pretrained(base).eval()
    layers = list(range(model.config.num_hidden_layers))
    spec = StudentSpec(base_model=base, dims=[6] * len(layers), layers=layers, seed=3, base=fingerprint(model),
                       attention=Attention(window=4, sink=1, **keys))
    build(model, spec)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model(ids, use_cache=False)                                   # calibrates the key shifts
    return model.eval(), spec


model, spec = student(echo=0.5)
plain, _ = student()
with torch.no_grad():
    logits = model(ids, use_cache=False).logits
    assert (logits - plain(ids, use_cache=False).logits).abs().max() > 1e-3, "the part does not show"
    assert all(m.dofattn.echo.mix.eq(0.5).all() for m in attention_modules(model))
    out = model.generate(ids[:1, :9], max_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    full = model(out.sequences, use_cache=False).logits[:, 8:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=1e-4)
    assert all("echo" in layer.parts for layer in out.past_key_values.layers), "the cache keeps no echo state"
save_student(model, tmp / "student", spec)
loaded, _, read = load_student(tmp / "student")
assert read.attention.echo == 0.5, read.attention
with torch.no_grad():
    torch.testing.assert_close(loaded(ids, use_cache=False).logits, logits, rtol=0, atol=0)
export(tmp / "student", tmp / "export")
reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp / "export", trust_remote_code=True).eval()
assert sum(type(m).__name__ == "Echo" for m in reloaded.modules()) == len(spec.layers), "the export lost the part"
with torch.no_grad():
    torch.testing.assert_close(reloaded(ids, use_cache=False).logits, logits, rtol=1e-5, atol=1e-5)
print("every path runs the part")
'''


def run_with(tmp: Path, base: Path, edits: tuple[str, ...]) -> subprocess.CompletedProcess:
    """The package copied under `tmp` with the new module and the `edits` ("key", "row"), and CHECK run on it."""
    root = tmp / "checkout"
    copy = root / "dofattn"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "attention" / "echo.py").write_text(ECHO)
    for name, (file, (old, new)) in {"key": ("spec.py", KEY), "row": ("attention/layer.py", ROW)}.items():
        if name in edits:
            text = (copy / file).read_text()
            assert text.count(old) == 1, f"{file} no longer has {old!r}: update this test's edit"
            (copy / file).write_text(text.replace(old, new))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp / "hf-modules"), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CHECK, str(copy), str(tmp), str(base)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp)


def test_a_new_part_is_its_module_a_key_and_a_row(tmp_path, model_dirs):
    done = run_with(tmp_path, model_dirs["llama"], ("key", "row"))
    assert done.returncode == 0 and "every path runs the part" in done.stdout, done.stderr[-3000:]
    changed = sorted(p.relative_to(tmp_path / "checkout").as_posix() for p in (tmp_path / "checkout").rglob("*.py")
                     if not (PACKAGE.parent / p.relative_to(tmp_path / "checkout")).is_file()
                     or (PACKAGE.parent / p.relative_to(tmp_path / "checkout")).read_text() != p.read_text())
    assert changed == ["dofattn/attention/echo.py", "dofattn/attention/layer.py", "dofattn/spec.py"]


@pytest.mark.parametrize("left_out,message", [("key", "echo"), ("row", "the part does not show")])
def test_a_new_part_left_out_of_either_place_fails(tmp_path, model_dirs, left_out, message):
    done = run_with(tmp_path, model_dirs["llama"], tuple(e for e in ("key", "row") if e != left_out))
    assert done.returncode != 0 and message in done.stderr, done.stderr[-3000:]
