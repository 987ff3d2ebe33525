# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels on a GPU (libkvexport_kernels.so through ctypes) against the references of kernel_cases.

Exactly the cases the CPU path runs in CI (tests/plugins/test_kernels_cpu.py; emulated-GPU settings do not apply
here, the real device plans the launch), and the same two rejections. Larger sizes are checked by the benchmark of
scripts/gpu_check.sh. Fresh random inputs, outputs poisoned before each call. Skips without a CUDA GPU; builds the
library with nvcc when it is not found (a build failure is a test failure, not a skip). Imports no polygraphy and
no TensorRT (runs on a bare GPU machine).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.plugins import kernel_cases
from tests.plugins.kernel_cases import LATENT_CASES, LATENT_V2_CASES, TOPK_CASES
from tests.plugins.kernels_lib import KernelsLib, build_kernels, find_kernels_lib, nvcc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

#: the cases scripts/gpu_check.sh runs under compute-sanitizer (small, one of each kernel path)
SANITIZER_CASES = ("S37-k5-float16-ties", "special-inf-nan-signed-zero", "decode-S33-H32-R512+64-float16",
                   "decode-S1000-H8-R64+32-bfloat16", "decode-S33-H4-R48+16-float32", "prefill-T5-S64-float16",
                   "int8-prefill-T5-S64-fp16-new", "fp8-every-code-fp32", "none-new-decode-S100-H8-fp16-mma")


def _selected(cases):
    """KVX_GPU_CASES: "sanitizer" (SANITIZER_CASES) or comma-separated case names; unset = every case."""
    sel = os.environ.get("KVX_GPU_CASES")
    if not sel:
        return cases
    names = set(SANITIZER_CASES) if sel == "sanitizer" else set(sel.split(","))
    return [c for c in cases if c.name in names]


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> KernelsLib:
    path = find_kernels_lib()
    if path is None:
        if nvcc() is None:
            pytest.skip("libkvexport_kernels.so not found and nvcc is not installed")
        path = build_kernels(tmp_path_factory.mktemp("kvx_build"))
    return KernelsLib(path)


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return t.cuda()


@pytest.mark.parametrize("case", _selected(TOPK_CASES), ids=lambda c: c.name)
def test_topk_gather(lib, case):
    inputs = [_cuda(t) for t in case.inputs()]
    outputs = lib.topk_gather(*inputs, case.k)
    torch.cuda.synchronize()
    kernel_cases.check_topk(case, inputs, outputs, with_onnx=os.environ.get("KVX_GPU_ONNX") == "1")


@pytest.mark.parametrize("case", _selected(LATENT_CASES), ids=lambda c: c.name)
def test_latent_attention(lib, case):
    inputs = [_cuda(t) for t in case.inputs()]
    out = lib.latent_attention(*inputs, case.R, case.scale)
    torch.cuda.synchronize()
    kernel_cases.check_latent(case, inputs, out, with_onnx=os.environ.get("KVX_GPU_ONNX") == "1")


@pytest.mark.parametrize("case", _selected(LATENT_V2_CASES), ids=lambda c: c.name)
def test_latent_attention_v2(lib, case):
    """Op version 2: int8 / fp8 caches dequantized in the load path, new rows after the cache slots."""
    inputs = [None if t is None else _cuda(t) for t in case.inputs()]
    q, latent, qpos, lpos, new, scale = inputs
    out = lib.latent_attention_v2(q, latent, qpos, lpos, case.R, case.scale, new_latent=new, latent_scale=scale,
                                  latent_format=case.fmt)
    torch.cuda.synchronize()
    kernel_cases.check_latent_v2(case, inputs, out)


def test_latent_attention_rejects_rank_too_large(lib):
    q = torch.zeros(1, 1, 1, 600, device="cuda")
    with pytest.raises(RuntimeError, match="cudaError"):
        lib.latent_attention(q, torch.zeros(1, 4, 600, device="cuda"), torch.zeros(1, 1, dtype=torch.long, device="cuda"),
                             torch.zeros(1, 4, dtype=torch.long, device="cuda"), 513, 0.1)


def test_topk_gather_rejects_k_above_slots(lib):
    x = torch.zeros(1, 1, 8, device="cuda")
    with pytest.raises(RuntimeError, match="cudaError"):
        lib.topk_gather(x, x[..., None], x[..., None], torch.zeros(1, 1, 8, dtype=torch.long, device="cuda"), 9)
