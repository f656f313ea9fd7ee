"""dofattn's vLLM plugin (`dofattn.serve`): exports of tiny students served by vLLM on CPU give HF generate's greedy
tokens, and every prompt and generated token's log-probability as HF gives them: one prompt, a batch of mixed lengths
(one shorter than the sink, some longer than the window), prompts read in chunks of at most 32 tokens (chunked
prefill), requests preempted and recomputed; and vLLM's OpenAI-compatible server answers as HF generates. The
students (Llama): window + sink + decay linear layers with PRF features and one softmax layer kept on vLLM's paged
cache; every layer pure linear with a gate, a short convolution and Hedgehog features; the default recipe's form, its
kept layer bounded after the prompt; a student whose linear layers keep some key/value heads exact (bounded after
the prompt) and give each query head its own count of features; students of Qwen2, Qwen3 and Mistral; and one
exported to read past its base model's context with YaRN (`--extend-to`).

Runs where vllm imports and dofattn's `vllm.general_plugins` entry point is installed (the serving virtualenv); vLLM
runs in a subprocess with a 1 GiB KV cache. The OpenAI server runs as `vllm serve` does, its engine and worker spawned
as processes of their own (the plugin registered in each); the other cases keep the engine in the subprocess
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the same scheduler, cache and model code, started in about 5 s instead of 50 s.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (dofattn's plugin serves with vllm)")
if not any(e.value == "dofattn.serve:register" for e in entry_points(group="vllm.general_plugins")):
    pytest.skip("dofattn's vllm.general_plugins entry point (dofattn.serve:register) is not installed",
                allow_module_level=True)

from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config  # noqa: E402

from dofattn.model.exported import load_export                                      # noqa: E402
from dofattn.jobs.export import export                                        # noqa: E402
from dofattn.spec import Attention, Kept, StudentSpec                               # noqa: E402
from dofattn.model.student import build, fingerprint, save_student                  # noqa: E402
from tests.conftest import tiny_tokenizer                                     # noqa: E402

NEW_TOKENS = 10
MAX_LEN = 256
CHUNK = 32           # max_num_batched_tokens of the chunked case
PREEMPT_BLOCKS = 13  # the preempted case's cache: 4 requests need 12 blocks to start, 16 to finish


def prompts_of(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


SERVE = r"""
import json, sys

if __name__ == "__main__":
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    runs, out = json.loads(sys.argv[1]), sys.argv[2]
    params = SamplingParams(temperature=0.0, max_tokens=%d, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    results = {}
    for folder, engine, cases in runs:            # one engine at a time
        llm = vllm.LLM(folder, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
                       max_model_len=%d, disable_log_stats=False, **{"max_num_seqs": 8, **engine})
        for key, prompts in cases.items():
            got = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            results[key] = [{"tokens": list(g.outputs[0].token_ids),            # and each token's log-probability
                             "logprobs": [lp[t].logprob for lp, t in zip(g.prompt_logprobs[1:], p[1:])]
                             + [lp[t].logprob for lp, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)],
                             "preemptions": g.metrics.num_preemptions}
                            for g, p in zip(got, prompts)]
        del llm
    json.dump(results, open(out, "w"))
