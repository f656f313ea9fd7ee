"""`dofattn bench`: a student's attention and generation against softmax attention and its teacher, on one machine.

    results = run(BenchConfig(device="cpu", seq_lens=[512, 2048], student="runs/long-context"))

The student is a config, not loose numbers (`student`): a recipe's (its [student] architecture with untrained
features: speed does not depend on training) or a trained one, a run folder or an export. Three measurements, each
the median of `repeats` timed runs after one warm-up (CUDA is synchronised around each):
1. prefill op: one layer's causal attention over T tokens. SDPA (softmax) against the student's layer (its
   `spec.Attention` whole: feature map, window, sink, decay, ...) and against pure linear attention with the same
   features (`ops`, backend picked as in training/prefill); also the linear op alone on precomputed features.
2. decode step: one new query against a context of T tokens at batch B. SDPA over a KV cache of T keys against the
   student layer's generation step on its fixed-size cache, and pure linear attention's step on the [B, H, M, V+1]
   state (on CUDA one Triton kernel with the feature map inside) and the linear op's step alone.
3. generation: the teacher and the student prefill a prompt of T tokens and greedily generate `new_tokens` with HF
   `generate`; the student also with `engine.StaticDecoder` (static buffers, a CUDA graph per token on CUDA; its
   rows add the graph's capture time and the replays' own rate, which a long generation approaches). The
   prefill's time and the decode steps' own rate are clocked inside one generation (each new token out, the
   device's work finished), and the cache each holds at the end (plus the peak CUDA memory on CUDA).
Every result row carries its shapes; the JSON also records the hardware and software versions and the student.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

from dofattn.errors import UserError
from dofattn.jobs import no_grad
from dofattn.options import Machine, option


PARTS = ("prefill", "decode", "generation", "serve")
DEFAULT_PARTS = PARTS[:3]             # serve: only when asked (it needs the serving environment and an export)
GEN_CONTEXTS = [512, 8192, 32768]     # where a user starts, the teacher's trained context, and beyond


@dataclass
class BenchConfig(Machine):
    """What `bench` measures, and where. Its fields are `dofattn bench`'s options of the same names; None (the
    command line's `auto`) picks the device's default (`resolved`)."""

    seq_lens: list[int] | None = option(None, "comma-separated T for prefill and decode; auto: 512,2048 on CPU, "
                                              "2048,8192,32768,131072 on CUDA", none="auto")
    heads: int = option(9, "attention heads of the op benchmarks")
    head_dim: int = option(64, "head size of the op benchmarks")
    dims: int = option(64, "features per head M of the op rows, and of a recipe's untrained student (generate's "
                           "--dims C)", was="features")
    student: str = option("window", "the student timed: a recipe, packaged name or .toml file (its [student] "
                                     "architecture, untrained, with --dims per head), or a trained student: a "
                                     "run folder or an export (generation against its own base model)")
    decode_batch: int = option(1, "batch size of the decode benchmark")
    repeats: int = option(5, "timed runs per measurement (the median is reported)")
    model: str | None = option("smollm2-135m", "the teacher of a recipe's student, for the generation benchmark "
                                               "(a config.json alone: random weights, said in every row); or a "
                                               "trained student (a run folder or an export), which is then the one "
                                               "timed, against its base model; 'none' skips generation",
                               none="none")
    gen_contexts: list[int] | None = option(None, "comma-separated prompt lengths for generation; auto: 512,8192,32768",
                                            none="auto")
    new_tokens: int = option(32, "tokens generated after each prompt")
    parts: list[str] = option(list(DEFAULT_PARTS), "which measurements to run (comma-separated; serve: an export in "
                                                   "vLLM beside its teacher, at --gen-contexts and --serve-batch)")
    serve_batch: list[int] = option([1, 8], "batch sizes of the serve part (requests served at once)")
    serve_python: str | None = option(None, "the serving environment's python for the serve part (bash "
                                            "scripts/serve-env.sh); auto: .venv-serve/bin/python", none="auto")
    compile: bool = option(False, "also time the students' static decoder compiled with torch.compile (for the "
                                  "CPU): minutes of compilation per student, and once more at a second prompt "
                                  "length; the first is reported as compile_ms")
    out: str | None = option("auto", "where to write the JSON result (rewritten after each row; a figure of the "
                                     "generation beside it, .png); auto: bench.json in a trained student's folder, "
                                     "else in this folder (bench-2.json, ... where one is there); none: nowhere",
                             none="none")

    def resolved(self) -> BenchConfig:
        """This config on a named device, with a dtype and the lengths: `auto` (None) made the device's default; a
        trained student given as --model made the student timed."""
        from dofattn.io import new_name
        from dofattn.model.exported import is_any_student
        from dofattn.model.hf import machine_dtype, resolve_device

        device = resolve_device(self.device)
        cuda = device.startswith("cuda")
        student = self.model if self.model and is_any_student(self.model) else self.student
        trained = is_any_student(student)
        return replace(self, device=device, student=student,
                       dtype=str(machine_dtype(self.dtype, device)).removeprefix("torch."),
                       seq_lens=([2048, 8192, 32768, 131072] if cuda else [512, 2048]) if self.seq_lens is None
                       else self.seq_lens,
                       gen_contexts=GEN_CONTEXTS if self.gen_contexts is None else self.gen_contexts,
                       out=str(new_name(Path(student) / "bench.json" if trained and Path(student).is_dir()
                                        else "bench.json", beside=(".png",))) if self.out == "auto" else self.out)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cuda_time(fn, repeats: int, warmups: int = 2) -> float:
    """Median milliseconds of fn() by CUDA events, after `warmups` calls (compilation, the allocator)."""
    import torch

    for _ in range(warmups):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def timed(fn, device: str, repeats: int, warmups: int = 2) -> float:
    """Median time of fn() in milliseconds: CUDA events on CUDA (`cuda_time`, after `warmups` calls), else the
    wall clock after one warm-up call."""
    if device.startswith("cuda"):
        return cuda_time(fn, repeats, warmups)
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _layer(cfg: BenchConfig, attention):
    """One linear layer of `attention` (a `spec.Attention`) at the op rows' shape, untrained, in eval mode."""
    from dofattn.attention import LinearAttention
    from dofattn.features import make_feature_map

    fmap = make_feature_map(attention.feature, cfg.heads, cfg.head_dim, cfg.dims, scaling=cfg.head_dim ** -0.5)
    return LinearAttention(attention, fmap, num_kv_heads=cfg.heads).to(cfg.device).eval()


