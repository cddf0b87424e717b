#!/usr/bin/env bash
# Create a separate venv (default .venv-oldest, or $OLDEST_VENV) with the oldest supported Pipecat, LiveKit
# Agents and Ray, for the adapter tests and tests/test_ray.py's fast parts: .venv gets the newest releases, this one
# the lower bounds of the `pipecat`, `livekit` and `ray` extras in pyproject.toml, read from there and pinned with
# ==. Idempotent: when the venv already matches those pins it only checks a stamp and exits.
#
# Measured on 2 shared CPU cores (PyPI reachable, torch wheel on local disk, pip's cache warm): a fresh install
# takes ~1 min (56 s), the venv is 1.8 GiB; a re-run on a complete venv takes ~25 ms (stamp check), and a new
# checkout path or pyproject.toml only re-installs this package (~6 s). Its tests (the Pipecat and LiveKit files
# of tests/adapters/ and tests/examples/test_livekit_example.py, as .ci/run names them): 182 in ~2 min 45 s (-n 2).
# CI that clones afresh each run caches it by pointing OLDEST_VENV outside the clone (.ci/run does:
# ${XDG_CACHE_HOME:-$HOME/.cache}/orpheus-tts/venv-oldest); runs sharing it take turns (flock).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
VENV=${OLDEST_VENV:-$ROOT/.venv-oldest}
PY=${PYTHON:-python3}

TORCH_VERSION=2.13.0    # a CPU build on these machines; an unpinned torch pulls CUDA
# The extras' lower bounds, e.g. pipecat = ["pipecat-ai[silero,websocket]>=1.12.0,<2"] or
# ray = ["orpheus-tts-plugin[server]", "ray[serve]>=2.60,<3", ...].
lower_bound() { sed -n -E "s/^$1 = \[.*\"$2(\[[^]]*\])?>=([0-9][0-9.]*),.*/\2/p" pyproject.toml; }
PIPECAT_VERSION=$(lower_bound pipecat pipecat-ai)
LIVEKIT_VERSION=$(lower_bound livekit livekit-agents)
RAY_VERSION=$(lower_bound ray ray)
if [ -z "$PIPECAT_VERSION" ] || [ -z "$LIVEKIT_VERSION" ] || [ -z "$RAY_VERSION" ]; then
    echo "setup_matrix: no lower bound found for pipecat-ai, livekit-agents or ray in pyproject.toml" >&2
    exit 1
fi
# What the adapter tests need besides the frameworks: the engine server (test_livekit_example, test_livekit_worker
# and test_remote_engine start one), Ray Serve (the `ray` extra) and the test runner. Not the whole `dev` extra
# (nvidia-modelopt, ...).
EXTRAS=server,remote,ray
TEST_DEPS=("pytest>=8" "pytest-asyncio>=0.23" "pytest-xdist>=3.5")
REV=2                   # bump when the steps below change

BASE_STAMP="rev=$REV torch==$TORCH_VERSION pipecat-ai==$PIPECAT_VERSION livekit-agents==$LIVEKIT_VERSION ray==$RAY_VERSION"
PINS=("torch==$TORCH_VERSION" "pipecat-ai[silero,websocket]==$PIPECAT_VERSION" "livekit-agents==$LIVEKIT_VERSION"
      "ray[serve]==$RAY_VERSION")
source scripts/cached_venv.sh
cached_venv_open oldest setup_matrix "(pipecat-ai $PIPECAT_VERSION, livekit-agents $LIVEKIT_VERSION, ray $RAY_VERSION)"
cached_venv_base

# This package (editable) with everything at once, so that one resolve fits the pins and the package's own
# dependencies together (the oldest livekit-agents caps opentelemetry, which holds fastapi back); quick when
# only the checkout moved.
"$VPY" -m pip install -q -e "$ROOT[$EXTRAS]" "${PINS[@]}" "${TEST_DEPS[@]}"

problems=$("$VPY" -m pip check 2>&1 | grep -v "^No broken" || true)
if [ -n "$problems" ]; then
    echo "setup_matrix: pip check found broken requirements:" >&2
    echo "$problems" >&2
    exit 1
fi
# From / so that the package is found through its editable install, not the working directory.
(cd / && "$VPY" -) <<'EOF'
import importlib.metadata as md

import orpheus_tts_plugin.livekit  # noqa: F401
import orpheus_tts_plugin.pipecat  # noqa: F401
import orpheus_tts_plugin.server.ray  # noqa: F401

print(f"setup_matrix: pipecat-ai {md.version('pipecat-ai')}, livekit-agents {md.version('livekit-agents')}, "
      f"ray {md.version('ray')}, torch {md.version('torch')}")
EOF
cached_venv_done
