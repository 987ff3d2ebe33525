# SPDX-License-Identifier: Apache-2.0
"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"):
keep the first ``n_sink`` tokens and the most recent ones.

Score = position for ordinary tokens, plus a large bonus for the ``n_sink`` earliest valid
candidates, so top-k keeps sinks + the newest ``n_keep - n_sink``; identical to kvpress at prefill.
Sinks are the first ``n_sink`` *valid* candidates in slot order, so left padding is skipped. Per chunk
and at decode compaction the rule is the same (the sinks stay in the first kept slots), so a chunked
prefill keeps exactly the single-shot set. Keys are not re-rotated after eviction (kvpress's
KeyRerotationPress would do that; a static cache keeps true positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvexport.presses.base import ScoreInputs, ScorerPress


@dataclass
class StreamingLLMPress(ScorerPress):
    n_sink: int = 4
    name: ClassVar[str] = "streaming_llm"
    observes: ClassVar[bool] = False  # no observation queries: a lookahead tail has nothing to say

    def always_kept(self) -> int:
        return self.n_sink

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        pos = inputs.positions.float()  # (B, Hc, S)
        valid = inputs.valid
        # rank of each valid candidate among the valid ones, in slot order (left padding comes first)
        rank = valid.float().cumsum(-1) - 1  # float32 (exact below 2^24 candidates): TensorRT's CumSum has no int64
        sink = valid & (rank < self.n_sink)
        big = pos.max() + 1.0 if pos.numel() else pos.new_tensor(1.0)
        return torch.where(sink, big + (self.n_sink - rank), pos)