class Student(NamedTuple):
    """The student `cfg.student` names, resolved once (`student_of`)."""

    attention: object               # its `spec.Attention`, which the op rows build their layer from
    description: str                # in words, for the JSON and the tables
    path: str | None                # a trained student's run folder or export
    recipe: object | None           # else the recipe whose untrained student it is


def student_of(cfg: BenchConfig) -> Student:
    """The student `cfg.student` names: a trained one (a run folder or an export) or a recipe's untrained one; a
    UserError for neither, or for a recipe whose student cannot be built untrained."""
    from dofattn import recipe as recipes
    from dofattn.model.exported import check_weights, describe, is_any_student, spec_of
    if is_any_student(cfg.student):
        spec = spec_of(cfg.student)
        check_weights(cfg.student)                   # before any timing, not after the teacher's
        return Student(spec.attention, f"{cfg.student} ({'; '.join(describe(cfg.student, spec))})", cfg.student,
                       None)
    recipe = recipes.load(cfg.student)
    kept = recipe.student.keep_softmax
    stand_in = (f"; its last layers kept (student.keep_softmax = {kept:g}), standing in for those a run chooses"
                if kept else "")
    return Student(recipe.student.attention, f"recipe {recipe.name}, untrained ({recipe.description}{stand_in})", None,
                   recipe)


def op_backends(device: str) -> list[str]:
    """The linear-op backends worth timing on this device."""
    from dofattn.ops import fla_available, triton_available

    if not device.startswith("cuda"):
        return ["chunk"]
    return [name for name, ok in (("triton", triton_available()), ("fla", fla_available()), ("chunk", True)) if ok]


def try_timed(fn, device: str, repeats: int) -> float | str:
    """`timed`, or the error's one-line text (out of memory at long T, a backend that fails) instead of a time."""
    import torch

    try:
        return timed(fn, device, repeats)
    except (RuntimeError, torch.OutOfMemoryError) as error:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _pure(attention):
    """Pure linear attention with `attention`'s feature map: the paper's layer, beside the student's."""
    from dofattn.spec import Attention

    return Attention(feature=attention.feature, window=0, sink=0)


