# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels, executed on the CPU: the unmodified plugins/**/*.cu built with g++ against the shim in
tests/plugins/cpu_shim (tests/plugins/cpu_kernels.py), run through their C entry points on every case of
kernel_cases (the GPU tests' cases plus larger, tied, special-valued and emulated-GPU ones), and compared with the
ONNX function bodies on onnxruntime and the PyTorch references.

- ``fast`` build: every case.
- AddressSanitizer + UndefinedBehaviorSanitizer build: the cases up to S = 1000 (and every TopKGather case up to
  S = 4096), so the whole module stays within a few minutes on two cores.
- ThreadSanitizer build (one OS thread per CUDA thread): a few small cases.
- Planted bugs: deliberately broken copies of the sources (an indexing change, a missing ``__syncthreads``, an early
  read of a cp.async tile, an out-of-bounds shared-memory write) must fail, each the way it should.

What the CPU path covers: every kernel and path of both plugins (TopKGather's radix-select kernels for any S, the
LatentAttention tensor-core kernel with mma.sync / ldmatrix / cp.async emulated per the PTX fragment layouts, its
CUDA-core kernel, the split combine), the launch planning for several emulated GPUs, and synchronisation (barrier
sites, warp masks, shared-memory poisoning, ThreadSanitizer). Not covered: timing, the device's rounding of exp and
of tensor-core accumulation order, occupancy and register limits (the GPU check covers those).
"""

from __future__ import annotations

import pytest

from tests.plugins import cpu_kernels, kernel_cases
from tests.plugins.cpu_kernels import CpuKernelError, Jobs
from tests.plugins.kernel_cases import LATENT_CASES, LATENT_V2_CASES, TOPK_CASES, LatentCase, LatentV2Case, TopKCase

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler (g++ or $CXX) for the CPU shim")

LA_SRC = "plugins/latent_attention/latentAttentionKernel.cu"
TK_SRC = "plugins/topk_gather/topKGatherKernel.cu"


@pytest.fixture(scope="session")
def fast_exe():
    return cpu_kernels.build("fast")


@pytest.fixture(scope="session")
def asan_exe():
    return cpu_kernels.build("asan")


@pytest.fixture(scope="session")
def tsan_exe():
    return cpu_kernels.build("tsan")


def run_topk(exe, case: TopKCase):
    inputs = case.inputs()
    jobs = Jobs()
    job = jobs.topk_gather(*inputs, case.k)
    jobs.run(exe)
    assert job.status == 0, f"{case.name}: kvx_topk_gather returned {job.status}"
    return inputs, job


def run_latent(exe, case: LatentCase):
    inputs = case.inputs()
    jobs = Jobs()
    if case.device:
        jobs.device(**case.device)
    job = jobs.latent_attention(*inputs, case.R, case.scale)
    jobs.run(exe)
    assert job.status == 0, f"{case.name}: kvx_latent_attention returned {job.status}"
    return inputs, job


def run_latent_v2(exe, case: LatentV2Case):
    inputs = case.inputs()
    q, latent, qpos, lpos, new, scale = inputs
    jobs = Jobs()
    if case.device:
        jobs.device(**case.device)
    job = jobs.latent_attention_v2(q, latent, qpos, lpos, case.R, case.scale, new_latent=new, latent_scale=scale,
                                   latent_format=case.fmt)
    jobs.run(exe)
    assert job.status == 0, f"{case.name}: kvx_latent_attention_v2 returned {job.status}"
    return inputs, job


# ------------------------------------------------------------------------------------------------ every case
@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: c.name)
def test_topk_gather(fast_exe, case):
    inputs, job = run_topk(fast_exe, case)
    kernel_cases.check_topk(case, inputs, job.outputs)


@pytest.mark.parametrize("case", LATENT_CASES, ids=lambda c: c.name)
def test_latent_attention(fast_exe, case):
    inputs, job = run_latent(fast_exe, case)
    if case.path is not None:
        assert job.plan["path"] == case.path, job.plan
    kernel_cases.check_latent(case, inputs, job.outputs["out"])


def test_latent_attention_paths_covered(fast_exe):
    """The cases reach both kernels, with and without split partials, and the plans respect the shared memory."""
    jobs, plans = Jobs(), []
    for case in LATENT_CASES:
        jobs.device(**({"sms": 132, "optin": 232448, "cc": "9.0"} | case.device))
        plans.append((case, jobs.latent_plan(case.dtype, case.B, case.H, case.T, case.S, case.R + case.Dr, case.R)))
    jobs.run(fast_exe)
    seen = set()
    for case, job in plans:
        assert job.status == 0, case.name
        seen.add((job.plan["path"], job.plan["splits"] > 1))
        assert job.plan["smem"] <= case.device.get("optin", 232448), (case.name, job.plan)
    assert {("mma", True), ("mma", False), ("simt", True)} <= seen, seen


@pytest.mark.parametrize("case", LATENT_V2_CASES, ids=lambda c: c.name)
def test_latent_attention_v2(fast_exe, case):
    """Op version 2: int8 / fp8 caches dequantized in the load path, new rows attended after the cache slots."""
    inputs, job = run_latent_v2(fast_exe, case)
    if case.path is not None:
        assert job.plan["path"] == case.path, job.plan
    kernel_cases.check_latent_v2(case, inputs, job.outputs["out"])


def test_latent_attention_v2_reaches_splits_and_one_split(fast_exe):
    """The version-2 cases cover split partials and single-split launches on both paths that they take."""
    jobs, runs = Jobs(), []
    for case in LATENT_V2_CASES:
        q, latent, qpos, lpos, new, scale = case.inputs()
        jobs.device(**({"sms": 132, "optin": 232448, "cc": "9.0"} | case.device))
        runs.append(jobs.latent_attention_v2(q, latent, qpos, lpos, case.R, case.scale, new, scale, case.fmt))
    jobs.run(fast_exe)
    seen = {(job.plan["path"], job.plan["splits"] > 1, case.fmt != 0) for case, job in zip(LATENT_V2_CASES, runs, strict=True)}
    assert {("simt", True, True), ("mma", True, True), ("mma", False, True), ("mma", True, False),
            ("simt", True, False)} <= seen, seen


@pytest.mark.parametrize("fmt,with_scale", [(3, True), (-1, True), (1, False), (2, False)])
def test_latent_attention_v2_rejects_bad_format(fast_exe, fmt, with_scale):
    """An unknown latent_format, or a quantized one without its scales, is refused (cudaErrorInvalidValue)."""
    torch = kernel_cases.torch
    jobs = Jobs()
    scale = torch.ones(1, 4, dtype=torch.float16) if with_scale else None
    job = jobs.latent_attention_v2(torch.zeros(1, 1, 1, 96, dtype=torch.float16), torch.zeros(1, 4, 96, dtype=torch.uint8),
                                   torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), 64, 0.1,
                                   latent_scale=scale, latent_format=fmt)
    jobs.run(fast_exe)
    assert job.status == 1
    assert bool(job.outputs["out"].isnan().all())  # nothing was launched: the poison is intact


def test_latent_attention_rejects_rank_too_large(fast_exe):
    """As on the GPU (test_kernels_gpu): rank 513 is refused with cudaErrorInvalidValue, nothing is launched."""
    z = kernel_cases.torch.zeros
    jobs = Jobs()
    job = jobs.latent_attention(z(1, 1, 1, 600), z(1, 4, 600), z(1, 1, dtype=kernel_cases.torch.long),
                                z(1, 4, dtype=kernel_cases.torch.long), 513, 0.1)
    jobs.run(fast_exe)
    assert job.status == 1


def test_topk_gather_rejects_k_above_slots(fast_exe):
    z = kernel_cases.torch.zeros
    jobs = Jobs()
    job = jobs.topk_gather(z(1, 1, 8), z(1, 1, 8, 1), z(1, 1, 8, 1), z(1, 1, 8, dtype=kernel_cases.torch.long), 9)
    jobs.run(fast_exe)
    assert job.status == 1


@pytest.mark.parametrize("name", ["S1000-k333-bfloat16-ties", "mla-no-values", "decode-S1000-H32-R512+64-float16",
                                  "prefill-T17-S700-float32", "int8-prefill-T5-S64-fp16-new", "fp8-every-code-fp32",
                                  "none-new-decode-S100-H8-fp16-mma"])
def test_gpu_harness_on_the_cpu_library(name):
    """The GPU tests' ctypes harness (kernels_lib.KernelsLib: signatures, workspace sizes, poisoned outputs) against
    the CPU build of the same C interface."""
    from tests.plugins.kernels_lib import KernelsLib

    lib = KernelsLib(cpu_kernels.build("fast", shared=True))
    case = next(c for c in TOPK_CASES + LATENT_CASES + LATENT_V2_CASES if c.name == name)
    inputs = case.inputs()
    if isinstance(case, LatentV2Case):
        q, latent, qpos, lpos, new, scale = inputs
        kernel_cases.check_latent_v2(case, inputs, lib.latent_attention_v2(
            q, latent, qpos, lpos, case.R, case.scale, new_latent=new, latent_scale=scale, latent_format=case.fmt))
    elif isinstance(case, TopKCase):
        kernel_cases.check_topk(case, inputs, lib.topk_gather(*inputs, case.k), with_onnx=False)
    else:
        assert lib.plan(case.dtype, case.B, case.H, case.T, case.S, case.R + case.Dr, case.R)["splits"] >= 1
        kernel_cases.check_latent(case, inputs, lib.latent_attention(*inputs, case.R, case.scale), with_onnx=False)


# ------------------------------------------------------------------------------------------------ sanitizers
ASAN_TOPK = [c for c in TOPK_CASES if c.S <= 4096]
ASAN_LATENT = [c for c in LATENT_CASES if c.S <= 1000 and c.H * c.T <= 64]
ASAN_LATENT_V2 = [c for c in LATENT_V2_CASES if c.S * c.H * c.T <= 8000]


@pytest.mark.parametrize("case", ASAN_TOPK, ids=lambda c: c.name)
def test_topk_gather_asan_ubsan(asan_exe, case):
    inputs, job = run_topk(asan_exe, case)
    kernel_cases.check_topk(case, inputs, job.outputs)


@pytest.mark.parametrize("case", ASAN_LATENT, ids=lambda c: c.name)
def test_latent_attention_asan_ubsan(asan_exe, case):
    inputs, job = run_latent(asan_exe, case)
    kernel_cases.check_latent(case, inputs, job.outputs["out"], with_onnx=False)


@pytest.mark.parametrize("case", ASAN_LATENT_V2, ids=lambda c: c.name)
def test_latent_attention_v2_asan_ubsan(asan_exe, case):
    inputs, job = run_latent_v2(asan_exe, case)
    kernel_cases.check_latent_v2(case, inputs, job.outputs["out"])


TSAN_CASES = [
    TopKCase("tsan-topk", 1, 1, 2100, 700, Dk=8, Dv=8, scores="ties"),
    LatentCase("tsan-mma-split", 1, 8, 1, 100, 64, 32, kernel_cases.torch.float16, path="mma"),
    LatentCase("tsan-mma-two-warps-per-row", 1, 16, 1, 40, 512, 64, kernel_cases.torch.bfloat16, path="mma"),
    LatentCase("tsan-simt", 1, 4, 1, 70, 48, 16, kernel_cases.torch.float32, path="simt"),
    LatentV2Case("tsan-mma-int8-new-two-warps", 1, 16, 1, 40, 512, 64, kernel_cases.torch.float16, path="mma"),
    LatentV2Case("tsan-simt-fp8-new", 1, 4, 2, 40, 48, 16, kernel_cases.torch.float32, fmt=2, path="simt"),
]


@pytest.mark.parametrize("case", TSAN_CASES, ids=lambda c: c.name)
def test_kernels_tsan(tsan_exe, case):
    if isinstance(case, TopKCase):
        inputs, job = run_topk(tsan_exe, case)
        kernel_cases.check_topk(case, inputs, job.outputs)
    elif isinstance(case, LatentV2Case):
        inputs, job = run_latent_v2(tsan_exe, case)
        kernel_cases.check_latent_v2(case, inputs, job.outputs["out"])
    else:
        inputs, job = run_latent(tsan_exe, case)
        kernel_cases.check_latent(case, inputs, job.outputs["out"], with_onnx=False)


# ------------------------------------------------------------------------------------------------ planted bugs
def _mismatch(exe, case) -> bool:
    """True when the case's outputs disagree with the references (the driver itself ran)."""
    try:
        if isinstance(case, TopKCase):
            inputs, job = run_topk(exe, case)
            kernel_cases.check_topk(case, inputs, job.outputs)
        elif isinstance(case, LatentV2Case):
            inputs, job = run_latent_v2(exe, case)
            kernel_cases.check_latent_v2(case, inputs, job.outputs["out"])
        else:
            inputs, job = run_latent(exe, case)
            kernel_cases.check_latent(case, inputs, job.outputs["out"], with_onnx=False)
    except AssertionError:
        return True
    return False


PLANTED = [
    pytest.param(TK_SRC, "(key >> (24 - 8 * PASS)) & 0xFFu", "(key >> (25 - 8 * PASS)) & 0xFFu",
                 TopKCase("planted", 1, 2, 3000, 900), id="topk-radix-digit-off-by-one"),
    pytest.param(TK_SRC, "int64_t const src = row * slots + sSlot[r];", "int64_t const src = row * slots + sOut[r];",
                 TopKCase("planted", 2, 2, 1500, 300, dtype=kernel_cases.torch.float16),
                 id="topk-gather-wrong-source-row"),
    pytest.param(LA_SRC, "((lane & 7) + ((lane >> 3) & 1) * 8) * a.ld", "((lane & 7) + ((lane >> 4) & 1) * 8) * a.ld",
                 LatentCase("planted", 1, 16, 1, 200, 128, 32, kernel_cases.torch.float16),
                 id="latent-mma-value-fragment-rows"),
    pytest.param(LA_SRC, "__syncthreads(); // P of every warp written", "// (barrier removed)",
                 LatentCase("planted", 1, 32, 1, 300, 512, 64, kernel_cases.torch.float16),
                 id="latent-mma-missing-syncthreads"),
    pytest.param(LA_SRC, "cpAsyncWait<1>();", "cpAsyncWait<2>();",
                 LatentCase("planted", 1, 8, 1, 500, 64, 32, kernel_cases.torch.bfloat16, device=dict(sms=1)),
                 id="latent-cp-async-read-before-wait"),
    pytest.param(LA_SRC, "int32_t const c = lane + 32 * i;\n            if (c < rank)",
                 "int32_t const c = lane + 32 * i + 1;\n            if (c < rank)",
                 LatentCase("planted", 1, 4, 1, 100, 64, 32, kernel_cases.torch.float32),
                 id="latent-simt-partial-column-shift"),
    pytest.param(LA_SRC, "static_cast<float>(code) - 128.0F", "static_cast<float>(code) - 127.0F",
                 LatentV2Case("planted", 1, 8, 1, 100, 64, 32, kernel_cases.torch.float16),
                 id="latent-v2-int8-offset"),
    pytest.param(LA_SRC, "((e + 120u) << 23)", "((e + 121u) << 23)",
                 LatentV2Case("planted", 1, 8, 1, 100, 64, 32, kernel_cases.torch.float16, fmt=2),
                 id="latent-v2-fp8-exponent-bias"),
    pytest.param(LA_SRC, "static_cast<float>(m) * 0.001953125F", "static_cast<float>(m) * 0.00390625F",
                 LatentV2Case("planted", 1, 4, 1, 100, 48, 16, kernel_cases.torch.float32, fmt=2, codes="small"),
                 id="latent-v2-fp8-subnormals"),
    pytest.param(LA_SRC, "__half2float(src.scale[b * S + slot])", "__half2float(src.scale[slot])",
                 LatentV2Case("planted", 2, 4, 1, 100, 48, 16, kernel_cases.torch.float32, codes="random"),
                 id="latent-v2-scale-row-of-batch-0"),
    pytest.param(LA_SRC, "a.latScale[b * a.cacheSlots + slot]", "a.latScale[slot]",
                 LatentV2Case("planted", 2, 4, 1, 100, 48, 16, kernel_cases.torch.float16, codes="random"),
                 id="latent-v2-mma-scale-row-of-batch-0"),
    pytest.param(LA_SRC, "lat[r * a.ld + c] = zero;", "(void)zero;",
                 LatentV2Case("planted", 1, 8, 1, 40, 64, 32, kernel_cases.torch.float16, new=False),
                 id="latent-v2-mma-tile-padding-not-zeroed"),
    pytest.param(LA_SRC, "qPos[b * queries + slot - S]", "qPos[b * queries]",
                 LatentV2Case("planted", 2, 4, 5, 40, 64, 16, kernel_cases.torch.float32),
                 id="latent-v2-simt-new-row-positions"),
    pytest.param(LA_SRC, "qpB + (slot - a.cacheSlots)", "qpB",
                 LatentV2Case("planted", 1, 4, 9, 40, 64, 16, kernel_cases.torch.float16, fmt=0),
                 id="latent-v2-mma-new-row-positions"),
]


@pytest.mark.parametrize("src,old,new,case", PLANTED)
def test_planted_bug_fails(src, old, new, case):
    """A broken copy of the kernel source fails the same checks the real one passes."""
    exe = cpu_kernels.build("fast", plant=(src, old, new))
    try:
        failed = _mismatch(exe, case)
    except CpuKernelError:
        failed = True  # the shim caught it (deadlock, bad barrier, out-of-range warp op)
    assert failed, f"planted change {old!r} -> {new!r} was not detected"


def test_planted_missing_syncthreads_found_by_tsan():
    exe = cpu_kernels.build("tsan", plant=(LA_SRC, "__syncthreads(); // P of every warp written", "// (removed)"))
    case = LatentCase("planted-tsan", 1, 16, 1, 40, 512, 64, kernel_cases.torch.float16)
    with pytest.raises(CpuKernelError, match="ThreadSanitizer: data race"):
        run_latent(exe, case)


def test_planted_missing_dequantize_barrier_found_by_tsan():
    """The barrier between dequantizing a quantized tile in shared memory and its ldmatrix reads (the fiber
    scheduling of the fast build runs every warp's share of the conversion before the first warp-collective
    returns, so only ThreadSanitizer's one-thread-per-CUDA-thread build sees the race)."""
    exe = cpu_kernels.build("tsan", plant=(LA_SRC, "__syncthreads(); // the dequantized rows visible to every warp",
                                           "// (removed)"))
    case = LatentV2Case("planted-tsan", 1, 16, 1, 40, 512, 64, kernel_cases.torch.float16, path="mma")  # 2 warps
    with pytest.raises(CpuKernelError, match="ThreadSanitizer: data race"):
        run_latent_v2(exe, case)


def test_planted_static_shared_overrun_found_by_ubsan():
    """The rewrite keeps a static __shared__ array's type, so UBSan bounds-checks its indexing."""
    exe = cpu_kernels.build("asan", plant=(TK_SRC, "sSlot[local] = j;", "sSlot[local + 1] = j;"))
    case = TopKCase("planted-ubsan", 1, 1, 1024, 1024, Dk=4, Dv=4, empty=0.0)
    with pytest.raises(CpuKernelError, match=r"runtime error: index 1024 out of bounds for type 'int \[1024\]'"):
        run_topk(exe, case)


def test_planted_dynamic_shared_overrun_found_by_asan():
    """Dynamic shared memory is allocated exactly, so a write past its end is a heap-buffer-overflow."""
    exe = cpu_kernels.build("asan", plant=(LA_SRC, "sRed[warp * 16 + g + 8] = lRun[1];",
                                           "sRed[warp * 16 + g + 16] = lRun[1];"))
    case = LatentCase("planted-asan", 1, 16, 1, 64, 512, 64, kernel_cases.torch.float16)
    with pytest.raises(CpuKernelError, match="AddressSanitizer: heap-buffer-overflow"):
        run_latent(exe, case)


def test_unmodified_sources_rewrite_mechanically():
    """Only __shared__ declarations and <<<>>> launches change; every other line is the original source."""
    for src in cpu_kernels.KERNEL_SOURCES:
        text = src.read_text()
        out, n_shared, n_launch = cpu_kernels.rewrite(text)
        assert n_shared == text.count("__shared__") and n_launch == text.count("<<<") > 0
        assert "__shared__" not in out and "<<<" not in out
        changed = [(a, b) for a, b in zip(text.splitlines(), out.splitlines(), strict=True) if a != b]
        assert all("__shared__" in a or "<<<" in a or ">>>" in a for a, _ in changed), changed
