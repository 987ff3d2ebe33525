#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a Jetson, from a kvexport checkout: build the plugins, the engines of a converted directory, then
# validate, profile (with tegrastats) and regenerate the report. Usage: deploy.sh DIR [CUDA_ARCH]
set -euo pipefail
DIR=${1:?usage: deploy.sh CONVERTED_DIR [CUDA_ARCH: 87 Orin, 110 Thor]}
ARCH=${2:-87}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
command -v tegrastats >/dev/null || echo "note: tegrastats not found; the profile will hold no Jetson power/GPU data"
cmake -S plugins -B build/plugins -DCMAKE_CUDA_ARCHITECTURES="$ARCH"
cmake --build build/plugins -j
kvexport build-engine "$DIR/onnx" --plugins build/plugins/libkvexport_plugins.so --fp16 --out "$DIR/engine"
if [ -d "$DIR/mla" ]; then
  kvexport validate "$DIR/onnx" --model "$DIR/mla"
else
  kvexport validate "$DIR/onnx"
fi
cp "$DIR/onnx/parity.json" "$DIR/parity.json"   # the report shows this board's parity
kvexport profile "$DIR" --contexts 512,2048,8192
kvexport report "$DIR"
ls -R "$DIR" | head -40