@no_grad
def bench_prefill(cfg: BenchConfig, student: Student, dtype: torch.dtype, report=lambda row: None) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from dofattn.ops import linear_attention, pick_backend

    rows = []
    attention = student.attention
    linear, layer = _layer(cfg, _pure(attention)), _layer(cfg, attention)
    for T in cfg.seq_lens:
        g = torch.Generator(device=cfg.device).manual_seed(T)
        q, k, v = (torch.randn(1, T, cfg.heads, cfg.head_dim, generator=g, device=cfg.device, dtype=dtype)
                   for _ in range(3))
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        # calibrate the key shift first, as a trained student's is: then on CUDA both maps run the one-kernel path
        # and hand the op contiguous features (the calibrating call's PyTorch path gives a strided φk, which the
        # op would copy, and the op rows would time that copy too)
        linear.feature_map(k, "key")
        layer.feature_map(k, "key")
        phi_q, phi_k = (linear.feature_map(x, role).to(dtype) for x, role in ((q, "query"), (k, "key")))
        row = {"T": T, "batch": 1, "heads": cfg.heads, "head_dim": cfg.head_dim, "features": cfg.dims,
               "student": attention.describe() or "pure linear", "dtype": str(dtype).removeprefix("torch."),
               "backend": pick_backend(phi_q),
               "sdpa_ms": timed(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), cfg.device,
                                cfg.repeats),
               "linear_op_ms": timed(lambda: linear_attention(phi_q, phi_k, v), cfg.device, cfg.repeats),
               "linear_ms": timed(lambda: linear.attend(q, k, v), cfg.device, cfg.repeats),
               "student_ms": timed(lambda: layer.attend(q, k, v), cfg.device, cfg.repeats)}
        row["op_ms"] = {name: try_timed(lambda name=name: linear_attention(phi_q, phi_k, v, backend=name),
                                        cfg.device, cfg.repeats) for name in op_backends(cfg.device)}
        row["speedup_op_vs_sdpa"] = row["sdpa_ms"] / row["linear_op_ms"]
        row["speedup_student_vs_sdpa"] = row["sdpa_ms"] / row["student_ms"]
        rows.append(row)
        report(row)
        del q, k, v, qh, kh, vh, phi_q, phi_k
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


@no_grad
def bench_decode(cfg: BenchConfig, student: Student, dtype: torch.dtype, report=lambda row: None) -> list[dict]:
    """The student's step runs on a cache it prefilled with W + S + 1 tokens (its window full, its sink filled):
    the steady step of a long generation, whose cost does not grow with T."""
    import torch
    import torch.nn.functional as F

    from dofattn.attention import LinearStateLayer
    from dofattn.attention.cache import cache_bytes
    from dofattn.ops import linear_attention

    rows = []
    attention = student.attention
    linear, layer = _layer(cfg, _pure(attention)), _layer(cfg, attention)
    B, H, D, M = cfg.decode_batch, cfg.heads, cfg.head_dim, cfg.dims
    for T in cfg.seq_lens:
        g = torch.Generator(device=cfg.device).manual_seed(T)
        q = torch.randn(B, H, 1, D, generator=g, device=cfg.device, dtype=dtype)
        k_cache, v_cache = (torch.randn(B, H, T, D, generator=g, device=cfg.device, dtype=dtype) for _ in range(2))
        q1, k1, v1 = (torch.randn(B, 1, H, D, generator=g, device=cfg.device, dtype=dtype) for _ in range(3))
        state = torch.rand(B, H, M, D + 1, generator=g, device=cfg.device)
        linear.feature_map(k1, "key")  # calibrate the key shift once, as a prefill would
        phi_q1, phi_k1 = (linear.feature_map(x, role).to(dtype) for x, role in ((q1, "query"), (k1, "key")))
        cache = LinearStateLayer()                 # the layer's generation step, as `generate` runs it
        cache.state = state.clone()
        prompt = (torch.randn(B, attention.window + attention.sink + 1, H, D, generator=g, device=cfg.device,
                              dtype=dtype) for _ in range(3))
        student_cache = LinearStateLayer()
        layer(*prompt, cache=student_cache)      # calibrates its key shift too
        row = {"T": T, "batch": B, "heads": H, "head_dim": D, "features": M,
               "student": attention.describe() or "pure linear",
               "op_ms": timed(lambda: linear_attention(phi_q1, phi_k1, v1, state, output_final_state=True),
                              cfg.device, cfg.repeats),
               "sdpa_ms": timed(lambda: F.scaled_dot_product_attention(q, k_cache, v_cache), cfg.device,
                                cfg.repeats),
               "linear_ms": timed(lambda: linear(q1, k1, v1, cache=cache), cfg.device, cfg.repeats),
               "student_ms": timed(lambda: layer(q1, k1, v1, cache=student_cache), cfg.device, cfg.repeats),
               "kv_cache_bytes": 2 * k_cache.numel() * k_cache.element_size(),
               "state_bytes": state.numel() * state.element_size(),
               "student_cache_bytes": cache_bytes(SimpleNamespace(layers=[student_cache]))}
        row["speedup_student_vs_sdpa"] = row["sdpa_ms"] / row["student_ms"]
        rows.append(row)
        report(row)
        del k_cache, v_cache
    return rows


