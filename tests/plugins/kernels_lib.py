# SPDX-License-Identifier: Apache-2.0
"""ctypes binding of libkvexport_kernels.so (the kvx_* C interface) for the GPU tests and scripts/gpu_check.sh.

The library is found through ``KVEXPORT_KERNELS_LIB``, then the usual build folders; ``build_kernels()`` builds it
with CMake (kernels only, no TensorRT) when it is missing.
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


def build_kernels(build_dir: Path, archs: str | None = None) -> Path:
    """cmake -DKVEXPORT_KERNELS_ONLY=ON; archs e.g. "90" (default: the current GPU's)."""
    if archs is None and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        archs = f"{major}{minor}"
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("cmake not found")
    cfg = [cmake, "-S", str(ROOT / "plugins"), "-B", str(build_dir), "-DKVEXPORT_KERNELS_ONLY=ON"]
    if archs:
        cfg.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
    subprocess.run(cfg, check=True, capture_output=True, text=True)
    subprocess.run(
        [cmake, "--build", str(build_dir), f"-j{os.cpu_count() or 2}"], check=True, capture_output=True, text=True
    )
    return build_dir / "libkvexport_kernels.so"


class KernelsLib:
    """Typed wrappers around kvx_topk_gather / kvx_latent_attention taking torch CUDA tensors."""

    def __init__(self, path: Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        vp, i32, i64p = ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p
        lib.kvx_topk_gather.restype = i32
        lib.kvx_topk_gather.argtypes = [
            i32,
            i32,
            vp,
            vp,
            vp,
            i64p,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            vp,
            vp,
            i64p,
            i64p,
            vp,
        ]
        lib.kvx_latent_attention.restype = i32
        lib.kvx_latent_attention.argtypes = [
            i32,
            vp,
            vp,
            i64p,
            i64p,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            ctypes.c_float,
            vp,
            vp,
            vp,
            ctypes.c_size_t,
            vp,
        ]
        lib.kvx_latent_attention_workspace_size.restype = ctypes.c_size_t
        lib.kvx_latent_attention_workspace_size.argtypes = [i32, i32, i32, i32, i32]
        lib.kvx_topk_gather_max_slots.restype = i32
        lib.kvx_abi_version.restype = i32
        self.lib = lib
        self.max_slots = lib.kvx_topk_gather_max_slots()

    @staticmethod
    def _stream() -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def topk_gather(self, scores, keys, values, positions, k: int):
        """TopKGather (docs/custom_ops.md): -> kept_keys, kept_values, kept_positions, kept_indices."""
        B, H, S = scores.shape
        Dk, Dv = keys.shape[-1], values.shape[-1]
        dev = scores.device
        kk = torch.empty(B, H, k, Dk, dtype=keys.dtype, device=dev)
        kv = torch.empty(B, H, k, Dv, dtype=values.dtype, device=dev)
        kp = torch.empty(B, H, k, dtype=torch.int64, device=dev)
        ki = torch.empty(B, H, k, dtype=torch.int64, device=dev)
        scores, keys, values, positions = (t.contiguous() for t in (scores, keys, values, positions))
        rc = self.lib.kvx_topk_gather(
            DTYPE_CODES[scores.dtype],
            DTYPE_CODES[keys.dtype],
            scores.data_ptr(),
            keys.data_ptr(),
            values.data_ptr() if Dv else None,
            positions.data_ptr(),
            B,
            H,
            S,
            Dk,
            Dv,
            k,
            kk.data_ptr(),
            kv.data_ptr() if Dv else None,
            kp.data_ptr(),
            ki.data_ptr(),
            self._stream(),
        )
        if rc != 0:
            raise RuntimeError(f"kvx_topk_gather failed with cudaError {rc}")
        return kk, kv, kp, ki

    def workspace_size(self, B: int, H: int, T: int, S: int, R: int) -> int:
        return int(self.lib.kvx_latent_attention_workspace_size(B, H, T, S, R))

    def latent_attention(self, q, latent, q_positions, latent_positions, rank: int, scale: float, workspace=None):
        """LatentAttention (docs/custom_ops.md): -> out (B, Hq, T, R), attn_mass (B, S) float32."""
        B, H, T, D = q.shape
        S = latent.shape[1]
        dev = q.device
        out = torch.empty(B, H, T, rank, dtype=q.dtype, device=dev)
        mass = torch.empty(B, S, dtype=torch.float32, device=dev)
        ws_bytes = self.workspace_size(B, H, T, S, rank)
        if workspace is None:
            workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
        q, latent, q_positions, latent_positions = (t.contiguous() for t in (q, latent, q_positions, latent_positions))
        rc = self.lib.kvx_latent_attention(
            DTYPE_CODES[q.dtype],
            q.data_ptr(),
            latent.data_ptr(),
            q_positions.data_ptr(),
            latent_positions.data_ptr(),
            B,
            H,
            T,
            S,
            D,
            rank,
            float(scale),
            out.data_ptr(),
            mass.data_ptr(),
            workspace.data_ptr(),
            workspace.numel(),
            self._stream(),
        )
        if rc != 0:
            raise RuntimeError(f"kvx_latent_attention failed with cudaError {rc}")
        return out, mass


def latent_attention_reference(q, latent, q_positions, latent_positions, rank: int, scale: float):
    """Pure-PyTorch LatentAttention per docs/custom_ops.md (float32 softmax, finfo.min masking).

    q (B, Hq, T, D), latent (B, S, D), q_positions (B, T), latent_positions (B, S) ->
    out (B, Hq, T, R) in q's dtype, attn_mass (B, S) float32 summed over heads and queries.
    """
    logits = torch.einsum("bhtd,bsd->bhts", q.float(), latent.float()) * scale
    lp = latent_positions[:, None, None, :]
    visible = (lp >= 0) & (lp <= q_positions[:, None, :, None])
    logits = logits.masked_fill(~visible, torch.finfo(torch.float32).min)
    p = logits.softmax(dim=-1)
    out = torch.einsum("bhts,bsr->bhtr", p, latent[..., :rank].float())
    return out.to(q.dtype), p.sum(dim=(1, 2))
