# SPDX-License-Identifier: Apache-2.0
"""What a layer hands a press besides the cache (:class:`ScoreContext`): made by the model for each layer's cache
(:meth:`kvexport.models.decoder.Decoder.new_cache`) and by the exported graphs; the cache only calls
:meth:`ScoreContext.inputs` when it compacts."""

from __future__ import annotations

from dataclasses import dataclass

from kvexport.presses.base import ScoreInputs


@dataclass
class ScoreContext:
    """What a press needs from the layer besides the cache: query rotation, softmax scale, sliding window."""

    rotary: object  # kvexport.models.rope.Rotary (or MLA's partial rotary)
    scaling: float
    layer_idx: int
    num_layers: int
    sliding_window: int | None = None

    def inputs(self, n_keep: int, observers_are_candidates: bool = True):
        """-> make_inputs(k, v, pos, queries, q_positions) for :func:`~kvexport.cache.candidates.keep_best`.
        ``observers_are_candidates=False``: a lookahead tail observes (kvexport.cache.plan rule 3b)."""
        def make(k, v, pos, queries, q_positions):
            return ScoreInputs(keys=k, values=v, positions=pos, queries=queries, query_positions=q_positions,
                               rotary=self.rotary, scaling=self.scaling, layer_idx=self.layer_idx,
                               num_layers=self.num_layers, n_keep=n_keep, sliding_window=self.sliding_window,
                               observers_are_candidates=observers_are_candidates)

        return make


__all__ = ["ScoreContext"]
