#!/usr/bin/env bash
# Container entrypoint: quantise Orpheus to FP8 once (kept in $ORPHEUS_FP8_DIR on the /models volume), then
# start the phone agent on the TensorRT-LLM backend. Extra arguments go to the agent.
set -euo pipefail

: "${ORPHEUS_SOURCE_MODEL:=canopylabs/orpheus-3b-0.1-ft}"   # hub id or directory of the bf16 checkpoint
: "${ORPHEUS_FP8_DIR:=/models/orpheus-fp8}"
: "${ORPHEUS_AGENT_MODULE:=examples.pipecat_phone_agent.server}"  # provisional: the phone agent example

if [ ! -f "${ORPHEUS_FP8_DIR}/hf_quant_config.json" ]; then
  echo "orpheus-agent: quantising ${ORPHEUS_SOURCE_MODEL} to FP8 in ${ORPHEUS_FP8_DIR} (once)" >&2
  partial="${ORPHEUS_FP8_DIR}.partial"
  rm -rf "${partial}"
  read -r -a extra <<< "${ORPHEUS_QUANTIZE_ARGS:-}"  # e.g. "--gen-tokens 128"
  orpheus-tts quantize --model "${ORPHEUS_SOURCE_MODEL}" --out "${partial}" "${extra[@]}"
  rm -rf "${ORPHEUS_FP8_DIR}"
  mv "${partial}" "${ORPHEUS_FP8_DIR}"
fi

# The agent builds its engine from these (EngineConfig: model, tokenizer, backend).
export ORPHEUS_MODEL="${ORPHEUS_FP8_DIR}"
export ORPHEUS_TOKENIZER="${ORPHEUS_FP8_DIR}"
export ORPHEUS_BACKEND="${ORPHEUS_BACKEND:-trtllm}"
cd "${ORPHEUS_APP_DIR:-/opt/orpheus-tts-plugin}"
exec python3 -m "${ORPHEUS_AGENT_MODULE}" "$@"
