#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Convert your own checkpoint: a local Hugging Face directory (config.json + *.safetensors + tokenizer)
# of a Llama, Qwen2, Qwen3 or Mistral model, e.g. one downloaded earlier with
#   huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir ~/models/qwen2.5-0.5b
# or a bundled one (models/kvx-teacher-2x). Settings come from convert_config.yaml, which fits any model
# (flags on the command line override it). On a CPU, a 0.5B model takes tens of minutes (export +
# 64-step validation + profile); pass --no-profile to save time.
set -euo pipefail
MODEL=${1:?usage: local_checkpoint.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-/tmp/kvx-$(basename "$MODEL")}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/fast.sh"
kvexport convert "$MODEL" --out "$OUT" --force --config "$HERE/convert_config.yaml" "${FAST[@]}"
# the run is reproducible from what it saved:
echo "redo with: kvexport convert --config $OUT/convert.json --out ${OUT}-again"
echo "open $OUT/report.html"
