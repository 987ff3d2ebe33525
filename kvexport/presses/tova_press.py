# SPDX-License-Identifier: Apache-2.0
"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep what the newest token attends to.

Score of candidate j = softmax attention of the last observation query (RoPE'd, causal) to j, averaged
over **all** query heads, hence the same for every cache head; the last candidate (the newest token) is
always kept, as in kvpress's TOVAPress (``max + 1``). Single-shot prefill: equal to kvpress.

Per chunk: the last query of the chunk scores the kept slots + the chunk. At decode compaction: the last
decoded token's query scores all occupied slots. MLA (Hc = 1): the mean runs over all Hq heads as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvexport.presses.base import ScoreInputs, ScorerPress
from kvexport.presses.observation import keep_always, last_candidates, observation_probs


@dataclass
class TOVAPress(ScorerPress):
    name: ClassVar[str] = "tova"

    def always_kept(self) -> int:
        return 1

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S): last query's attention, mean over all query heads, last candidate on top."""
        probs = observation_probs(inputs, last=1)[..., 0, :]  # (B, Hc, G, S)
        B, Hc, G, S = probs.shape
        scores = probs.reshape(B, Hc * G, S).mean(1, keepdim=True).expand(B, Hc, S)
        return keep_always(scores, last_candidates(inputs, 1 if inputs.observers_are_candidates else 0), inputs.valid)
