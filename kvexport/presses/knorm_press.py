# SPDX-License-Identifier: Apache-2.0
"""Knorm: keep keys of small L2 norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression"). Score = -||k_j||_2 of the post-RoPE key, per cache head.

RoPE preserves norms, so the score depends on the token's key alone: per chunk and at decode compaction
it is the same rule (in layer 0 a chunked prefill keeps the single-shot set). Padding / empty slots may
score anything; the cache masks them. Equal to kvpress's KnormPress at a single-shot prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvexport.presses.base import ScoreInputs, ScorerPress


@dataclass
class KnormPress(ScorerPress):
    name: ClassVar[str] = "knorm"
    observes: ClassVar[bool] = False  # no observation queries: a lookahead tail has nothing to say

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S) = -||k_j||."""
        return -inputs.keys.float().norm(dim=-1)
