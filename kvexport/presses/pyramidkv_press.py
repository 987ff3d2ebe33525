# SPDX-License-Identifier: Apache-2.0
"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling"): SnapKV scores, but lower layers keep more tokens than higher ones.

Scores are :class:`~kvexport.presses.snapkv_press.SnapKVPress`'s (same per-chunk and decode behaviour).
Only the per-layer budgets differ, a straight line from ``max_num`` at layer 0 to ``min_num`` at the last.

- With ``compression_ratio`` r and a prompt of n tokens (kvpress's ``get_layer_budget``, from
  KVCache-Factory): ``m = n (1 - r)``, ``min_num = m / beta``, ``max_num = 2 m - min_num``; if
  ``max_num >= n - window`` then ``max_num = n - window`` and ``min_num = 2 m - max_num``; unless
  ``n >= max_num >= min_num >= window`` the press falls back to SnapKV's uniform ``max(1, round(n (1-r)))``.
  Layer i keeps ``round(max_num - i (max_num - min_num) / (L - 1))``. Equal to kvpress at prefill,
  including its quirk for a one-layer model, which keeps ``max_num`` (more than the ratio asks).
- With an absolute ``budget`` B the budgets must not depend on the prompt (the cache is sized once), so
  the same line is drawn with ``m = B`` and no prompt clamp: ``min_num = B / beta``,
  ``max_num = 2 B - min_num``; the average over layers is B, so the total cache equals a uniform B. If
  ``min_num < window`` (the smallest layer could not hold the observation window), or L = 1, all layers
  keep B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvexport.errors import BadUsage
from kvexport.presses.snapkv_press import SnapKVPress


@dataclass
class PyramidKVPress(SnapKVPress):
    beta: int = 20
    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self):
        if self.beta < 1:
            raise BadUsage(f"beta {self.beta} must be >= 1")
        super().__post_init__()

    @staticmethod
    def _line(max_num: float, min_num: float, num_layers: int) -> list[int]:
        steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
        return [int(round(max_num - i * steps)) for i in range(num_layers)]

    def layer_budgets(self, num_layers: int, n_tokens: int) -> list[int]:
        """Per-layer budgets (see the module docstring): list of L ints, non-increasing."""
        win = self.window_size
        if self.budget is not None:
            b = float(self.budget)
            min_num = b / self.beta
            max_num = 2 * b - min_num
            if min_num < win or num_layers == 1:
                return [int(self.budget)] * num_layers
            return self._line(max_num, min_num, num_layers)
        ratio = float(self.compression_ratio or 0.0)
        kept = n_tokens * (1 - ratio)
        min_num = kept / self.beta
        max_num = 2 * kept - min_num
        if max_num >= n_tokens - win:
            max_num = n_tokens - win
            min_num = 2 * kept - max_num
        if not (n_tokens >= max_num >= min_num >= win):
            return [max(1, round(n_tokens * (1 - ratio)))] * num_layers
        return self._line(max_num, min_num, num_layers)
