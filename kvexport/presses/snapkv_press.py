# SPDX-License-Identifier: Apache-2.0
"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Score of candidate j, for each cache head: the softmax attention (RoPE'd queries, causal by position) of
the last ``w`` observation queries to j, averaged over those queries, smoothed along the slot axis by
``avg_pool1d(kernel_size, stride 1, padding kernel_size // 2)`` (zeros count in the average), then
averaged over the G query heads of the group. The last ``w`` candidates (the observation window itself)
are always kept (``max + 1``). Only the first ``S - w`` candidates are pooled. This is kvpress's
SnapKVPress: at a single-shot prefill the kept sets are equal.

``w = min(window_size, Q, S - 1)`` where Q is the number of observation queries: when fewer queries than
``window_size`` exist (a short chunk, or decode compaction with a cache window smaller than 64) the press
uses the ones there are. Per chunk: the chunk's last ``w`` queries observe kept slots + chunk, and the
pooling runs over slot order (kept slots are not contiguous in position, so neighbours may be far
apart). At decode compaction: the last ``w`` decoded tokens observe all occupied slots and are kept.
Padding queries (position -1) are left out of the mean; padding keys get attention 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvexport.errors import BadUsage
from kvexport.presses.base import ScoreInputs, ScorerPress
from kvexport.presses.observation import keep_always, last_candidates, observation_probs, query_valid


@dataclass
class SnapKVPress(ScorerPress):
    window_size: int = 64
    kernel_size: int = 5
    name: ClassVar[str] = "snapkv"

    def __post_init__(self):
        if self.window_size < 1 or self.kernel_size < 1:
            raise BadUsage(f"window_size ({self.window_size}) and kernel_size ({self.kernel_size}) must be >= 1")
        super().__post_init__()

    def always_kept(self) -> int:
        return int(self.window_size)

    def observation_window(self, inputs: ScoreInputs) -> int:
        """w: how many of the last candidates observe (and are kept). Static: depends on shapes only."""
        return max(1, min(int(self.window_size), inputs.queries.shape[2], inputs.keys.shape[2] - 1))

    def window_scores(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S): pooled window attention over the first S - w candidates, window on top."""
        w = self.observation_window(inputs)
        S = inputs.keys.shape[2]
        probs = observation_probs(inputs, last=w)  # (B, Hc, G, w, S)
        B, Hc, G = probs.shape[:3]
        n_q = query_valid(inputs, last=w).sum(-1).clamp(min=1).float()  # (B,)
        attn = probs[..., : S - w].sum(-2) / n_q[:, None, None, None]  # (B, Hc, G, S - w)
        k = int(self.kernel_size)
        pooled = F.avg_pool1d(attn.reshape(B, Hc * G, S - w), kernel_size=k, padding=k // 2, stride=1)
        scores = pooled[..., : S - w].reshape(B, Hc, G, S - w).mean(2)  # mean over the GQA group
        scores = torch.cat([scores, scores.new_zeros(B, Hc, w)], dim=-1)
        return keep_always(scores, last_candidates(inputs, w), inputs.valid)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return self.window_scores(inputs)
