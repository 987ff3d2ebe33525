# SPDX-License-Identifier: Apache-2.0
"""The in-place decode step's attention, exported as onnxruntime's ``com.microsoft::GroupQueryAttention``: one decode
token rotated, written into the cache at its slot and attended (``decode_inplace.ort.onnx``, onnxruntime on the CPU
only; TensorRT runs decode.onnx).

All of the op in one place: its reference (:func:`cache_step_attention_reference`, the contract of
GroupQueryAttention as the graph uses it), the PyTorch op ``torch.ops.kvexport.cache_step_attention`` the in-place
decode graph traces, the schema kvexport registers so onnx checks that graph, and the translation to the contrib
node. No plugin: TensorRT never sees it.
"""

from __future__ import annotations

import onnx
import torch
from onnx import defs

from kvexport.ops.common import FLOATS, ORT_DOMAIN

NAME = "GroupQueryAttention"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's half-split RoPE partner (x1, x2) -> (-x2, x1): the rotation GroupQueryAttention's ``do_rotary`` applies
    (interleaved 0), part of this op's contract."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def cache_step_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                                   v_cache: torch.Tensor, bias: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                                   sin: torch.Tensor, scale: float, num_heads: int, kv_num_heads: int):
    """One decode token rotated, written into the cache and attended (the in-place decode graph's attention; the
    contract of onnxruntime's GroupQueryAttention as the graph uses it).

    q (B, 1, Hq * D), k_new / v_new (B, 1, Hc * D): the token's projections before RoPE; k_cache / v_cache
    (B, Hc, S, D) post-RoPE keys and values; bias (B, Hq, 1, S) additive, in q's dtype: 0 where query head h may
    see slot j, a large negative number where not (the caller makes it from
    :func:`kvexport.cache.visibility.visible`, the one visibility rule); slots (B,) int32: the slot the token goes
    to (plan rule 4: the layer's fill); cos / sin (B, D/2): the token's rotation (HF's half-split RoPE over the whole
    head, attention scaling included: :meth:`kvexport.models.rope.Rotary.cos_sin`'s first half).
    -> out (B, 1, Hq * D) = softmax(scale · q·Kᵀ + bias) V over the cache with the token's rotated key and value at
    ``slots``, and that cache (every other slot unchanged). Query head h reads KV head h // (Hq / Hc); softmax in
    float32."""
    B = q.shape[0]
    D = k_cache.shape[-1]
    G = num_heads // kv_num_heads
    c = torch.cat([cos, cos], -1)[:, None, None, :]  # (B, 1, 1, D)
    s = torch.cat([sin, sin], -1)[:, None, None, :]
    qh = q.view(B, 1, num_heads, D).transpose(1, 2)
    kh = k_new.view(B, 1, kv_num_heads, D).transpose(1, 2)
    qh, kh = qh * c + _rotate_half(qh) * s, kh * c + _rotate_half(kh) * s
    vh = v_new.view(B, 1, kv_num_heads, -1).transpose(1, 2)
    idx = slots.to(torch.long).view(B, 1, 1, 1)
    k = k_cache.scatter(2, idx.expand(B, kv_num_heads, 1, D), kh)
    v = v_cache.scatter(2, idx.expand(B, kv_num_heads, 1, vh.shape[-1]), vh)
    kq, vq = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, Hq, S, .)
    logits = torch.matmul(qh, kq.transpose(-1, -2)).float() * scale + bias.float()
    out = torch.matmul(torch.softmax(logits, dim=-1).to(vq.dtype), vq)  # (B, Hq, 1, Dv)
    return out.transpose(1, 2).reshape(B, 1, -1), k, v