class TokenClock:
    """A `generate` streamer that notes when each new token is out (the device's work finished): the prefill's time
    and the decode steps' own time in one run, not the difference of two separately timed runs."""

    def __init__(self, device: str):
        import torch

        from dofattn.engine import Clock

        self.clock, self.stamps = Clock(torch.device(device)), []

    def put(self, value) -> None:            # the prompt first, then each new token
        self.stamps.append(self.clock.now())

    def end(self) -> None:
        pass

    def timings(self) -> dict:
        """prefill_s (prompt in to first token out), decode_steps, decode_s (first new token to the last)."""
        if len(self.stamps) < 2:
            raise RuntimeError("generate handed the clock no new token")
        return {"prefill_s": self.stamps[1] - self.stamps[0], "decode_steps": len(self.stamps) - 2,
                "decode_s": self.stamps[-1] - self.stamps[1]}


class PeakMemory:
    """The peak memory of what runs between `start` and `above`, above what was held at `start` (the loaded model,
    and what the allocator kept from earlier calls): on CUDA the allocator's peak; on Linux the process's peak
    resident set (VmHWM, reset through /proc/self/clear_refs): activations, cache, the allocator's own reserve;
    None elsewhere."""

    def __init__(self, device: str):
        self.cuda, self.base = device.startswith("cuda"), None

    def start(self) -> None:
        import torch

        if self.cuda:
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            self.base = _status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except (OSError, StopIteration):
            self.base = None

    def above(self) -> int | None:
        """Bytes of the peak since `start` above the baseline (None where it cannot be read)."""
        import torch

        if self.base is None:
            return None
        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.base
        return max(_status_bytes("VmHWM") - self.base, 0)   # the set can shrink between the base and the reset


def _status_bytes(field: str) -> int:
    """A size the kernel reports for this process in /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _generation_row(cfg: BenchConfig, model: str, student: bool, T: int, engine: str, timings: dict,
                    cache, peak: int | None = None) -> dict:
    """One generation row from timings of the steps themselves (`TokenClock`, `StaticDecoder.timings`)."""
    from dofattn.attention.cache import cache_bytes

    steps, decode_s = timings["decode_steps"], timings["decode_s"]
    if steps != cfg.new_tokens - 1:
        raise RuntimeError(f"{engine} generation made {steps + 1} tokens, not the {cfg.new_tokens} asked for")
    if not (decode_s > 0 and math.isfinite(decode_s) and timings["prefill_s"] > 0):
        raise RuntimeError(f"{engine} generation timed {decode_s} s for {steps} decode steps: no rate to report")
    row = {"model": model, "student": student, "engine": engine, "context": T,
           "new_tokens": cfg.new_tokens, "prefill_ms": timings["prefill_s"] * 1e3,
           "decode_tokens_per_s": steps / decode_s, "cache_bytes": cache_bytes(cache)}
    if peak is not None:
        row["peak_above_model_bytes"] = peak
    return row


def load_models(cfg: BenchConfig, student: Student, dtype: torch.dtype):
    """(name, is the student, model, tokenizer) of the teacher, then the student: a trained one and its base model,
    or a recipe's student on `cfg.model` with untrained features (each loaded when its turn comes: `load_for_job`)."""
    from dofattn.jobs import load_for_job
    from dofattn.model.exported import spec_of
    from dofattn.model.hf import RANDOM_WEIGHTS, config_only

    path, recipe = student.path, student.recipe
    on = {"dtype": dtype, "device": cfg.device}
    if path is not None:
        base = spec_of(path).base_model
        yield base, False, *load_for_job(base, **on)[:2]
        yield path, True, *load_for_job(path, merge_lora=True, **on)[:2]
        return
    name = f"{cfg.model} ({RANDOM_WEIGHTS})" if config_only(cfg.model) else cfg.model   # said in every row
    yield name, False, *load_for_job(cfg.model, random_weights=True, **on)[:2]
    model, tokenizer, _ = load_for_job(cfg.model, recipe, f"fix:{cfg.dims}", random_weights=True,
                                       stand_in=True, **on)
    yield f"{name}, recipe {recipe.name}", True, model, tokenizer


