#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One-command GPU check of the kvexport CUDA kernels / TensorRT plugins (< 6 min on a machine with an NVIDIA GPU,
# nvcc, cmake and a CUDA build of PyTorch):
#   1. builds the kernels with CMake for this GPU (the TensorRT plugins too when TensorRT is found);
#   2. runs the GPU tests (tests/plugins/test_kernels_gpu.py: kernels vs the PyTorch references);
#   3. runs compute-sanitizer (memcheck, racecheck) on a small subset of them, where available;
#   4. benchmarks LatentAttention decode at contexts 1k-32k against the bytes it must read and the card's measured
#      copy bandwidth (plugins/gpu_check.py), writing JSON + a markdown table.
# Results go to $OUT (if set) or plugins/results/<gpu>_<date>/, with a summary.md of every step.
#
#   bash scripts/gpu_check.sh            # from the repository root
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: no CUDA GPU visible to torch (need an NVIDIA GPU, its driver and a CUDA build of PyTorch)" >&2
    exit 5
fi
GPU="$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")"
ARCH="$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(0); print(f'{a}{b}')")"
SLUG="$(echo "$GPU" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_')"
RESULTS="${OUT:-$ROOT/plugins/results/${SLUG}_$(date -u +%Y%m%d)}"
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.md"
{
    echo "# kvexport GPU check: $GPU (sm_$ARCH), $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/- nvidia-smi: /'
    echo "- nvcc: $(nvcc --version 2>/dev/null | tail -1)"
    echo "- torch: $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
    echo
} > "$SUMMARY"
status=0
step() { echo "- $1: $2" >> "$SUMMARY"; echo "== $1: $2"; }

# 1. build -------------------------------------------------------------------------------------------------------
build() {  # build DIR [extra cmake args...]
    local dir="$1"; shift
    cmake -S plugins -B "$dir" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" "$@" >> "$RESULTS/build.log" 2>&1 \
        && cmake --build "$dir" -j"$(nproc)" >> "$RESULTS/build.log" 2>&1
}
: > "$RESULTS/build.log"
BUILD=""
if [ -n "${TensorRT_ROOT:-}" ] || [ -f /usr/include/x86_64-linux-gnu/NvInferRuntime.h ] \
    || [ -f /usr/include/aarch64-linux-gnu/NvInferRuntime.h ]; then
    if build "$ROOT/build/plugins"; then
        BUILD="$ROOT/build/plugins"; step build "ok, TensorRT plugins + kernels, sm_$ARCH ($BUILD)"
    else
        step build "TensorRT plugins FAILED (see build.log); falling back to kernels only"; status=1
    fi
fi
if [ -z "$BUILD" ]; then
    if build "$ROOT/build/kernels" -DKVEXPORT_KERNELS_ONLY=ON; then
        BUILD="$ROOT/build/kernels"; step build "ok, kernels only (libkvexport_kernels.so), sm_$ARCH ($BUILD)"
    else
        step build "FAILED (see build.log)"; tail -30 "$RESULTS/build.log"; exit 1
    fi
fi
export KVEXPORT_KERNELS_LIB="$BUILD/libkvexport_kernels.so"
[ -f "$BUILD/libkvexport_plugins.so" ] && export KVEXPORT_PLUGINS="$BUILD/libkvexport_plugins.so"

# 2. GPU tests -----------------------------------------------------------------------------------------------------
if timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/plugins/test_kernels_gpu.py tests/tensorrt \
    > "$RESULTS/pytest.log" 2>&1; then
    step tests "ok: $(tail -1 "$RESULTS/pytest.log")"
else
    step tests "FAILED: $(tail -1 "$RESULTS/pytest.log") (see pytest.log)"; status=1
fi

# 3. compute-sanitizer ---------------------------------------------------------------------------------------------
SUBSET="37-5 or (decode and 33 and not dtype0) or (prefill and 5-64) or unaligned or mla_values"
if command -v compute-sanitizer > /dev/null 2>&1; then
    for tool in memcheck racecheck; do
        if timeout 100 compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
            "$PY" -m pytest -q -p no:cacheprovider -x tests/plugins/test_kernels_gpu.py -k "$SUBSET" \
            > "$RESULTS/sanitizer_$tool.log" 2>&1; then
            step "compute-sanitizer $tool" "ok: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$RESULTS/sanitizer_$tool.log" | tail -1)"
        else
            step "compute-sanitizer $tool" "FAILED or timed out (see sanitizer_$tool.log)"; status=1
        fi
    done
else
    step compute-sanitizer "not available (not on PATH)"
fi

# 4. LatentAttention decode bandwidth ------------------------------------------------------------------------------
if timeout 150 "$PY" plugins/gpu_check.py --lib "$KVEXPORT_KERNELS_LIB" --out "$RESULTS" > "$RESULTS/bench.log" 2>&1; then
    step benchmark "ok (latent_attention_bench.md / .json)"
    echo >> "$SUMMARY"; cat "$RESULTS/latent_attention_bench.md" >> "$SUMMARY"
else
    step benchmark "FAILED (see bench.log)"; tail -20 "$RESULTS/bench.log"; status=1
fi

echo; cat "$SUMMARY"
echo "results: $RESULTS"
exit $status
