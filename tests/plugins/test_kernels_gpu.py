# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels (libkvexport_kernels.so, C interface via ctypes) against the PyTorch references.

TopKGather vs ``kvexport.cache.static_cache.select_kept`` + ``gather_slots`` (exact, ties included);
LatentAttention vs the pure-PyTorch contract of docs/custom_ops.md. Random inputs, fp32 / fp16 / bf16.
Skips without a CUDA GPU; builds the library with CMake (kernels only) when it is not found.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvexport.cache.static_cache import gather_slots, select_kept
from tests.plugins.kernels_lib import KernelsLib, build_kernels, find_kernels_lib, latent_attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> KernelsLib:
    path = find_kernels_lib()
    if path is None:
        try:
            path = build_kernels(tmp_path_factory.mktemp("kvx_build"))
        except Exception as e:  # noqa: BLE001 - no toolchain: skip with the reason
            pytest.skip(f"libkvexport_kernels.so not found and could not be built: {e}")
    return KernelsLib(path)


def _topk_inputs(B, H, S, Dk, Dv, score_dtype, dtype, ties, empty_frac, gen):
    dev = "cuda"
    if ties:  # few distinct values: many ties, broken towards the lower slot
        scores = torch.randint(0, 4, (B, H, S), generator=gen).to(score_dtype)
    else:
        scores = torch.randn(B, H, S, generator=gen).to(score_dtype)
    pos = torch.arange(S).expand(B, H, S).clone()
    pos[torch.rand(B, H, S, generator=gen) < empty_frac] = -1
    keys = torch.randn(B, H, S, Dk, generator=gen).to(dtype)
    values = torch.randn(B, H, S, Dv, generator=gen).to(dtype)
    return [t.to(dev) for t in (scores, keys, values, pos)]


@pytest.mark.parametrize("S,k", [(1, 1), (37, 5), (256, 256), (1000, 333), (4096, 1024), (8192, 4000)])
@pytest.mark.parametrize(
    "score_dtype,dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("ties", [False, True])
def test_topk_gather_matches_select_kept(lib, S, k, score_dtype, dtype, ties):
    gen = torch.Generator().manual_seed(S * 31 + k)
    B, H, Dk, Dv = 2, 3, 16, 8
    scores, keys, values, pos = _topk_inputs(B, H, S, Dk, Dv, score_dtype, dtype, ties, 0.2, gen)
    kk, kv, kp, ki = lib.topk_gather(scores, keys, values, pos, k)
    torch.cuda.synchronize()
    idx = select_kept(scores, pos, k)
    assert torch.equal(ki, idx)
    assert torch.equal(kp, gather_slots(pos, idx))
    assert torch.equal(kk, gather_slots(keys, idx))
    assert torch.equal(kv, gather_slots(values, idx))
    assert bool((ki[..., 1:] > ki[..., :-1]).all())  # ascending


def test_topk_gather_mla_values_empty(lib):
    gen = torch.Generator().manual_seed(0)
    scores, keys, values, pos = _topk_inputs(1, 1, 300, 96, 0, torch.float32, torch.float16, False, 0.1, gen)
    kk, kv, kp, ki = lib.topk_gather(scores, keys, values, pos, 100)
    idx = select_kept(scores, pos, 100)
    assert kv.shape == (1, 1, 100, 0)
    assert torch.equal(ki, idx) and torch.equal(kk, gather_slots(keys, idx))


def test_topk_gather_rejects_too_many_slots(lib):
    S = lib.max_slots + 1
    x = torch.zeros(1, 1, S, device="cuda")
    with pytest.raises(RuntimeError, match="cudaError"):
        lib.topk_gather(x, x[..., None], x[..., None], torch.zeros(1, 1, S, dtype=torch.long, device="cuda"), 1)


def _latent_inputs(B, H, T, S, R, Dr, dtype, gen, prefill):
    D = R + Dr
    q = torch.randn(B, H, T, D, generator=gen) * 0.5
    latent = torch.randn(B, S, D, generator=gen)
    lpos = torch.randperm(S, generator=gen).expand(B, S).clone()  # slots hold positions in any order
    lpos[torch.rand(B, S, generator=gen) < 0.15] = -1  # empty slots
    if prefill:
        qpos = torch.arange(S - T, S).expand(B, T).clone()
        qpos[0, 0] = -1  # a padding query
        if T > 1:
            qpos[-1, 1] = 0  # sees at most slot(s) holding position 0
    else:
        qpos = torch.full((B, T), S - 1)
        qpos[-1] = S // 2  # the last sequence sees only part of the cache
    return [t.to(dtype).cuda() if t.is_floating_point() else t.cuda() for t in (q, latent, qpos, lpos)]


TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.mark.parametrize("S", [1, 33, 1000, 4096])
@pytest.mark.parametrize("H,R,Dr", [(8, 64, 32), (32, 128, 32), (32, 512, 64), (4, 48, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_latent_attention_decode(lib, S, H, R, Dr, dtype):
    gen = torch.Generator().manual_seed(S + H + R)
    B, T = 2, 1
    q, latent, qpos, lpos = _latent_inputs(B, H, T, S, R, Dr, dtype, gen, prefill=False)
    scale = 1.0 / math.sqrt(R // 2 + Dr)
    out, mass = lib.latent_attention(q, latent, qpos, lpos, R, scale)
    torch.cuda.synchronize()
    ref_out, ref_mass = latent_attention_reference(q, latent, qpos, lpos, R, scale)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol * 10, rtol=rtol * 10)
    torch.testing.assert_close(mass, ref_mass, atol=1e-4 * H, rtol=max(rtol, 1e-4))
    torch.testing.assert_close(mass.sum(-1), torch.full((B,), float(H * T), device="cuda"), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("T,S", [(5, 64), (17, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_latent_attention_prefill(lib, T, S, dtype):
    gen = torch.Generator().manual_seed(T * S)
    B, H, R, Dr = 2, 8, 64, 32
    q, latent, qpos, lpos = _latent_inputs(B, H, T, S, R, Dr, dtype, gen, prefill=True)
    scale = 0.1
    out, mass = lib.latent_attention(q, latent, qpos, lpos, R, scale)
    torch.cuda.synchronize()
    ref_out, ref_mass = latent_attention_reference(q, latent, qpos, lpos, R, scale)
    valid = (qpos >= 0)[:, None, :, None].expand_as(out)  # padding queries are never read
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float()[valid], ref_out.float()[valid], atol=atol * 10, rtol=rtol * 10)
    torch.testing.assert_close(mass, ref_mass, atol=1e-4 * H * T, rtol=1e-3)


def test_latent_attention_unaligned_width(lib):
    """D not a multiple of 4 takes the scalar staging path."""
    gen = torch.Generator().manual_seed(7)
    q, latent, qpos, lpos = _latent_inputs(1, 6, 1, 130, 30, 5, torch.float32, gen, prefill=False)
    out, mass = lib.latent_attention(q, latent, qpos, lpos, 30, 0.2)
    ref_out, ref_mass = latent_attention_reference(q, latent, qpos, lpos, 30, 0.2)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mass, ref_mass, atol=1e-4, rtol=1e-4)


def test_latent_attention_rejects_rank_too_large(lib):
    q = torch.zeros(1, 1, 1, 600, device="cuda")
    with pytest.raises(RuntimeError, match="cudaError"):
        lib.latent_attention(
            q,
            torch.zeros(1, 4, 600, device="cuda"),
            torch.zeros(1, 1, dtype=torch.long, device="cuda"),
            torch.zeros(1, 4, dtype=torch.long, device="cuda"),
            513,
            0.1,
        )
