# SPDX-License-Identifier: Apache-2.0
"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Score of candidate j, for each cache head: the softmax attention (RoPE'd queries, causal by position) of
the last ``w`` observation queries to j, averaged over those queries, smoothed along the slot axis by
``avg_pool1d(kernel_size, stride 1, padding kernel_size // 2)`` (zeros count in the average), then
averaged over the G query heads of the group. The last ``w`` candidates (the observation window itself)
are always kept (``max + 1``) and count as zeros in the pooling (kvpress pools the first ``S - w`` only, with
zero padding: the same numbers). This is kvpress's SnapKVPress: at a single-shot prefill the kept sets are equal.

``w = min(window_size, real observation queries)``, per row: when fewer real queries than ``window_size``
exist (a short chunk, a padded row, or decode compaction with a cache window smaller than 64) the press uses
the ones there are; they are the last queries and their tokens the last candidates (kvexport.cache.plan, rule 6).
Per chunk: the chunk's last ``w`` real queries observe kept slots + chunk, and the pooling runs over candidate
order (kept slots are not contiguous in position, so neighbours may be far apart). At decode compaction: the
last ``w`` decoded tokens observe all occupied slots and are kept. Padding queries contribute nothing, padding
keys get attention 0 and sit before the valid candidates, where they pool like avg_pool1d's zero padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvexport.errors import BadUsage
from kvexport.presses.base import ScoreInputs, ScorerPress
from kvexport.presses.observation import keep_always, last_candidates, observation_probs


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

    def observation_window(self, inputs: ScoreInputs) -> torch.Tensor:
        """w (B,) int64: how many of the last observation queries observe, per row (and, when they are the last
        candidates' own, how many of those are kept)."""
        return inputs.n_real_queries.clamp(max=int(self.window_size))

    def window_scores(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S): pooled window attention of the candidates before the window, the window on top (a
        lookahead tail observes from outside the candidates: then nothing is a window)."""
        w = self.observation_window(inputs)  # (B,)
        last = min(int(self.window_size), inputs.queries.shape[2])  # static: the observers are among these
        probs = observation_probs(inputs, last=last)  # (B, Hc, G, last, S); padding queries are zero rows
        B, Hc, G, _, S = probs.shape
        window = last_candidates(inputs, w if inputs.observers_are_candidates else 0)  # (B or 1, 1, S)
        attn = probs.sum(-2) / w.clamp(min=1).float()[:, None, None, None]  # (B, Hc, G, S)
        attn = attn.masked_fill(window[:, :, None, :], 0.0)
        k = int(self.kernel_size)
        pooled = F.avg_pool1d(attn.reshape(B, Hc * G, S), kernel_size=k, padding=k // 2, stride=1)
        scores = pooled[..., :S].reshape(B, Hc, G, S).mean(2).masked_fill(window, 0.0)  # mean over the GQA group
        return keep_always(scores, window, inputs.valid)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return self.window_scores(inputs)