""" % (NEW_TOKENS, MAX_LEN)

# The students: (layers linearized, their attention, how the kept layer holds its keys). `hybrid` as the recipes
# (window, sink, a decay, PRF) with layer 1 kept as softmax attention on vLLM's paged cache; `conv` a pure linear
# student (gate, short convolution, Hedgehog features), every layer linear, whose state holds parts the plugin does
# not name; `bounded` as the default recipe: its kept layer holds the sink, the window and 4 selected keys per kv
# head after the prompt, as a fixed state (the plugin turns chunked prefill off for it: its chunked run reads each
# prompt in one step).
HYBRID = ([0, 2], Attention(feature="prf", window=8, sink=2, decay="head"), Kept())
BOUNDED = ([0, 2], Attention(feature="prf", window=8, sink=2), Kept(select=4))
STUDENTS = {"hybrid": ("llama", *HYBRID),
            "conv": ("llama", [0, 1, 2], Attention(feature="hedgehog", window=0, sink=0, decay="gate", conv=3), Kept()),
            "bounded": ("llama", *BOUNDED),
            # every layer linear, 2 kv heads of 4 query heads: layer 0 keeps kv head 1 exact, layer 2 kv head 0, both
            # bounded after the prompt (student.exact_heads)
            "heads": ("llama", [0, 1, 2], Attention(feature="prf", window=8, sink=2), Kept(select=4)),
            # the other families vLLM's plugin serves, one engine each: Qwen2's qkv biases and its layer types,
            # Qwen3's q/k norms (bounded), Mistral
            "qwen2": ("qwen2", *HYBRID), "qwen3": ("qwen3", *BOUNDED), "mistral": ("mistral", *HYBRID),
            # read past its base model's context (128 tokens) with YaRN, as `dofattn export --extend-to` makes it
            "yarn": ("llama", *HYBRID)}
SPLIT = {"heads": dict(kv_heads=2, exact_heads=((1,), (), (0,)))}
EXTEND = {"yarn": (MAX_LEN // 2, MAX_LEN)}      # student: (its base model's context, the export's --extend-to)
ONE_RUN = {"qwen2", "qwen3", "mistral", "yarn"}  # students that run the first of RUNS only
# The runs of each student: (engine arguments, {case: prompts}); the prompts' lengths: one shorter than the sink,
# several longer than the window, and, with chunked prefill of 32 tokens, prompts read in 2 or 3 chunks.
RUNS = [({}, {"one": prompts_of([20], 1), "mixed": prompts_of([1, 5, 9, 17, 40, 3], 2)}),
        ({"max_num_batched_tokens": CHUNK}, {"chunked": prompts_of([70, 45, 33, 6], 3)})]
# And the student whose kept layer is on vLLM's paged cache, in a cache too small for its requests' growth: blocks of
# 32 tokens, 4 prompts of 60 tokens that cross their second block while they generate, and blocks for fewer than
# all of them, so that vLLM preempts some and recomputes them (their linear states read again from the prompt and
# the tokens made so far).
# And the YaRN student on prompts past its base model's context.
EXTRA = {"hybrid": [({"block_size": 32, "num_gpu_blocks_override": PREEMPT_BLOCKS, "max_num_seqs": 4},
                     {"preempted": prompts_of([60, 61, 62, 63], 4)})],
         "yarn": [({}, {"past": prompts_of([150, 230], 6)})]}


CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}


def tiny_model(family: str, context: int = MAX_LEN, kv_heads: int = 1) -> AutoModelForCausalLM:
    """A tiny random model of `family` (2 query heads a key/value head) whose head size (32) vLLM's CPU attention
    takes."""
    torch.manual_seed(0)
    config = CONFIGS[family](vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, head_dim=32,
                             rope_theta=1e4, max_position_embeddings=context, tie_word_embeddings=False)
    config.sliding_window = None                         # Mistral's default window (4096) is no part of these tests
    return AutoModelForCausalLM.from_config(config).eval()


def student_export(tmp: Path, family: str, layers: list[int], attention: Attention, kept: Kept,
                   extend: tuple[int, int] | None = None, kv_heads: int = 1, **split) -> Path:
    """An export of a student of `tiny_model(family)` (5, 8 and 12 features a head) whose own tensors differ from a
    fresh build; with `extend` (context, length), of a model of that context, exported to read `length` tokens;
    `split`, the spec's exact_heads."""
    base = tmp / "base"
    model = tiny_model(family, extend[0] if extend else MAX_LEN, kv_heads)
    model.save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    spec = StudentSpec(base_model=str(base), dims=[5, 8, 12], layers=layers, attention=attention, kept=kept, seed=3,
                       base=fingerprint(model), **split)
    build(model, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".dofattn." in name:
                p.add_(0.1 * torch.randn_like(p))
        model(torch.randint(3, 300, (1, 24)), use_cache=False)          # calibrates the key shifts
    save_student(model, tmp / "student", spec)
    return export(tmp / "student", tmp / "export", extend_to=extend[1] if extend else None)


def hf_reference(folder: Path, cases: dict) -> dict:
    """For each prompt, one at a time: HF generate's greedy tokens (its cache; no stop at eos, as vLLM's ignore_eos)
    and every token's log-probability after the prompt's first: the prompt's from one forward over it (no cache), the
    generated ones' from generate's own logits (a bounded kept layer reads its bounded cache there, not every key)."""
    model, _, _ = load_export(folder)
    model.generation_config.eos_token_id = None
    out = {}
    with torch.no_grad():
        for key, batch in cases.items():
            out[key] = []
            for p in batch:
                done = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                      output_logits=True, return_dict_in_generate=True)
                tokens = done.sequences[0, len(p):]
                prompt = model(torch.tensor([p]), use_cache=False).logits.float().log_softmax(-1)[0, :-1]
                steps = torch.cat(done.logits).float().log_softmax(-1)                    # [new tokens, vocab]
                out[key].append({"tokens": tokens.tolist(),
                                 "logprobs": prompt.gather(-1, torch.tensor(p[1:])[:, None])[:, 0].tolist()
                                 + steps.gather(-1, tokens[:, None])[:, 0].tolist()})
    return out


