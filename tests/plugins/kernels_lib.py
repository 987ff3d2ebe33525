# SPDX-License-Identifier: Apache-2.0
"""ctypes binding of libkvexport_kernels.so (the kvx_* C interface) for the GPU tests and scripts/gpu_check.sh.

The library is found through ``KVEXPORT_KERNELS_LIB``, then the usual build folders; :func:`build_kernels` compiles it
with nvcc (kernels only, no TensorRT, no CMake needed). Outputs are poisoned (0xFF bytes: NaN / -1) before every
call, so an element a kernel does not write fails the comparison. Imports torch only (no polygraphy, no kvexport).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = ("build/kernels", "build/plugins", "plugins/build", "build")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KERNEL_SOURCES = ("plugins/topk_gather/topKGatherKernel.cu", "plugins/latent_attention/latentAttentionKernel.cu")
ABI_VERSION = 2


class KvxDeviceInfo(ctypes.Structure):
    """plugins/common/kvxDevice.h."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "device", "smCount", "smemPerBlockOptin", "smemPerSM", "ccMajor", "ccMinor", "clockKHz", "memClockKHz",
        "memBusWidth", "l2Bytes")]


def find_kernels_lib() -> Path | None:
    env = os.environ.get("KVEXPORT_KERNELS_LIB")
    if env:
        return Path(env) if Path(env).exists() else None
    for d in CANDIDATES:
        for name in ("libkvexport_kernels.so", "libkvexport_plugins.so"):
            p = ROOT / d / name
            if p.exists():
                return p
    return None


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_kernels(out_dir: Path, arch: str | None = None, timeout: float = 420) -> Path:
    """nvcc the two kernel sources for ``arch`` (e.g. "90"; default: the current GPU's), in parallel, into a shared
    library."""
    from concurrent.futures import ThreadPoolExecutor

    if arch is None and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}"]

    def compile_one(src: str) -> Path:
        obj = out_dir / (Path(src).stem + ".o")
        r = subprocess.run([compiler, *flags, "-c", str(ROOT / src), "-o", str(obj)], capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src}:\n{r.stderr[-4000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=len(KERNEL_SOURCES)) as pool:
        objs = list(pool.map(compile_one, KERNEL_SOURCES))
    lib = out_dir / "libkvexport_kernels.so"
    r = subprocess.run([compiler, "-shared", *flags, *map(str, objs), "-o", str(lib)], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc link failed:\n{r.stderr[-4000:]}")
    return lib


def poisoned(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.numel():
        t.view(torch.uint8).fill_(0xFF)
    return t


class KernelsLib:
    """Typed wrappers around kvx_topk_gather / kvx_latent_attention taking torch CUDA tensors."""

    def __init__(self, path: Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        vp, i32, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t
        dev_p = ctypes.POINTER(KvxDeviceInfo)
        lib.kvx_abi_version.restype = i32
        if lib.kvx_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{self.path} has kvx ABI {lib.kvx_abi_version()}, expected {ABI_VERSION} (rebuild it)")
        lib.kvx_topk_gather.restype = i32
        lib.kvx_topk_gather.argtypes = [i32, vp, vp, vp, vp, *[i32] * 6, vp, vp, vp, vp, vp, sz, vp]
        lib.kvx_topk_gather_workspace_size.restype = sz
        lib.kvx_topk_gather_workspace_size.argtypes = [i32, i32, i32]
        lib.kvx_latent_attention.restype = i32
        lib.kvx_latent_attention.argtypes = [i32, vp, vp, vp, vp, *[i32] * 6, ctypes.c_float, vp, vp, sz, dev_p, vp]
        lib.kvx_latent_attention_v2.restype = i32
        lib.kvx_latent_attention_v2.argtypes = [i32, i32, vp, vp, vp, vp, vp, vp, *[i32] * 6, ctypes.c_float, vp, vp, sz,
                                                dev_p, vp]
        lib.kvx_latent_attention_workspace_size.restype = sz
        lib.kvx_latent_attention_workspace_size.argtypes = [i32] * 6
        lib.kvx_latent_attention_plan.restype = i32
        lib.kvx_latent_attention_plan.argtypes = [*[i32] * 7, dev_p, ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_double)]
        lib.kvx_latent_attention_plan_v2.restype = i32
        lib.kvx_latent_attention_plan_v2.argtypes = [*[i32] * 9, dev_p, ctypes.POINTER(i32),
                                                     ctypes.POINTER(ctypes.c_double)]
        lib.kvx_query_device.restype = i32
        lib.kvx_query_device.argtypes = [dev_p]
        self.lib = lib
        self.device = KvxDeviceInfo()
        rc = lib.kvx_query_device(ctypes.byref(self.device))
        if rc != 0:
            raise RuntimeError(f"kvx_query_device failed with cudaError {rc}")

    @staticmethod
    def _stream() -> ctypes.c_void_p:
        """torch's current CUDA stream; none for the CPU-shim build of the library (tests)."""
        if not torch.cuda.is_available():
            return ctypes.c_void_p(None)
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def topk_gather(self, scores, keys, values, positions, k: int, workspace=None):
        """TopKGather (docs/custom_ops.md): -> kept_keys, kept_values, kept_positions, kept_indices."""
        B, H, S = scores.shape
        Dk, Dv = keys.shape[-1], values.shape[-1]
        dev = scores.device
        kk = poisoned((B, H, k, Dk), keys.dtype, dev)
        kv = poisoned((B, H, k, Dv), values.dtype, dev)
        kp = poisoned((B, H, k), torch.int64, dev)
        ki = poisoned((B, H, k), torch.int64, dev)
        if workspace is None:
            workspace = poisoned((self.topk_workspace_size(B, H, S),), torch.uint8, dev)
        scores, keys, values, positions = (t.contiguous() for t in (scores, keys, values, positions))
        rc = self.lib.kvx_topk_gather(
            DTYPE_CODES[keys.dtype], scores.data_ptr(), keys.data_ptr(), values.data_ptr() if Dv else None,
            positions.data_ptr(), B, H, S, Dk, Dv, k, kk.data_ptr(), kv.data_ptr() if Dv else None, kp.data_ptr(),
            ki.data_ptr(), workspace.data_ptr(), workspace.numel(), self._stream())
        if rc != 0:
            raise RuntimeError(f"kvx_topk_gather failed with cudaError {rc}")
        return dict(kept_keys=kk, kept_values=kv, kept_positions=kp, kept_indices=ki)

    def topk_workspace_size(self, B: int, H: int, S: int) -> int:
        return int(self.lib.kvx_topk_gather_workspace_size(B, H, S))

    def workspace_size(self, B: int, H: int, T: int, S: int, D: int, R: int) -> int:
        return int(self.lib.kvx_latent_attention_workspace_size(B, H, T, S, D, R))

    def plan(self, dtype, B: int, H: int, T: int, S: int, D: int, R: int, latent_format: int = 0,
             new_latent: bool = False) -> dict:
        """The launch plan of a LatentAttention call on this GPU (path, tile, splits, modelled bytes); op version 2:
        ``latent_format`` 1 / 2 (quantized cache), ``new_latent`` (T new rows after the cache)."""
        p = (ctypes.c_int32 * 6)()
        b = (ctypes.c_double * 3)()
        rc = self.lib.kvx_latent_attention_plan_v2(DTYPE_CODES[dtype], int(latent_format), int(new_latent), B, H, T, S,
                                                   D, R, ctypes.byref(self.device), p, b)
        if rc != 0:
            raise RuntimeError(f"kvx_latent_attention_plan failed with cudaError {rc}")
        return dict(path=("simt", "mma")[p[0]], rows_per_block=p[1], tile_slots=p[2], threads=p[3], splits=p[4],
                    smem=p[5], latent_bytes=b[0], partial_bytes=b[1], model_seconds=b[2])

    def latent_attention(self, q, latent, q_positions, latent_positions, rank: int, scale: float, workspace=None,
                         out=None):
        """LatentAttention (docs/custom_ops.md): -> out (B, Hq, T, R)."""
        B, H, T, D = q.shape
        S = latent.shape[1]
        if out is None:
            out = poisoned((B, H, T, rank), q.dtype, q.device)
        if workspace is None:
            workspace = poisoned((self.workspace_size(B, H, T, S, D, rank),), torch.uint8, q.device)
        q, latent, q_positions, latent_positions = (t.contiguous() for t in (q, latent, q_positions, latent_positions))
        rc = self.lib.kvx_latent_attention(
            DTYPE_CODES[q.dtype], q.data_ptr(), latent.data_ptr(), q_positions.data_ptr(), latent_positions.data_ptr(),
            B, H, T, S, D, rank, float(scale), out.data_ptr(), workspace.data_ptr(), workspace.numel(),
            ctypes.byref(self.device), self._stream())
        if rc != 0:
            raise RuntimeError(f"kvx_latent_attention failed with cudaError {rc}")
        return out

    def latent_attention_v2(self, q, latent, q_positions, latent_positions, rank: int, scale: float, new_latent=None,
                            latent_scale=None, latent_format: int = 0, workspace=None, out=None):
        """LatentAttention op version 2 (docs/custom_ops.md): ``latent`` uint8 codes + ``latent_scale`` (B, S) float16
        for latent_format 1 (int8) / 2 (fp8), ``new_latent`` (B, T, D) attended after the cache -> out (B, Hq, T, R)."""
        B, H, T, D = q.shape
        S = latent.shape[1]
        if out is None:
            out = poisoned((B, H, T, rank), q.dtype, q.device)
        total = S + (T if new_latent is not None else 0)
        if workspace is None:
            workspace = poisoned((self.workspace_size(B, H, T, total, D, rank),), torch.uint8, q.device)
        q, latent, q_positions, latent_positions = (t.contiguous() for t in (q, latent, q_positions, latent_positions))
        new_latent = None if new_latent is None else new_latent.contiguous()
        latent_scale = None if latent_scale is None else latent_scale.contiguous()
        rc = self.lib.kvx_latent_attention_v2(
            DTYPE_CODES[q.dtype], int(latent_format), q.data_ptr(), latent.data_ptr(),
            None if latent_scale is None else latent_scale.data_ptr(),
            None if new_latent is None else new_latent.data_ptr(), q_positions.data_ptr(), latent_positions.data_ptr(),
            B, H, T, S, D, rank, float(scale), out.data_ptr(), workspace.data_ptr(), workspace.numel(),
            ctypes.byref(self.device), self._stream())
        if rc != 0:
            raise RuntimeError(f"kvx_latent_attention_v2 failed with cudaError {rc}")
        return out
