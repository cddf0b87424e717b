#!/usr/bin/env bash
# Container entrypoint: quantise Orpheus to FP8 once (kept in $ORPHEUS_FP8_DIR on the /models volume), then start
# the phone agent (examples/pipecat_phone_agent/server.py) on the TensorRT-LLM backend, listening on all interfaces.
# It passes its settings to the agent as command-line flags (the agent reads flags, not these variables); extra
# arguments go to the agent after them, so they win (`--help` lists them).
#
#   ORPHEUS_BACKEND       trtllm (default) or vllm: serve the FP8 checkpoint, quantised once; hf: the source as is
#   ORPHEUS_SOURCE_MODEL  hub id or directory of the bf16 checkpoint (canopylabs/orpheus-3b-0.1-ft)
#   ORPHEUS_FP8_DIR       where the FP8 checkpoint is kept (/models/orpheus-fp8); ORPHEUS_QUANTIZE_ARGS: to quantize
#   ORPHEUS_SNAC          SNAC hub id or directory (hubertsiuzdak/snac_24khz); ORPHEUS_DEVICE: cuda (default) or cpu
#   ORPHEUS_HOST, ORPHEUS_PORT   where the agent listens (0.0.0.0, 8765)
set -euo pipefail

: "${ORPHEUS_BACKEND:=trtllm}"
: "${ORPHEUS_SOURCE_MODEL:=canopylabs/orpheus-3b-0.1-ft}"
: "${ORPHEUS_FP8_DIR:=/models/orpheus-fp8}"
: "${ORPHEUS_SNAC:=hubertsiuzdak/snac_24khz}"
: "${ORPHEUS_DEVICE:=cuda}"
: "${ORPHEUS_HOST:=0.0.0.0}"
: "${ORPHEUS_PORT:=8765}"

model="${ORPHEUS_SOURCE_MODEL}"
if [ "${ORPHEUS_BACKEND}" = trtllm ] || [ "${ORPHEUS_BACKEND}" = vllm ]; then
  if [ ! -f "${ORPHEUS_FP8_DIR}/hf_quant_config.json" ]; then
    echo "orpheus-agent: quantising ${ORPHEUS_SOURCE_MODEL} to FP8 in ${ORPHEUS_FP8_DIR} (once)" >&2
    partial="${ORPHEUS_FP8_DIR}.partial"
    rm -rf "${partial}"
    read -r -a extra <<< "${ORPHEUS_QUANTIZE_ARGS:-}"  # e.g. "--gen-tokens 128"
    orpheus-tts quantize --model "${ORPHEUS_SOURCE_MODEL}" --out "${partial}" "${extra[@]}"
    rm -rf "${ORPHEUS_FP8_DIR}"
    mv "${partial}" "${ORPHEUS_FP8_DIR}"
  fi
  model="${ORPHEUS_FP8_DIR}"  # the quantised checkpoint holds its tokenizer too
fi

cd "${ORPHEUS_APP_DIR:-/opt/orpheus-tts-plugin}"
exec python3 -m examples.pipecat_phone_agent.server \
  --host "${ORPHEUS_HOST}" --port "${ORPHEUS_PORT}" \
  --model "${model}" --snac "${ORPHEUS_SNAC}" --backend "${ORPHEUS_BACKEND}" --device "${ORPHEUS_DEVICE}" "$@"
