# SPDX-License-Identifier: Apache-2.0
"""The kernel test cases, shared by the CPU path (test_kernels_cpu.py) and the GPU tests (test_kernels_gpu.py), and
their two independent references: the op's ONNX function body (kvexport.ops) on onnxruntime for fp32 / fp16,
and the PyTorch reference (``kvexport.ops.topk_gather.topk_gather``, ``latent_attention_reference``) for every dtype.

Inputs are made on the CPU from a seed (the GPU tests move them to the device); outputs the kernels do not write
come back as the 0xFF poison (NaN / -1) and fail the checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from kvexport import ops

_ONNX_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.uint8: TensorProto.UINT8}


def _session(node, inputs, outputs) -> ort.InferenceSession:
    g = helper.make_graph([node], "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ops.OPSET), helper.make_opsetid(ops.DOMAIN, ops.OP_VERSION)],
                          functions=ops.function_protos())
    m.ir_version = 10
    ops.register_schemas()
    onnx.checker.check_model(m, full_check=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


# --------------------------------------------------------------------------------------------------- TopKGather
@dataclass(frozen=True)
class TopKCase:
    """scores (B, H, S) float32, keys (B, H, S, Dk) and values (B, H, S, Dv) in ``dtype``, positions (B, H, S)."""

    name: str
    B: int
    H: int
    S: int
    k: int
    Dk: int = 16
    Dv: int = 8
    dtype: torch.dtype = torch.float32
    scores: str = "randn"  # randn | ties (4 values) | equal (one value) | special (+-inf, NaN, +-0)
    empty: float = 0.2  # fraction of empty slots (position -1)
    seed: int = 0

    def inputs(self):
        g = torch.Generator().manual_seed(self.seed * 7919 + self.S * 31 + self.k)
        shape = (self.B, self.H, self.S)
        if self.scores == "ties":
            s = torch.randint(0, 4, shape, generator=g).float()
        elif self.scores == "equal":
            s = torch.full(shape, 0.5)
        elif self.scores == "special":
            s = torch.randn(shape, generator=g)
            pick = torch.randint(0, 6, shape, generator=g)
            specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.0])
            s = torch.where(torch.rand(shape, generator=g) < 0.3, specials[pick], s)
        else:
            s = torch.randn(shape, generator=g)
        pos = torch.arange(self.S).expand(*shape).clone()
        pos[torch.rand(shape, generator=g) < self.empty] = -1
        if self.dtype == torch.uint8:  # a quantized cache's codes: every byte value
            keys = torch.randint(0, 256, (*shape, self.Dk), generator=g).to(torch.uint8)
            values = torch.randint(0, 256, (*shape, self.Dv), generator=g).to(torch.uint8)
            return s, keys, values, pos
        keys = torch.randn(*shape, self.Dk, generator=g).to(self.dtype)
        values = torch.randn(*shape, self.Dv, generator=g).to(self.dtype)
        return s, keys, values, pos


def _topk_cases() -> list[TopKCase]:
    cases = []
    # the GPU tests' grid: sizes up to the old 8192 limit, every key dtype, ties or not
    for S, k in [(1, 1), (37, 5), (256, 256), (1000, 333), (4096, 1024), (8192, 4000)]:
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for ties in (False, True):
                cases.append(TopKCase(f"S{S}-k{k}-{str(dt)[6:]}-{'ties' if ties else 'randn'}", 2, 3, S, k, dtype=dt,
                                      scores="ties" if ties else "randn"))
    cases += [
        TopKCase("S20000-k5000-beyond-old-limit", 1, 2, 20000, 5000, dtype=torch.float16),
        TopKCase("S70000-k3-one-row-many-blocks", 1, 1, 70000, 3, Dk=4, Dv=4, scores="ties"),
        TopKCase("S3000-all-equal-ties-across-blocks", 1, 2, 3000, 1500, scores="equal", empty=0.1),
        TopKCase("special-inf-nan-signed-zero", 2, 2, 300, 100, scores="special"),
        TopKCase("special-k-small", 1, 3, 2050, 7, scores="special", empty=0.4),
        TopKCase("all-empty", 1, 2, 50, 10, empty=1.0),
        TopKCase("k-equals-S-with-empties", 2, 1, 129, 129, empty=0.5),
        TopKCase("mla-no-values", 1, 1, 300, 100, Dk=96, Dv=0, dtype=torch.float16, empty=0.1),
        TopKCase("odd-widths", 2, 2, 500, 77, Dk=3, Dv=5, dtype=torch.float16),
        TopKCase("batch-heads", 4, 8, 1030, 512, Dk=8, Dv=8, dtype=torch.bfloat16, scores="ties"),
        # a quantized cache's uint8 codes (int8 / fp8, issue 18): 16-byte vectors, byte copies, an MLA latent
        TopKCase("uint8-codes", 2, 3, 1000, 333, Dk=32, Dv=16, dtype=torch.uint8, scores="ties"),
        TopKCase("uint8-odd-widths", 2, 2, 500, 77, Dk=3, Dv=5, dtype=torch.uint8),
        TopKCase("uint8-mla-no-values", 1, 1, 2100, 700, Dk=36, Dv=0, dtype=torch.uint8, empty=0.1),
    ]
    return cases


TOPK_CASES = _topk_cases()


def topk_onnx(scores, keys, values, positions, k):
    """The ONNX function body of kvexport::TopKGather on onnxruntime (fp32 / fp16 keys), or None (bf16)."""
    if keys.dtype not in _ONNX_TYPES:
        return None
    B, H, S = scores.shape
    Dk, Dv = keys.shape[-1], values.shape[-1]
    t = _ONNX_TYPES[keys.dtype]
    vi = helper.make_tensor_value_info
    node = ops.make_node("TopKGather", ["scores", "keys", "values", "positions"],
                         ["kept_keys", "kept_values", "kept_positions", "kept_indices"], k=k)
    sess = _session(node, [vi("scores", TensorProto.FLOAT, [B, H, S]), vi("keys", t, [B, H, S, Dk]),
                           vi("values", t, [B, H, S, Dv]), vi("positions", TensorProto.INT64, [B, H, S])],
                    [vi("kept_keys", t, [B, H, k, Dk]), vi("kept_values", t, [B, H, k, Dv]),
                     vi("kept_positions", TensorProto.INT64, [B, H, k]),
                     vi("kept_indices", TensorProto.INT64, [B, H, k])])
    outs = sess.run(None, {"scores": _np(scores), "keys": _np(keys), "values": _np(values),
                           "positions": _np(positions)})
    return [torch.from_numpy(o) for o in outs]


def check_topk(case: TopKCase, inputs, outputs: dict, with_onnx: bool = True) -> None:
    """Exact agreement of kept indices (ascending), positions, keys and values with both references."""
    names = ("kept_keys", "kept_values", "kept_positions", "kept_indices")
    want = [w.cpu() for w in ops.topk_gather.topk_gather(*inputs, case.k)]  # on the inputs' device
    got = [outputs[n].cpu() for n in names]
    for name, g, w in zip(names, got, want, strict=True):
        assert g.shape == w.shape and torch.equal(g, w), f"{case.name}: {name} differs from the PyTorch reference"
    assert bool((got[3][..., 1:] > got[3][..., :-1]).all()), f"{case.name}: kept_indices not ascending"
    scores, keys, values, positions = (t.cpu() for t in inputs)
    if not with_onnx or torch.isnan(scores).any():
        return  # NaN order is the PyTorch contract (above +inf); ONNX TopK leaves it unspecified
    onnx_out = topk_onnx(scores, keys, values, positions, case.k)
    if onnx_out is not None:
        for name, g, w in zip(names, got, onnx_out, strict=True):
            assert torch.equal(g, w), f"{case.name}: {name} differs from the ONNX function on onnxruntime"


# --------------------------------------------------------------------------------------------------- LatentAttention
@dataclass(frozen=True)
class LatentCase:
    """q (B, H, T, R + Dr), latent (B, S, R + Dr) in ``dtype``; ``device`` emulates another GPU on the CPU path."""

    name: str
    B: int
    H: int
    T: int
    S: int
    R: int
    Dr: int
    dtype: torch.dtype
    prefill: bool = False
    q_scale: float = 0.5
    seed: int = 0
    device: dict = field(default_factory=dict)  # CPU shim only: sms / optin / cc
    path: str | None = None  # expected kernel path on the CPU shim ("mma" / "simt"), None = not checked

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.R // 2 + self.Dr)

    def inputs(self):
        g = torch.Generator().manual_seed(self.seed * 7919 + self.S + self.H + self.R)
        D = self.R + self.Dr
        q = torch.randn(self.B, self.H, self.T, D, generator=g) * self.q_scale
        latent = torch.randn(self.B, self.S, D, generator=g)
        lpos = torch.randperm(self.S, generator=g).expand(self.B, self.S).clone()  # slots hold positions in any order
        lpos[torch.rand(self.B, self.S, generator=g) < 0.15] = -1  # empty slots
        if self.prefill:
            qpos = torch.arange(self.S - self.T, self.S).expand(self.B, self.T).clone()
            qpos[0, 0] = -1  # a padding query
            if self.T > 1:
                qpos[-1, 1] = 0  # sees at most the slot(s) holding position 0
        else:
            qpos = torch.full((self.B, self.T), self.S - 1)
            qpos[-1] = self.S // 2  # the last sequence sees only part of the cache
        return q.to(self.dtype), latent.to(self.dtype), qpos, lpos


def _latent_cases() -> list[LatentCase]:
    cases = []
    # the GPU tests' decode grid
    for S in (1, 33, 1000, 4096):
        for H, R, Dr in ((8, 64, 32), (32, 128, 32), (32, 512, 64), (4, 48, 16)):
            for dt in (torch.float32, torch.float16, torch.bfloat16):
                cases.append(LatentCase(f"decode-S{S}-H{H}-R{R}+{Dr}-{str(dt)[6:]}", 2, H, 1, S, R, Dr, dt,
                                        path="simt" if dt == torch.float32 else "mma"))
    for T, S in ((5, 64), (17, 700)):
        for dt in (torch.float32, torch.float16):
            cases.append(LatentCase(f"prefill-T{T}-S{S}-{str(dt)[6:]}", 2, 8, T, S, 64, 32, dt, prefill=True,
                                    q_scale=0.3))
    cases += [
        LatentCase("unaligned-width-fp32", 1, 6, 1, 130, 30, 5, torch.float32, path="simt"),
        LatentCase("unaligned-width-fp16-falls-back", 1, 6, 1, 130, 30, 5, torch.float16, path="simt"),
        LatentCase("width-not-multiple-of-16-fp16", 2, 8, 1, 200, 40, 10, torch.float16, path="mma"),
        LatentCase("heads128-R512+64-two-row-tiles", 1, 128, 1, 160, 512, 64, torch.float16, path="mma"),
        LatentCase("heads128-R128+32-bf16", 1, 128, 1, 300, 128, 32, torch.bfloat16, path="mma"),
        LatentCase("large-logits", 1, 16, 1, 500, 128, 32, torch.float16, q_scale=3.0, path="mma"),
        LatentCase("one-split-small-gpu", 2, 32, 1, 600, 512, 64, torch.float16, device=dict(sms=2), path="mma"),
        LatentCase("99KiB-smem-gpu-R512", 1, 32, 1, 700, 512, 64, torch.bfloat16,
                   device=dict(optin=101376, cc="8.6"), path="mma"),
        LatentCase("no-tensor-cores-sm75", 1, 8, 1, 300, 64, 32, torch.float16, device=dict(cc="7.5"),
                   path="simt"),
        LatentCase("prefill-T40-mma-rows", 1, 4, 40, 90, 64, 16, torch.bfloat16, prefill=True, path="mma"),
    ]
    return cases


LATENT_CASES = _latent_cases()

#: atol = rtol per dtype, against either reference (fp16/bf16: inputs rounded, probabilities rounded as the reference)
LATENT_TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def latent_onnx(q, latent, qpos, lpos, rank, scale):
    """The ONNX function body of kvexport::LatentAttention on onnxruntime (fp32 / fp16), or None (bf16)."""
    if q.dtype not in _ONNX_TYPES:
        return None
    B, H, T, D = q.shape
    S = latent.shape[1]
    t = _ONNX_TYPES[q.dtype]
    vi = helper.make_tensor_value_info
    node = ops.make_node("LatentAttention", ["q", "latent", "q_positions", "latent_positions"], ["out"], rank=rank,
                         scale=scale)
    sess = _session(node, [vi("q", t, [B, H, T, D]), vi("latent", t, [B, S, D]),
                           vi("q_positions", TensorProto.INT64, [B, T]),
                           vi("latent_positions", TensorProto.INT64, [B, S])], [vi("out", t, [B, H, T, rank])])
    (out,) = sess.run(None, {"q": _np(q), "latent": _np(latent), "q_positions": _np(qpos),
                             "latent_positions": _np(lpos)})
    return torch.from_numpy(out)


def check_latent(case: LatentCase, inputs, out: torch.Tensor, with_onnx: bool = True) -> None:
    """Agreement with the PyTorch reference and (fp32 / fp16) the ONNX function body within LATENT_TOL."""
    want = ops.latent_attention_reference(*inputs, case.R, case.scale).cpu()  # on the inputs' device
    q, latent, qpos, lpos = (t.cpu() for t in inputs)
    out = out.cpu()
    assert out.dtype == q.dtype and out.shape == (case.B, case.H, case.T, case.R)
    valid = (qpos >= 0)[:, None, :, None].expand_as(out)  # padding queries are never read
    tol = LATENT_TOL[case.dtype]
    torch.testing.assert_close(out.float()[valid], want.float()[valid], atol=tol, rtol=tol,
                               msg=lambda m: f"{case.name} vs PyTorch reference: {m}")
    if with_onnx:
        onnx_out = latent_onnx(q, latent, qpos, lpos, case.R, case.scale)
        if onnx_out is not None:
            torch.testing.assert_close(out.float()[valid], onnx_out.float()[valid], atol=tol, rtol=tol,
                                       msg=lambda m: f"{case.name} vs ONNX function on onnxruntime: {m}")


# ------------------------------------------------------------------------------ LatentAttention version 2 (issue 18)
@dataclass(frozen=True)
class LatentV2Case:
    """Op version 2: a quantized cache (``fmt`` 1 int8 / 2 fp8: uint8 codes + (B, S) float16 scales, made by
    kvexport.cache.quant.quantize, or every byte value when ``codes="random"``) and / or ``new`` rows (B, T, D) at
    the queries' positions, attended after the cache. Cache positions 0 .. S-1 in a random slot order (``empty``:
    fraction of empty slots); queries at S .. S+T-1 (prefill: the new rows are causal among themselves), query 0 of
    sequence 0 is padding (-1) when ``pad``; the last sequence sees half of the cache."""

    name: str
    B: int
    H: int
    T: int
    S: int
    R: int
    Dr: int
    dtype: torch.dtype
    fmt: int = 1
    new: bool = True
    codes: str = "quantize"  # quantize | random | small (fp8 subnormals and the lowest binade, large scales)
    empty: float = 0.15
    pad: bool = True
    seed: int = 0
    device: dict = field(default_factory=dict)
    path: str | None = None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.R // 2 + self.Dr)

    def inputs(self):
        """-> (q, latent, q_positions, latent_positions, new_latent or None, latent_scale or None)."""
        from kvexport.cache.formats import FORMATS
        from kvexport.cache.quant import quantize

        g = torch.Generator().manual_seed(self.seed * 7919 + self.S * 13 + self.H + self.R + self.fmt)
        B, T, S, D = self.B, self.T, self.S, self.R + self.Dr
        q = (torch.randn(B, self.H, T, D, generator=g) * 0.5).to(self.dtype)
        rows = torch.randn(B, S, D, generator=g) * 2.0
        scale = None
        if self.fmt == 0:
            latent = rows.to(self.dtype)
        elif self.codes == "random":  # every bit pattern but the fp8 NaNs (0x7F / 0xFF), scales over a wide range
            latent = torch.randint(0, 256, (B, S, D), generator=g).to(torch.uint8)
            if self.fmt == 2:
                latent[(latent & 0x7F) == 0x7F] = 0x7E
            scale = (torch.rand(B, S, generator=g) * 0.02 + 2.0**-14).to(torch.float16)
        elif self.codes == "small":
            latent = (torch.randint(0, 16, (B, S, D), generator=g) | (torch.randint(0, 2, (B, S, D), generator=g) << 7))
            latent = latent.to(torch.uint8)
            scale = (torch.rand(B, S, generator=g) * 20.0 + 20.0).to(torch.float16)
        else:
            latent, scale = quantize(rows, FORMATS[ops.LATENT_FORMATS[self.fmt]])
        lpos = torch.randperm(S, generator=g).expand(B, S).clone()
        lpos[torch.rand(B, S, generator=g) < self.empty] = -1
        qpos = torch.arange(S, S + T).expand(B, T).clone()
        qpos[-1] = torch.arange(S // 2, S // 2 + T)
        if self.pad and B * T > 1:
            qpos[0, 0] = -1
        new = (torch.randn(B, T, D, generator=g) * 2.0).to(self.dtype) if self.new else None
        return q, latent, qpos, lpos, new, scale


LATENT_V2_CASES = [
    # quantized caches: the tensor-core path stages the codes by cp.async and dequantizes them in shared memory; the
    # CUDA-core path (fp32, widths without a 4-byte chunk, pre-sm_80) dequantizes while staging its float32 tiles
    LatentV2Case("int8-decode-S300-H16-R512+64-fp16-new", 2, 16, 1, 300, 512, 64, torch.float16, path="mma"),
    LatentV2Case("fp8-decode-S333-H8-R64+32-bf16-new", 3, 8, 1, 333, 64, 32, torch.bfloat16, fmt=2, path="mma"),
    LatentV2Case("int8-decode-S130-H4-R48+16-fp32-no-new", 2, 4, 1, 130, 48, 16, torch.float32, new=False,
                 path="simt"),
    LatentV2Case("fp8-decode-S100-H8-R128+32-fp16-no-new", 1, 8, 1, 100, 128, 32, torch.float16, fmt=2, new=False,
                 path="mma"),
    LatentV2Case("int8-prefill-T5-S64-fp16-new", 2, 8, 5, 64, 64, 32, torch.float16, path="mma"),
    LatentV2Case("fp8-prefill-T17-S70-fp32-new", 2, 4, 17, 70, 64, 16, torch.float32, fmt=2, path="simt"),
    LatentV2Case("int8-odd-width-D35-fp16-simt", 2, 6, 2, 130, 30, 5, torch.float16, path="simt"),
    LatentV2Case("int8-width-D40-fp16-mma-8-byte-chunks", 2, 8, 1, 200, 32, 8, torch.float16, path="mma"),
    LatentV2Case("fp8-every-code-fp32", 2, 4, 1, 200, 48, 16, torch.float32, fmt=2, codes="random", path="simt"),
    LatentV2Case("fp8-every-code-fp16-mma", 2, 4, 1, 200, 48, 16, torch.float16, fmt=2, codes="random", path="mma"),
    LatentV2Case("fp8-subnormal-codes-fp32", 1, 4, 1, 100, 48, 16, torch.float32, fmt=2, codes="small"),
    LatentV2Case("fp8-subnormal-codes-bf16-mma", 1, 4, 1, 100, 48, 16, torch.bfloat16, fmt=2, codes="small",
                 path="mma"),
    LatentV2Case("int8-every-code-bf16", 1, 4, 1, 100, 48, 16, torch.bfloat16, codes="random", path="mma"),
    LatentV2Case("int8-S1-one-slot", 2, 8, 1, 1, 64, 32, torch.float16, path="mma"),
    LatentV2Case("fp8-all-slots-empty-sees-only-new", 2, 4, 3, 50, 64, 32, torch.float16, fmt=2, empty=1.0,
                 path="mma"),
    LatentV2Case("int8-one-split-small-gpu", 1, 32, 1, 200, 512, 64, torch.bfloat16, device=dict(sms=1), path="mma"),
    # R = 512 + 64 on a 99 KiB part: the two code stages (36 KiB) do not fit next to the tiles -> CUDA-core path
    LatentV2Case("fp8-99KiB-smem-gpu-R512-simt", 1, 32, 1, 150, 512, 64, torch.float16, fmt=2,
                 device=dict(optin=101376, cc="8.6"), path="simt"),
    LatentV2Case("int8-99KiB-smem-gpu-R128-mma", 1, 32, 1, 150, 128, 32, torch.float16,
                 device=dict(optin=101376, cc="8.6"), path="mma"),
    LatentV2Case("int8-no-tensor-cores-sm75", 1, 8, 1, 120, 64, 32, torch.float16, device=dict(cc="7.5"),
                 path="simt"),
    LatentV2Case("int8-heads128-two-row-tiles-bf16", 1, 128, 1, 70, 128, 32, torch.bfloat16, path="mma"),
    # new rows over an unquantized cache: the tensor-core path streams them after the cache slots
    LatentV2Case("none-new-decode-S100-H8-fp16-mma", 2, 8, 1, 100, 64, 32, torch.float16, fmt=0, path="mma"),
    LatentV2Case("none-new-decode-S1000-H32-R512+64-bf16-mma", 1, 32, 1, 1000, 512, 64, torch.bfloat16, fmt=0,
                 path="mma"),
    LatentV2Case("none-new-prefill-T40-S90-bf16-mma-rows", 1, 4, 40, 90, 64, 16, torch.bfloat16, fmt=0,
                 path="mma"),
    LatentV2Case("none-new-S31-tile-boundary-fp16-mma", 2, 8, 3, 31, 128, 32, torch.float16, fmt=0, path="mma"),
    LatentV2Case("none-new-prefill-T17-S70-fp32-simt", 2, 4, 17, 70, 64, 16, torch.float32, fmt=0, path="simt"),
    LatentV2Case("none-new-unaligned-fp16-simt", 1, 6, 2, 130, 30, 5, torch.float16, fmt=0, path="simt"),
]

#: the same tolerances as version 1: the kernel dequantizes to q's dtype exactly as the reference does, so the
#: quantization error itself is common to both sides
LATENT_V2_TOL = LATENT_TOL


def check_latent_v2(case: LatentV2Case, inputs, out: torch.Tensor) -> None:
    """Agreement with the PyTorch reference ``latent_attention_reference`` (independent of the kernel: it
    dequantizes with kvexport.cache.quant.dequantize and concatenates the logits of both parts)."""
    q, latent, qpos, lpos, new, scale = (None if t is None else t.cpu() for t in inputs)
    want = ops.latent_attention_reference(q, latent, qpos, lpos, case.R, case.scale, new_latent=new,
                                          latent_scale=scale, latent_format=case.fmt)
    out = out.cpu()
    assert out.dtype == q.dtype and out.shape == (case.B, case.H, case.T, case.R)
    valid = (qpos >= 0)[:, None, :, None].expand_as(out)
    tol = LATENT_V2_TOL[case.dtype]
    torch.testing.assert_close(out.float()[valid], want.float()[valid], atol=tol, rtol=tol,
                               msg=lambda m: f"{case.name} vs PyTorch reference: {m}")
