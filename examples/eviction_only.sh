#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Static-budget eviction only: SnapKV keeps 256 tokens per layer and KV head, 32 decode slots between
# compactions. The per-token cache is the original one, but it never grows past 288 slots.
set -euo pipefail
OUT=${1:-/tmp/kvx-eviction-only}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/fast.sh"
kvexport convert --out "$OUT" --force --press snapkv --budget 256 --window 32 "${FAST[@]}"
python - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
parity = json.load(open(f"{d}/parity.json"))["pairs"]
prof = json.load(open(f"{d}/profile-onnxruntime.json"))
print("parity:", {k: v["passed"] for k, v in parity.items()})
for row in prof["cache"]["contexts"]:
    print(f"context {row['context']:>6}: KV {row['kv_bytes'] / 1024:8.1f} KiB vs {row['baseline_kv_bytes'] / 1024:8.1f} KiB "
          f"({row['ratio']:.1f}×)")
print(f"open {d}/report.html")
PY