@no_grad
def bench_generate(cfg: BenchConfig, student: Student, dtype: torch.dtype, report=lambda row: None) -> list[dict]:
    import torch

    from dofattn.engine import StaticDecoder

    rows = []
    for name, is_student, model, tokenizer in load_models(cfg, student, dtype):
        vocab = model.get_input_embeddings().weight.shape[0]
        decoders = []             # the student also on static buffers, and with --compile through torch.compile
        if is_student:
            decoders = [StaticDecoder(model)] + ([StaticDecoder(model, compile=True)] if cfg.compile else [])
        pad = (tokenizer.pad_token_id if tokenizer is not None else None) or 0   # a config alone has no tokenizer
        kwargs = {"do_sample": False, "pad_token_id": pad}
        warm = torch.randint(3, vocab, (1, min(cfg.gen_contexts)), generator=torch.Generator().manual_seed(0))
        model.generate(warm.to(cfg.device), max_new_tokens=2, **kwargs)       # warm-up, once
        memory = PeakMemory(cfg.device)          # each generation's peak above what was held before it
        for T in cfg.gen_contexts:
            ids = torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(T)).to(cfg.device)
            clock = TokenClock(cfg.device)
            memory.start()
            out = model.generate(ids, max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens,
                                 return_dict_in_generate=True, streamer=clock, **kwargs)
            cache = out["cache"] if "cache" in out else out["past_key_values"]     # transformers ≥ 5.24 / before
            rows.append(_generation_row(cfg, name, is_student, T, "hf", clock.timings(), cache,
                                        memory.above()))
            del out, cache
            report(rows[-1])
            # static decoding (a CUDA graph on CUDA; compiled with --compile: the first prompt length's warm-up
            # compiles, the second's once more with the lengths symbolic, the timed call runs the compiled step)
            for decoder in decoders:
                if T == cfg.gen_contexts[0]:
                    decoder.generate(ids, 2)                                  # warm-up
                compile_s = decoder.timings.get("compile_s")             # the decoder's first call only
                memory.start()
                decoder.generate(ids, cfg.new_tokens)
                engine = "static+graph" if decoder.graph else "static+compile" if decoder.compiled else "static"
                rows.append(_generation_row(cfg, name, is_student, T, engine, decoder.timings, decoder.cache,
                                            memory.above()))
                if "replays" in decoder.timings:   # the replays alone: the rate of a long generation
                    rows[-1]["graph_capture_ms"] = decoder.timings["capture_s"] * 1e3
                    rows[-1]["graph_tokens_per_s"] = decoder.timings["replays"] / decoder.timings["replay_s"]
                if compile_s is not None:
                    rows[-1]["compile_ms"] = compile_s * 1e3
                report(rows[-1])
        del model, decoders
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    teacher = {r["context"]: r["decode_tokens_per_s"] for r in rows if not r["student"]}
    for r in rows:                          # each row's decode rate against the teacher's after the same prompt
        if r["student"] and r["context"] in teacher:
            r["vs_teacher"] = r["decode_tokens_per_s"] / teacher[r["context"]]
    return rows


