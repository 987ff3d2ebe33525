# SPDX-License-Identifier: Apache-2.0
"""The PyTorch reference of a weight-quantized export: a Decoder whose weights are the ones the export holds.

:func:`quantized_decoder` takes a Decoder (the export's source, as validation loads it) and the export's manifest
``weights`` entry (:func:`kvexport.quant.weights.quantize_export`), and replaces each weight the export quantized by
its dequantized value, computed from the Decoder's own weight with the same rule (:mod:`kvexport.quant.blocks`):

- an ``nn.Linear`` whose weight, transposed as MatMul reads it, has the sha256 of a quantized ``matmul`` tensor;
- an ``nn.Embedding`` whose table has the sha256 of a quantized ``gather`` tensor (int4: the blocks of its transpose,
  which is what the tied LM head's blocks are; fp16: float16 values).

Matching by content, not by name, keeps the reference honest: a weight the export quantized that the Decoder does
not hold (or holds otherwise) raises instead of being skipped, and tied weights are untied only where the export
treats the two uses differently. The library path then runs on these weights as on any others
(:func:`kvexport.generation.generate`), so an export's logits compare with "PyTorch with the same quantized weights".
"""

from __future__ import annotations

import copy

import numpy as np

from kvexport.errors import BadArtifact
from kvexport.quant.blocks import fp16_round, quantize_int4
from kvexport.quant.weights import sha256_array


def dequantized(w: np.ndarray, entry: dict) -> np.ndarray:
    """w (K, N) float32 as MatMul reads it -> the float32 values the export's format keeps."""
    if entry["format"] == "fp16":
        return fp16_round(w)
    return quantize_int4(w, int(entry["block_size"]), bool(entry["symmetric"])).dequantize()


def quantized_decoder(decoder, entry: dict, inplace: bool = False):
    """decoder (kvexport Decoder, float32) -> a copy (or the decoder itself, ``inplace``) with the export's quantized
    weights; BadArtifact if the export quantized a weight the decoder does not hold."""
    import torch
    from torch import nn

    want = {t["sha256"]: t for t in entry["tensors"]}
    dec = decoder if inplace else copy.deepcopy(decoder)
    found: set[str] = set()
    swaps = []
    for mod in dec.modules():
        if isinstance(mod, nn.Linear):
            w = mod.weight.detach().to("cpu", torch.float32).T.contiguous().numpy()  # (K, N)
            t = want.get(sha256_array(w))
            if t is not None and t["kind"] == "matmul":
                swaps.append((mod, torch.from_numpy(dequantized(w, entry).T.copy())))
                found.add(t["sha256"])
        elif isinstance(mod, nn.Embedding):
            table = mod.weight.detach().to("cpu", torch.float32).contiguous().numpy()  # (V, D)
            t = want.get(sha256_array(table))
            if t is not None and t["kind"] == "gather":
                values = fp16_round(table) if entry["format"] == "fp16" else dequantized(table.T, entry).T
                swaps.append((mod, torch.from_numpy(np.ascontiguousarray(values))))
                found.add(t["sha256"])
    for mod, value in swaps:  # after matching: a tied parameter is hashed as it was, then each use gets its own
        mod.weight = nn.Parameter(value.to(mod.weight.device), requires_grad=False)
    missing = [t for s, t in want.items() if s not in found]
    if missing:
        shapes = ", ".join(f"{t['kind']} {t['shape']}" for t in missing[:4])
        raise BadArtifact(f"the export quantized {len(missing)} weights the model does not hold ({shapes}); "
                          "is this the export's source model?")
    return dec
