#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# MLA + eviction beyond the 2x that `kvexport convert` applies by default: latent rank 16 + RoPE 8 (5.3x per
# token) and SnapKV with 256 + 32 slots. Undistilled, that rank loses much of the model (docs/mla.md). With a teacher in models/ (kvx-teacher-4x) it also distils the MLA student back
# towards it (forward KL) before exporting; set DISTILL=0 to skip.
set -euo pipefail
OUT=${1:-/tmp/kvx-mla-eviction}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
source "$HERE/fast.sh"
TEACHER=$ROOT/models/kvx-teacher-4x
TOKENS=32768
[ "${KVX_FAST:-0}" = 1 ] && TOKENS=1024
ARGS=(--mla-rank 16 --rope-dim 8 --press snapkv --budget 256 --window 32)
if [ "${DISTILL:-1}" = 1 ] && [ -d "$TEACHER" ]; then
  # a little Python source as distillation text (the reference models were trained on the standard library)
  DATA=$(mktemp --suffix=.txt)
  trap 'rm -f "$DATA"' EXIT
  cat "$(python -c 'import json, os; print(os.path.dirname(json.__file__))')"/*.py > "$DATA"
  ARGS+=(--distill-teacher "$TEACHER" --distill-data "$DATA" --distill-tokens "$TOKENS")
fi
kvexport convert --out "$OUT" --force "${ARGS[@]}" "${FAST[@]}"
echo "open $OUT/report.html"
