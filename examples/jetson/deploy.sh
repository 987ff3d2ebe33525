#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a Jetson, from a kvexport checkout: build the plugins and the engines of a converted directory, then
# validate, profile (with tegrastats) and regenerate the report. Usage: deploy.sh DIR [CUDA_ARCH]
#
# Without TensorRT (any other machine) the TensorRT steps are skipped with a message and the directory is
# validated and profiled with onnxruntime instead: the same commands, checked anywhere.
set -euo pipefail
DIR=${1:?usage: deploy.sh CONVERTED_DIR [CUDA_ARCH: 87 Orin, 110 Thor]}
ARCH=${2:-87}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/examples/fast.sh"
cd "$ROOT"
command -v tegrastats >/dev/null || echo "note: tegrastats not found; the profile will hold no Jetson power/GPU data"
BACKEND=onnxruntime
if python -c "import tensorrt" 2>/dev/null && command -v nvcc >/dev/null; then
  cmake -S plugins -B build/plugins -DCMAKE_CUDA_ARCHITECTURES="$ARCH"
  cmake --build build/plugins -j
  kvexport build-engine "$DIR/onnx" --plugins build/plugins/libkvexport_plugins.so --fp16 --out "$DIR/engine"
  BACKEND=tensorrt
else
  echo "skipping the TensorRT steps (plugins, engines): TensorRT or the CUDA compiler is not installed here;"
  echo "validating and profiling $DIR with onnxruntime instead"
fi
# parity on this board: updates DIR/parity.json and its manifest entry, and the report
VALIDATE=()
[ "${KVX_FAST:-0}" = 1 ] && VALIDATE=(--steps 4 --no-fidelity)
kvexport validate "$DIR" --backend "$BACKEND" "${VALIDATE[@]}"
# latency / memory -> DIR/profile-$BACKEND.json, beside the profiles taken elsewhere; tegrastats on a Jetson
PROFILE=(--contexts 512,2048,8192)
[ "${KVX_FAST:-0}" = 1 ] && PROFILE=(--contexts 256 --decode-steps 4 --repeats 1)
kvexport profile "$DIR" --backend "$BACKEND" "${PROFILE[@]}"
kvexport report "$DIR"
ls "$DIR"
