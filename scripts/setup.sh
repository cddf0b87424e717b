#!/usr/bin/env bash
# Create .venv with this package, its Pipecat, LiveKit and phone-agent extras and the dev tools (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pin CPU-friendly torch first: on these machines 2.13.0 is a local CPU build; an unpinned torch pulls CUDA.
# Not --no-compile (here or in the cached venvs), though pip's compile is 21 s of torch's 30 s install: where
# PYTHONDONTWRITEBYTECODE is set (as on CI's hosts), a module not compiled at install is compiled again at every
# import, and the main suite took 1,397 s instead of ~1,100 (AMD EPYC, 2 CPUs).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,pipecat,livekit,phone-agent,server]"
# espeak-ng speaks the simulated caller's lines (phone agent demo and its end-to-end test).
if ! command -v espeak-ng >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq espeak-ng >/dev/null
    else
        echo "note: install espeak-ng (e.g. sudo apt-get install espeak-ng) for the phone agent demo" >&2
    fi
fi
