# SPDX-License-Identifier: Apache-2.0
"""Weights in int4 and fp16: the block rule (:mod:`~kvexport.quant.blocks`), the post-pass over an export's graphs
(:mod:`~kvexport.quant.weights`) and the PyTorch reference with the same weights (:mod:`~kvexport.quant.reference`).
docs/quantized.md says what each format is for and what was measured."""

from __future__ import annotations

from kvexport.quant.blocks import Int4Blocks, fp16_round, quantize_int4
from kvexport.quant.reference import quantized_decoder
from kvexport.quant.weights import CHOICES, FORMATS, check_weights, lossy_arithmetic, quantize_export

__all__ = ["CHOICES", "FORMATS", "Int4Blocks", "check_weights", "fp16_round", "lossy_arithmetic", "quantize_int4",
           "quantize_export", "quantized_decoder"]
