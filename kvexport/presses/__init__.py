# SPDX-License-Identifier: Apache-2.0
"""Presses: scoring rules for static-budget KV eviction. Look one up by CLI name with :func:`make_press`."""

from __future__ import annotations

from kvexport.errors import BadUsage
from kvexport.presses.base import ScoreInputs, ScorerPress
from kvexport.presses.knorm_press import KnormPress
from kvexport.presses.streaming_llm_press import StreamingLLMPress

#: CLI name -> press class
PRESSES: dict[str, type[ScorerPress]] = {
    "streaming_llm": StreamingLLMPress,
    "knorm": KnormPress,
}


def make_press(name: str, compression_ratio: float | None = None, budget: int | None = None, **kw) -> ScorerPress:
    """Build a press by CLI name; unknown names raise :class:`BadUsage` listing the accepted ones."""
    cls = PRESSES.get(name)
    if cls is None:
        raise BadUsage(f"unknown press {name!r}; accepted: {', '.join(PRESSES)}")
    return cls(compression_ratio=compression_ratio, budget=budget, **kw)


__all__ = ["PRESSES", "make_press", "ScoreInputs", "ScorerPress", "KnormPress", "StreamingLLMPress"]
