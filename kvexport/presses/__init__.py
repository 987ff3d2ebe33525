# SPDX-License-Identifier: Apache-2.0
"""Presses: scoring rules for static-budget KV eviction. Look one up by CLI name with :func:`make_press`."""

from __future__ import annotations

from kvexport.errors import BadUsage
from kvexport.presses.base import ScoreInputs, ScorerPress
from kvexport.presses.expected_attention_press import ExpectedAttentionPress
from kvexport.presses.keydiff_press import KeyDiffPress
from kvexport.presses.knorm_press import KnormPress
from kvexport.presses.observed_attention_press import ObservedAttentionPress
from kvexport.presses.optimal_press import OptimalPress
from kvexport.presses.pyramidkv_press import PyramidKVPress
from kvexport.presses.random_press import RandomPress
from kvexport.presses.snapkv_press import SnapKVPress
from kvexport.presses.streaming_llm_press import StreamingLLMPress
from kvexport.presses.tova_press import TOVAPress

#: CLI name -> press class
PRESSES: dict[str, type[ScorerPress]] = {
    cls.name: cls
    for cls in (
        StreamingLLMPress,
        KnormPress,
        KeyDiffPress,
        TOVAPress,
        SnapKVPress,
        PyramidKVPress,
        ExpectedAttentionPress,
        ObservedAttentionPress,
        RandomPress,
        OptimalPress,
    )
}


def make_press(name: str, compression_ratio: float | None = None, budget: int | None = None, **kw) -> ScorerPress:
    """Build a press by CLI name; unknown names raise :class:`BadUsage` listing the accepted ones."""
    cls = PRESSES.get(name)
    if cls is None:
        raise BadUsage(f"unknown press {name!r}; accepted: {', '.join(PRESSES)}")
    return cls(compression_ratio=compression_ratio, budget=budget, **kw)


def build_press(press: str | None, budget: int | None, ratio: float | None, neighbors: int = 0):
    """A press name and ``--budget`` / ``--ratio`` / ``--neighbors`` options -> a press object, or None for 'none'
    (one line when the options do not go together)."""
    if press in (None, "none"):
        if budget is not None or ratio is not None or neighbors:
            raise BadUsage("--budget/--ratio/--neighbors need a --press (accepted: a press name, not 'none')")
        return None
    if budget is None and ratio is None:
        raise BadUsage(f"--press {press} needs --budget N (tokens kept) or --ratio R in [0, 1)")
    return make_press(press, compression_ratio=ratio, budget=budget, neighbors=int(neighbors))


__all__ = [
    "build_press",
    "PRESSES",
    "make_press",
    "ScoreInputs",
    "ScorerPress",
    "StreamingLLMPress",
    "KnormPress",
    "KeyDiffPress",
    "TOVAPress",
    "SnapKVPress",
    "PyramidKVPress",
    "ExpectedAttentionPress",
    "ObservedAttentionPress",
    "RandomPress",
    "OptimalPress",
]