@torch.library.custom_op("kvexport::cache_step_attention", mutates_args=())
def cache_step_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, bias: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, scale: float, num_heads: int, kv_num_heads: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`cache_step_attention_reference`; exported as onnxruntime's ``GroupQueryAttention`` (rotary inside)
    with the cache as a past/present buffer the runtime binds to one memory (written in place, one slot per step).
    ``num_heads`` / ``kv_num_heads``: q's and the cache's heads (attributes of the ONNX node)."""
    out, k, v = cache_step_attention_reference(q, k_new, v_new, k_cache, v_cache, bias, slots, cos, sin, scale,
                                               num_heads, kv_num_heads)
    return out.contiguous(), k, v


@cache_step_attention.register_fake
def _cache_step_attention_fake(q, k_new, v_new, k_cache, v_cache, bias, slots, cos, sin, scale, num_heads,
                               kv_num_heads):
    return q.new_empty(q.shape[0], 1, num_heads * v_cache.shape[-1]), torch.empty_like(k_cache), \
        torch.empty_like(v_cache)


# ----------------------------------------------------------------------------- ONNX schema and translation
def schema() -> defs.OpSchema:
    """onnxruntime's ``com.microsoft::GroupQueryAttention`` (version 1), as far as kvexport writes it: its first
    eleven inputs (up to ``attention_bias``) and three outputs, so onnx checks the in-place decode graph and
    onnxscript can emit the node. onnxruntime's own schema is the authority; this one mirrors its input order."""
    P = defs.OpSchema.FormalParameter
    A = defs.OpSchema.AttrType
    opt = defs.OpSchema.FormalParameterOption.Optional
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
             "sin_cache", "position_ids", "attention_bias"]
    types = {"seqlens_k": "M", "total_sequence_length": "M", "position_ids": "I"}
    required = {"query", "seqlens_k", "total_sequence_length"}
    inputs = [P(n, types.get(n, "T"), n, param_option=defs.OpSchema.FormalParameterOption.Single if n in required
                else opt) for n in names]
    return defs.OpSchema(
        "GroupQueryAttention", ORT_DOMAIN, 1,
        doc="onnxruntime contrib op (kvexport writes it in decode_inplace.ort.onnx only)",
        inputs=inputs,
        outputs=[P("output", "T"), P("present_key", "T", param_option=opt), P("present_value", "T", param_option=opt)],
        type_constraints=[("T", FLOATS, "activations"), ("M", ["tensor(int32)"], "lengths"),
                          ("I", ["tensor(int64)"], "positions")],
        attributes=[defs.OpSchema.Attribute("num_heads", A.INT, "query heads", required=True),
                    defs.OpSchema.Attribute("kv_num_heads", A.INT, "key/value heads", required=True),
                    defs.OpSchema.Attribute("scale", A.FLOAT, "softmax scale", required=False),
                    defs.OpSchema.Attribute("do_rotary", A.INT, "1: RoPE of query and key inside", required=False)],
    )


def translation(opset18, msft):
    """``torch.ops.kvexport.cache_step_attention`` -> onnxruntime's GroupQueryAttention (``msft``: the contrib
    domain's onnxscript Opset) with the cache as past and present."""
    op = opset18

    def cache_step_attention_onnx(q, k_new, v_new, k_cache, v_cache, bias, slots, cos, sin, scale: float,
                                  num_heads: int, kv_num_heads: int):
        # onnxruntime's GroupQueryAttention with the cache as past and present (one buffer when the runtime binds
        # both to it: the kernel then writes only the token's slot, seqlens_k = slot, and attends slots [0, slot]),
        # the token's RoPE inside (cos/sin rows of this step, read through position_ids = the batch row), the
        # visibility the caller's bias
        Hq, Hc = int(num_heads), int(kv_num_heads)
        S = op.Shape(k_cache, start=2, end=3)
        B = op.Shape(q, start=0, end=1)
        # cos_cache must have at least total_sequence_length rows: this step's B rows, zero-padded to S
        rows = op.Concat(op.Sub(op.Max(S, B), B), op.Constant(value_ints=[0]), axis=0)
        pads = op.Concat(op.Constant(value_ints=[0, 0]), rows, axis=0)
        total = op.Cast(op.Squeeze(S), to=onnx.TensorProto.INT32)
        pid = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(B), op.Constant(value_int=1)),
                           op.Constant(value_ints=[1]))
        out, k, v = msft.GroupQueryAttention(q, k_new, v_new, k_cache, v_cache,
                                             op.Cast(slots, to=onnx.TensorProto.INT32), total, op.Pad(cos, pads),
                                             op.Pad(sin, pads), pid, bias, num_heads=Hq, kv_num_heads=Hc,
                                             scale=float(scale), do_rotary=1, _outputs=3)
        return out, k, v

    return {torch.ops.kvexport.cache_step_attention.default: cache_step_attention_onnx}


__all__ = ["NAME", "cache_step_attention", "cache_step_attention_reference", "schema", "translation"]
