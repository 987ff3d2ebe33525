#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One GPU check of the kvexport CUDA kernels on a bare NVIDIA machine: python3 with a CUDA build of torch, nvcc,
# compute-sanitizer / ncu if present. No network, no installs, no TensorRT, no polygraphy; kvexport is used from
# this checkout (PYTHONPATH), not installed.
#
#   1. imports      the modules this check uses load without polygraphy / tensorrt; the benchmark grid
#   2. build        nvcc -shared the kernels for the GPU's arch (sm_90 on H100 / H200)
#   3. tests        tests/plugins/test_kernels_gpu.py: the kernel cases of the CPU path, against the torch references
#                   (fresh random inputs, outputs poisoned first); the benchmark checks the large sizes
#   4. benchmark    LatentAttention decode (32 / 128 heads, R 512+64 / 128+32, S 4k-64k, batch 1-16) and TopKGather
#                   with CUDA events, against the device-to-device copy bandwidth measured here
#   5. memcheck, racecheck   compute-sanitizer on small cases (PYTORCH_NO_CUDA_MEMORY_CACHING=1)
#   6. ncu          DRAM bytes and duration of one LatentAttention launch (S=32k, 128 heads), when time is left
# then one table (stdout) and, with $OUT set, $OUT/gpu_check.{json,md} plus the logs.
#
# Every step runs under `timeout`, bounded by what is left of an 8-minute budget (KVX_GPU_CHECK_BUDGET seconds,
# default 450). --dry-run (automatic when torch sees no GPU) runs the steps that need no GPU and reports the others
# as skipped.
#
#   bash scripts/gpu_check.sh [--dry-run]          # from anywhere; OUT=dir to keep the results
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '3,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $arg (accepted: --dry-run)" >&2; exit 2 ;;
    esac
done
START=$(date +%s)
BUDGET="${KVX_GPU_CHECK_BUDGET:-450}"
WORK="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvx_gpu_check.XXXXXX")}"
mkdir -p "$WORK"
STEPS="$WORK/steps.tsv"
: > "$STEPS"
FAILED=0

