"""Shared fixtures: tiny random models of the three supported families, saved with a real (tiny) tokenizer.

Real-model tests that take minutes are marked `slow` and deselected by default (`pytest -m slow` runs them).
Without CUDA, where Triton imports, the Triton kernels run in its interpreter with a GPU's dot rounding
(tests/gpu_dots.py: its docstring says how to pick the rounding or turn it off).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton (if installed) runs its kernels in the interpreter on CPU; the flag must be set before anything imports
    # triton (transformers does), see tests/triton_helpers.py.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two test processes share the cores (pyproject's `-n 2`, pytest-xdist): one torch thread each, so neither waits on
# the other's spinning threads (`-n 0` runs one process with torch's own threads).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# What a plan counts is kept in a folder of this test process's (`dofattn.kept`): nothing read from, or left in, the
# user's cache, and a shape two of its tests plan is counted once. Timings are never kept here (`plan_timings_not_kept`), so a
# plan's times are always measured by the test that asks.
import atexit
import shutil
import tempfile

_PLANS = tempfile.mkdtemp(prefix="dofattn-test-plans-")
atexit.register(shutil.rmtree, _PLANS, True)
os.environ["DOFATTN_PLAN_CACHE"] = _PLANS

# The interpreter's dots round as a GPU's (DOFATTN_DOTS=off or -p no:tests.gpu_dots: as the interpreter's own).
pytest_plugins = ["tests.gpu_dots"] if not torch.cuda.is_available() and importlib.util.find_spec("triton") else []

from transformers import (AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, PreTrainedTokenizerFast)

TEXT = ("The quick brown fox jumps over the lazy dog. Linear attention keeps a state of fixed size. "
        "Softmax attention compares every query with every key. ") * 20

# Llama uses grouped-query attention (4 query heads on 2 kv heads); NeoX rotates a quarter of each head.
CONFIGS = {
    "llama": lambda vocab: LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4,
                                       max_position_embeddings=256, tie_word_embeddings=True),
    "gpt2": lambda vocab: GPT2Config(vocab_size=vocab, n_embd=64, n_layer=3, n_head=4, n_positions=256,
                                     bos_token_id=0, eos_token_id=0),
    "gpt_neox": lambda vocab: GPTNeoXConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=3, num_attention_heads=4,
                                            max_position_embeddings=256,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.25}),
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def tiny_bos_tokenizer() -> PreTrainedTokenizerFast:
    """`tiny_tokenizer` that puts a BOS before every text of its own accord, as Gemma's and Llama 3's do."""
    from tokenizers import processors

    tok = tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    inner = tok.backend_tokenizer
    inner.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                         special_tokens=[("<bos>", tok.bos_token_id)])
    return tok


def pytest_runtest_logreport(report):
    """With DOFATTN_TEST_LOG=FILE, each test's outcome and time (and a failure's text) go to FILE as they happen, so a
    run stopped by a time limit (a GPU lease, say) still says which tests failed and why. Under xdist the controller
    writes them, once."""
    path = os.environ.get("DOFATTN_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.passed and report.when != "call"):
        return
    with open(path, "a") as log:
        log.write(f"{report.outcome.upper()} {report.nodeid} [{report.when}] {report.duration:.1f} s\n")
        if report.failed:
            log.write(report.longreprtext[-4000:] + "\n\n")


@pytest.fixture(autouse=True)
def plan_timings_not_kept(monkeypatch):
    """Timings are taken as made beside other work (not kept) in every test, whatever the load: what the session's
    plan folder keeps is counts alone (a test that keeps timings says so: test_costs' `keeping`)."""
    from dofattn.distill import costs

    monkeypatch.setattr(costs, "_idle", lambda device: False)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


def tiny_model(family: str, vocab: int = 300, seed: int = 0):
    """A tiny random model of `family`, of the class dofattn makes a model with (`hf.causal_lm_class`)."""
    from dofattn.model.hf import causal_lm_class

    torch.manual_seed(seed)
    config = CONFIGS[family](vocab)
    return causal_lm_class(config)._from_config(config).eval()


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def family(request):
    return request.param


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """family -> folder holding a tiny saved model and tokenizer (loadable with `dofattn --model DIR`)."""
    dirs = {}
    for family in CONFIGS:
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        tiny_model(family).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[family] = path
    return dirs


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A .txt file big enough for train blocks, validation blocks (its last 10%) and a DoF sample (32 x 256 tokens).
    Shared by every test that reads it: none may write to it."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join([TEXT] * 60))
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join([TEXT] * 5))
    return path
