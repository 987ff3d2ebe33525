# SPDX-License-Identifier: Apache-2.0
"""Observed attention, the heavy-hitter rule of H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models").

Score of candidate j, per cache head: the column sum of the observation queries' softmax attention
(RoPE'd, causal by position) to j, divided by how many real queries can see j, then averaged over the G
query heads of the group. The attention is computed here from queries and keys, so no eager attention
output is needed. At a single-shot prefill the observation queries are the whole prompt, the divisor is
``n - j`` and this equals kvpress's ObservedAttentionPress (which reads the eager attention matrix).

Per chunk: the chunk's queries observe kept slots + chunk (kept slots are seen by every real chunk
query). At decode compaction: the last ``window`` decoded tokens' queries observe all occupied slots.
Candidates no real query sees score 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvexport.presses.base import ScoreInputs, ScorerPress
from kvexport.presses.observation import observation_probs, visible


@dataclass
class ObservedAttentionPress(ScorerPress):
    name: ClassVar[str] = "observed_attention"

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S): mean attention received per observing query, mean over the GQA group."""
        probs = observation_probs(inputs)  # (B, Hc, G, Q, S)
        seen_by = visible(inputs).sum(2).clamp(min=1).float()  # (B, Hc, S)
        return (probs.sum(3) / seen_by[:, :, None]).mean(2)