record() {  # step status detail
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$STEPS"
    echo "== $1: $2${3:+ - $3}"
    [ "$2" = FAILED ] && FAILED=1
    return 0
}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
limit() {  # wanted seconds -> what the budget allows (0: nothing left)
    local l; l=$(left)
    if [ "$l" -lt 20 ]; then echo 0; elif [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi
}
tail_log() { tail -n "${2:-15}" "$1" | sed 's/^/    /'; }

if ! command -v "$PY" > /dev/null 2>&1; then
    echo "error: $PY not found (set PYTHON=...)" >&2
    exit 5
fi

# 1. imports ---------------------------------------------------------------------------------------------------
if timeout 120 "$PY" - > "$WORK/imports.log" 2>&1 <<'EOF'
import importlib.abc, runpy, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("polygraphy", "tensorrt"):
            raise ImportError(f"{name} must not be needed by the GPU check")
        return None

sys.meta_path.insert(0, Block())
import tests.plugins.kernels_lib, tests.plugins.kernel_cases, tests.plugins.test_kernels_gpu  # noqa: E401,F401
sys.argv = ["gpu_check.py", "configs"]
runpy.run_path("plugins/gpu_check.py", run_name="__main__")
EOF
then
    record imports ok "no polygraphy / tensorrt needed; $(grep -cE '^\| (LatentAttention|TopKGather)' "$WORK/imports.log") benchmark rows planned"
else
    record imports FAILED "see imports.log"; tail_log "$WORK/imports.log"
fi

GPU="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)"
if [ -z "$GPU" ] && [ "$DRY" = 0 ]; then
    echo "no CUDA GPU visible to torch: dry mode (GPU steps are skipped)"
    DRY=1
fi
TORCH="$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null || echo missing)"
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
record environment ok "GPU: ${GPU:-none}; torch $TORCH; nvcc: ${NVCC:-missing}; compute-sanitizer: $(command -v compute-sanitizer > /dev/null && echo yes || echo no); ncu: $(command -v ncu > /dev/null && echo yes || echo no)"

skip_gpu() { record "$1" skipped "dry run: $2"; }

# 2. build -----------------------------------------------------------------------------------------------------
LIB="$WORK/build/libkvexport_kernels.so"
if [ "$DRY" = 1 ]; then
    skip_gpu build "nvcc -shared for the GPU's arch (nvcc: ${NVCC:-missing})"
elif [ -z "$NVCC" ]; then
    record build FAILED "nvcc not found"
else
    ARCH="$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(f"{a}{b}")')"
    T=$(limit 240)
    if [ "$T" -gt 0 ] && CUDA_HOME="$(dirname "$(dirname "$NVCC")")" timeout "$T" "$PY" -c "
from pathlib import Path
from tests.plugins.kernels_lib import build_kernels
print(build_kernels(Path('$WORK/build'), '$ARCH'))" > "$WORK/build.log" 2>&1; then
        record build ok "sm_$ARCH, $(( $(date +%s) - START )) s into the check"
    else
        record build FAILED "see build.log (limit ${T} s)"; tail_log "$WORK/build.log" 30
    fi
fi
export KVEXPORT_KERNELS_LIB="$LIB"

# 3. tests -----------------------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    if timeout 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only tests/plugins/test_kernels_gpu.py \
        > "$WORK/pytest.log" 2>&1; then
        skip_gpu tests "$(grep -cE '::test_' "$WORK/pytest.log") GPU kernel tests collected"
    else
        record tests FAILED "the GPU tests do not collect (see pytest.log)"; tail_log "$WORK/pytest.log"
    fi
elif [ -f "$LIB" ]; then
    T=$(limit 150)
    if [ "$T" -gt 0 ] && timeout "$T" "$PY" -m pytest -q -p no:cacheprovider tests/plugins/test_kernels_gpu.py \
        > "$WORK/pytest.log" 2>&1; then
        record tests ok "$(tail -n 1 "$WORK/pytest.log")"
    else
        record tests FAILED "$(tail -n 1 "$WORK/pytest.log") (see pytest.log, limit ${T} s)"; tail_log "$WORK/pytest.log" 25
    fi
else
    record tests FAILED "no library built"
fi

# 4. benchmark -------------------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    skip_gpu benchmark "CUDA-event timing of the grid listed by step 1"
elif [ -f "$LIB" ]; then
    T=$(limit 150)
    if [ "$T" -gt 0 ] && timeout "$T" "$PY" plugins/gpu_check.py bench --lib "$LIB" --out "$WORK" \
        > "$WORK/bench.log" 2>&1; then
        record benchmark ok "bench.json"
    else
        record benchmark FAILED "see bench.log (limit ${T} s)"; tail_log "$WORK/bench.log" 20
    fi
else
    record benchmark FAILED "no library built"
fi

# 5. compute-sanitizer -----------------------------------------------------------------------------------------
for tool in memcheck racecheck; do
    if [ "$DRY" = 1 ]; then
        skip_gpu "$tool" "compute-sanitizer --tool $tool on the small cases of test_kernels_gpu.SANITIZER_CASES"
    elif ! command -v compute-sanitizer > /dev/null 2>&1; then
        record "$tool" skipped "compute-sanitizer is not on PATH"
    elif [ -f "$LIB" ]; then
        T=$(limit 110)
        if [ "$T" -gt 0 ] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 KVX_GPU_CASES=sanitizer timeout "$T" \
            compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
            "$PY" -m pytest -q -p no:cacheprovider -x tests/plugins/test_kernels_gpu.py > "$WORK/sanitizer_$tool.log" 2>&1; then
            record "$tool" ok "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$WORK/sanitizer_$tool.log" | tail -n 1)"
        elif [ "$T" -eq 0 ]; then
            record "$tool" skipped "no time left in the budget"
        else
            record "$tool" FAILED "see sanitizer_$tool.log (limit ${T} s)"; tail_log "$WORK/sanitizer_$tool.log" 25
        fi
    fi
done

# 6. ncu -------------------------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    skip_gpu ncu "DRAM bytes of one LatentAttention launch"
elif ! command -v ncu > /dev/null 2>&1; then
    record ncu skipped "ncu is not on PATH"
elif [ -f "$LIB" ] && [ "$(limit 90)" -ge 60 ]; then
    if timeout "$(limit 90)" ncu --clock-control none --kernel-name regex:latent --launch-count 2 \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        "$PY" plugins/gpu_check.py one --lib "$LIB" > "$WORK/ncu.log" 2>&1; then
        record ncu ok "$(grep -E 'dram__bytes_read.sum' "$WORK/ncu.log" | head -n 1 | tr -s ' ')"
    else
        record ncu FAILED "see ncu.log"; tail_log "$WORK/ncu.log" 15
    fi
else
    record ncu skipped "no time left in the budget"
fi

# report -------------------------------------------------------------------------------------------------------
echo
"$PY" plugins/gpu_check.py report --steps "$STEPS" --out "$WORK" --gpu "${GPU:-no GPU}" \
    $([ "$DRY" = 1 ] && echo --dry-run) || FAILED=1
echo "total $(( $(date +%s) - START )) s; results in $WORK"
exit $FAILED
