# SPDX-License-Identifier: Apache-2.0
"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments"): keep the keys least similar to the average key.

Score of candidate j = ``-cos(k_j, a)``, ``a`` = mean over the valid candidates of the L2-normalised
post-RoPE keys, per (batch, cache head). Single-shot prefill: identical to kvpress's KeyDiffPress (which
averages over the whole prompt). Per chunk and at decode compaction the anchor is the mean over the
candidates being scored (kept slots + chunk, or all occupied slots); no queries are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvexport.presses.base import ScoreInputs, ScorerPress


@dataclass
class KeyDiffPress(ScorerPress):
    name: ClassVar[str] = "keydiff"
    observes: ClassVar[bool] = False  # no observation queries: a lookahead tail has nothing to say

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S) = -cos(k_j, anchor)."""
        k = inputs.keys.float()  # (B, Hc, S, D)
        w = inputs.valid.float()[..., None]  # (B, Hc, S, 1)
        kn = F.normalize(k, p=2, dim=-1)
        anchor = (kn * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp(min=1.0)  # (B, Hc, 1, D)
        return -F.cosine_similarity(k, anchor, dim=-1)
