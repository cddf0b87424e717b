#!/usr/bin/env bash
# Create .venv with this package, its Pipecat and LiveKit extras and the dev tools (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pin CPU-friendly torch first: on these machines 2.13.0 is a local CPU build; an unpinned torch pulls CUDA.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,pipecat,livekit]"