def serving_env(spawned: bool = False) -> dict:
    """The environment of a vLLM subprocess; `spawned`: its engine and worker in processes of their own (vLLM's
    default, 45 s more a start on 2 cores), else in the subprocess itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if spawned else "0")
    return env


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """{student: its export}."""
    tmp = tmp_path_factory.mktemp("serve")
    folders = {}
    for name, student in STUDENTS.items():
        (tmp / name).mkdir()
        folders[name] = student_export(tmp / name, *student, EXTEND.get(name), **SPLIT.get(name, {}))
    return folders


@pytest.fixture(scope="module")
def served(exports, tmp_path_factory):
    """{student: (HF's results, vLLM's)} for every student's runs, vLLM's in one subprocess."""
    tmp = tmp_path_factory.mktemp("served")
    runs, expected = [], {}
    for name, folder in exports.items():
        own = RUNS[:1] if name in ONE_RUN else RUNS
        for engine, cases in own + EXTRA.get(name, []):
            named = {f"{name}/{k}": v for k, v in cases.items()}
            expected.update(hf_reference(folder, named))
            if runs and runs[-1][:2] == (str(folder), engine):      # the same engine: started once (yarn's)
                runs[-1][2].update(named)
            else:
                runs.append((str(folder), engine, named))
    out = tmp / "served.json"
    done = subprocess.run([sys.executable, "-c", SERVE, json.dumps(runs), str(out)], env=serving_env(),
                          capture_output=True, text=True, timeout=1200, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    got = json.loads(out.read_text())
    return {name: ({k: v for k, v in expected.items() if k.startswith(name + "/")},
                   {k: v for k, v in got.items() if k.startswith(name + "/")}) for name in STUDENTS}


@pytest.mark.parametrize("student", list(STUDENTS))
def test_vllm_serves_the_export_as_hf_generates(served, student):
    expected, got = served[student]
    assert got.keys() == expected.keys()
    for key, rows in expected.items():
        for i, (want, have) in enumerate(zip(rows, got[key], strict=True)):
            assert have["tokens"] == want["tokens"], (key, i)
            torch.testing.assert_close(torch.tensor(have["logprobs"]), torch.tensor(want["logprobs"]), atol=1e-4,
                                       rtol=0, msg=lambda m: f"{key} prompt {i}: {m}")
    tokens = [t for rows in expected.values() for row in rows for t in row["tokens"]]
    assert len(set(tokens)) > len(tokens) // 4          # a model whose tokens say something (not one repeated)
    if f"{student}/preempted" in got:                   # the preempted case did preempt
        assert sum(row["preemptions"] for row in got[f"{student}/preempted"]) > 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_openai_server_answers_as_hf_generates(exports, tmp_path):
    """vLLM's OpenAI-compatible server, started on loopback on the bounded student's export (the default recipe's
    form), answers a completion request for token ids with HF generate's greedy tokens."""
    folder, port = exports["bounded"], free_port()
    prompt = prompts_of([37], 5)[0]
    want = hf_reference(folder, {"p": [prompt]})["p"][0]["tokens"]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", str(MAX_LEN), "--no-enable-prefix-caching"],
                              env=serving_env(spawned=True), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the server did not answer /health in 600 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        body = {"model": str(folder), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
    finally:
        server.terminate()
        server.wait(60)
    tokens = [int(t.split(":")[1]) for t in answer["choices"][0]["logprobs"]["tokens"]]
    assert tokens == want


def test_dofattn_bench_times_an_export_in_vllm_beside_its_teacher(exports, tmp_path):
    """`dofattn bench --parts serve`: the bounded student's export and its base model, each in its own engine, a
    row per batch with output tokens/s, time to first token, decode rate and the requests its cache fits."""
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "dofattn", "bench", "--device", "cpu", "--parts", "serve",
                           "--student", str(exports["bounded"]), "--serve-python", sys.executable,
                           "--gen-contexts", "40", "--serve-batch", "1,3", "--new-tokens", "4", "--out", str(out)],
                          env=serving_env(), capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())["serve"]
    assert [(r["student"], r["batch"]) for r in rows] == [(False, 1), (False, 3), (True, 1), (True, 3)]
    assert all(r["output_tokens"] == 4 * r["batch"] and r["output_tokens_per_s"] > 0 and r["max_concurrency"] > 0
               for r in rows)
    assert all(r["vs_teacher"] > 0 for r in rows if r["student"]) and "vLLM (output tok/s" in done.stdout