def hardware(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or
            platform.machine(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def validate(cfg: BenchConfig) -> None:
    """The rules on the options alone (lengths left at auto, None, pass until `resolved` picks them)."""
    def bad(lengths) -> bool:
        return lengths is not None and (not lengths or min(lengths) < 1)

    if bad(cfg.seq_lens) or (cfg.model and bad(cfg.gen_contexts)):
        raise UserError("--seq-lens and --gen-contexts need positive token counts, e.g. 512,2048")
    for name in ("heads", "head_dim", "dims", "decode_batch", "repeats", "new_tokens"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if not cfg.serve_batch or min(cfg.serve_batch) < 1:
        raise UserError("--serve-batch needs positive batch sizes, e.g. 1,8")
    unknown = [p for p in cfg.parts if p not in PARTS]
    if unknown or not cfg.parts:
        raise UserError(f"--parts takes some of {','.join(PARTS)} (comma-separated), got {','.join(cfg.parts)!r}")


def run(cfg: BenchConfig, progress=None) -> dict:
    """The measurements in `cfg.parts`; a JSON-ready dict, also written to `cfg.out` after each row (and part), so
    that a run stopped partway (a time limit, an out-of-memory kill) keeps what it measured. `progress(text)` gets
    each row as it is measured (print, say; None: quiet)."""
    validate(cfg)                       # on the options alone: before torch and transformers are imported
    from dofattn.model.hf import model_source, parse_dtype, use_threads
    from dofattn.io import check_output, write_atomic

    cfg = cfg.resolved()
    validate(cfg)
    if cfg.model and cfg.model != cfg.student:    # a base model to time generation with: it exists, or one line
        model_source(cfg.model)
    use_threads(cfg.threads)
    student = student_of(cfg)               # neither a recipe nor a student, or not buildable: one line, at once
    if "serve" in cfg.parts:
        check_serve(cfg, student)
    out = check_output(cfg.out, "--out", (".json",)) if cfg.out else None
    dtype = parse_dtype(cfg.dtype)
    def say(text: str) -> None:           # each line out at once: a long run's rows show as they come
        if progress is not None:
            progress(text)
            sys.stdout.flush()

    result = {"config": asdict(cfg), "student": student.description, "hardware": hardware(cfg.device),
              "prefill": [], "decode": [], "generation": [], "serve": []}
    current = []                            # the rows of the part being measured

    def save() -> None:
        if out is not None:
            write_atomic(out, json.dumps(result, indent=2))

    def report(row: dict) -> None:          # each row as it is measured: a long run that is cut short keeps them
        say("  " + ", ".join(f"{k}={_short(v)}" for k, v in row.items()))
        current.append(row)
        save()

    parts = {"prefill": ("prefill op", bench_prefill), "decode": ("decode step", bench_decode),
             "generation": ("generation", bench_generate), "serve": ("vLLM", bench_serve)}
    say(f"student: {result['student']}")
    for name in PARTS:
        if name not in cfg.parts or (name == "generation" and not cfg.model):
            continue
        title, measure = parts[name]
        say(f"{title} ...")
        current = result[name] = []
        result[name] = measure(cfg, student, dtype, report)
        save()
    if out is not None and result["generation"]:
        from dofattn.plots import plot_generation

        plot_generation(result, out.with_suffix(".png"))
    return result


def check_serve(cfg: BenchConfig, student: Student) -> str:
    """The serve part's inputs, before anything runs: an export to time, and the serving environment's python."""
    from dofattn.spec import is_export
    from dofattn.serve.bench import serving_python

    if student.path is None or not is_export(student.path):
        raise UserError("--parts serve times an export in vLLM beside its teacher: give --student EXPORT (a folder "
                        "of dofattn export --out)")
    return serving_python(cfg.serve_python)


def bench_serve(cfg: BenchConfig, student: Student, dtype: torch.dtype, report=lambda row: None) -> list[dict]:
    """An export and its teacher in vLLM (`serve.bench`), at each prompt length of --gen-contexts and each batch of
    --serve-batch (random prompt tokens: the engine's speed does not depend on them)."""
    import torch

    from dofattn.model.exported import spec_of
    from dofattn.spec import read_config
    from dofattn.serve.bench import serve, teacher_folder

    python = check_serve(cfg, student)
    teacher = teacher_folder(spec_of(student.path).base_model)
    vocab = read_config(student.path)["vocab_size"]
    rows = []
    for T in cfg.gen_contexts:
        g = torch.Generator().manual_seed(T)
        prompts = torch.randint(3, vocab, (max(cfg.serve_batch), T), generator=g).tolist()
        for folder, is_student in ((teacher, False), (str(student.path), True)):
            served = serve(folder, prompts, cfg.serve_batch, cfg.new_tokens, T + cfg.new_tokens + 8, python)
            for r in served["rows"]:
                rows.append({"model": folder, "student": is_student, "engine": "vllm", "context": T, **r,
                             "max_concurrency": served["max_concurrency"]})
                report(rows[-1])
    teacher_rows = {(r["context"], r["batch"]): r for r in rows if not r["student"]}
    for r in rows:
        if r["student"]:
            r["vs_teacher"] = r["output_tokens_per_s"] / teacher_rows[r["context"], r["batch"]]["output_tokens_per_s"]
    return rows


def _short(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in x.items()) + "}"
    return str(x)


def _ms(x) -> str:
    return f"{x:>9.3f}" if isinstance(x, float) else f"{'failed':>9}"


def format_tables(result: dict) -> str:
    backends = list(result["prefill"][0]["op_ms"]) if result["prefill"] else []
    lines = [f"student: {result['student']}"] if "student" in result else []
    if result["prefill"]:
        lines += ["prefill (one layer, ms):",
                  f"{'T':>7} {'SDPA':>9} " + " ".join(f"{'op:' + b:>9}" for b in backends)
                  + f" {'linear':>9} {'student':>9} {'op/SDPA':>8} {'student/SDPA':>13}"]
    for r in result["prefill"]:
        ops = " ".join(_ms(r["op_ms"][b]) for b in backends)
        lines.append(f"{r['T']:>7} {r['sdpa_ms']:>9.3f} {ops} {r['linear_ms']:>9.3f} {r['student_ms']:>9.3f} "
                     f"{r['speedup_op_vs_sdpa']:>7.2f}x {r['speedup_student_vs_sdpa']:>12.2f}x")
    if result["decode"]:
        lines += ["decode step (one layer, ms):",
                  f"{'T':>7} {'batch':>5} {'SDPA':>9} {'op':>9} {'linear':>9} {'student':>9} {'speed-up':>9}"]
    for r in result["decode"]:
        lines.append(f"{r['T']:>7} {r['batch']:>5} {r['sdpa_ms']:>9.3f} {r['op_ms']:>9.3f} {r['linear_ms']:>9.3f} "
                     f"{r['student_ms']:>9.3f} {r['speedup_student_vs_sdpa']:>8.2f}x")
    if result.get("serve"):
        lines += ["vLLM (output tok/s: the batch's tokens over its wall time, prompts read included; x teacher: "
                  "over the teacher's at that prompt and batch):",
                  f"{'model':>8} {'prompt':>7} {'batch':>5} {'output tok/s':>13} {'x teacher':>10} "
                  f"{'first token s':>14} {'decode tok/s':>13} {'requests fit':>13}"]
        for r in result["serve"]:
            ratio = f"{r['vs_teacher']:>9.2f}x" if "vs_teacher" in r else f"{'-':>10}"
            fit = f"{r['max_concurrency']:>13.1f}" if r.get("max_concurrency") else f"{'-':>13}"
            lines.append(f"{'student' if r['student'] else 'teacher':>8} {r['context']:>7} {r['batch']:>5} "
                         f"{r['output_tokens_per_s']:>13.2f} {ratio} {r['ttft_s']:>14.2f} "
                         f"{r['decode_tokens_per_s'] or 0:>13.1f} {fit}")
    if result["generation"]:
        lines += ["generation (graph tok/s: the CUDA graph's replays alone, without its capture; x teacher: decode "
                  "tok/s over the teacher's at that context):",
                  f"{'model':>27} {'context':>8} {'prefill ms':>11} {'decode tok/s':>13} {'x teacher':>10} "
                  f"{'graph tok/s':>12} {'cache MiB':>9} {'peak MiB':>9}",
                  "  (peak: above the loaded model, prefill and generation)"]
        for r in result["generation"]:
            name = "student" if r["student"] else "teacher"
            name += "" if r.get("engine", "hf") == "hf" else f" {r['engine']}"
            peak = (f"{r['peak_above_model_bytes'] / 2 ** 20:>9.0f}" if r.get("peak_above_model_bytes") is not None
                    else f"{'-':>9}")
            graph = f"{r['graph_tokens_per_s']:>12.1f}" if "graph_tokens_per_s" in r else f"{'-':>12}"
            ratio = f"{r['vs_teacher']:>9.2f}x" if "vs_teacher" in r else f"{'-':>10}"
            lines.append(f"{name:>27} {r['context']:>8} {r['prefill_ms']:>11.1f} {r['decode_tokens_per_s']:>13.1f} "
                         f"{ratio} {graph} {r['cache_bytes'] / 2 ** 20:>9.2f} {peak}")
    return "\n".join(lines)

