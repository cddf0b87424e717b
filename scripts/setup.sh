#!/usr/bin/env bash
# Create .venv with this package, its Pipecat, LiveKit and phone-agent extras and the dev tools (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pin CPU-friendly torch first: on these machines 2.13.0 is a local CPU build; an unpinned torch pulls CUDA.
# --no-compile (here and in the cached venvs): a module is compiled when first imported instead of every one at
# install; pip's compile was 21 s of torch's 30 s install (AMD EPYC, 2 CPUs), 37 s more for the vLLM venv.
.venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
.venv/bin/python -m pip install -q --no-compile -e ".[dev,pipecat,livekit,phone-agent,server]"
# espeak-ng speaks the simulated caller's lines (phone agent demo and its end-to-end test).
if ! command -v espeak-ng >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq espeak-ng >/dev/null
    else
        echo "note: install espeak-ng (e.g. sudo apt-get install espeak-ng) for the phone agent demo" >&2
    fi
fi
