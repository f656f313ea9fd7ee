#!/usr/bin/env bash
# Install dofattn into the current Python environment.
#   bash scripts/install.sh          # the package, with peft for the LoRA recipes (the [lora] extra)
#   bash scripts/install.sh --test   # the package and the test tools
# Where no torch is installed, the pinned CPU build is installed first; an existing torch (e.g. a CUDA build)
# is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "dofattn: no torch found, installing the CPU build torch==2.13.0" >&2
    "$PY" -m pip install -q "torch==2.13.0"
fi
extras="[lora]"                        # LoRA recipes (window-lora, pure-linear, keep-softmax) need peft
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi   # the test extra brings peft too
"$PY" -m pip install -q -e ".${extras}"
