# SPDX-License-Identifier: Apache-2.0
"""Ties between runtimes: when two candidates score the same up to rounding, which one a runtime keeps is not
a defect, but it changes everything after it. Validation therefore lets the PyTorch reference follow the
candidate runtime's choice *only* where the reference's own scores call it a tie.

Exact ties go to the lower index everywhere (ONNX TopK's rule, :func:`kvexport.cache.candidates.select_kept`,
the TensorRT plugin). Near ties are what remains: e.g. a token repeated by greedy decoding has, in layer 0, the
same key norm at both positions up to one float step, and PyTorch and onnxruntime round it differently.
:class:`TieReferee` is the ``tie_break`` hook of :func:`kvexport.generation.generate`: at a compaction where
the candidate kept another set than the reference would, it accepts the candidate's set iff, by the reference's
scores, every candidate-kept token scores at least every dropped valid one minus ``rtol * (|s_k| + |s_k+1|)``
(s_k, s_k+1: the reference's k-th and next best score of that row and head). Otherwise the reference keeps its
own set and the difference is reported as a disagreement.
"""

from __future__ import annotations

import numpy as np
import torch

from kvexport.cache.candidates import select_kept

#: relative score tolerance under which two candidates count as tied, by export dtype
TIE_RTOL = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 2e-2}
#: ... and for an export whose int4 weights onnxruntime multiplies with int8 activations (kvexport.quant.weights
#: ``lossy_arithmetic``): every query, key and score moves by the activations' rounding, a few percent
TIE_RTOL_LOSSY_WEIGHTS = 3e-2


#: ... and for a lossy cache format (int8 / fp8, or fp16 / bf16 of an fp32 model: kvexport.export.twin.is_lossy):
#: the two runtimes may store a number one code apart (a value at a rounding boundary), which moves the scores that
#: read it by up to a code's share of the row: the fp16 tolerance, as the lossy cache's logit gates are fp16's
TIE_RTOL_LOSSY_CACHE = 1e-2


class TieReferee:
    """``tie_break`` for :func:`kvexport.generation.generate` that follows ``kept`` where it is a tie.

    kept: ``{where: [per layer (B, Hc, cap) int64 positions]}`` from the candidate runtime (its positions right
    after each compaction; ``where`` = ``"prefill:<chunk>"`` / ``"decode:<step>"``).
    """

    def __init__(self, kept: dict[str, list[np.ndarray]], rtol: float):
        self.kept = kept
        self.rtol = float(rtol)
        self.accepted = 0  # (compaction, layer, row, head) sets taken from the candidate
        self.refused = 0  # sets where the candidate's choice was not a tie

    def __call__(self, where: str, layer: int, scores: torch.Tensor, positions: torch.Tensor, n_keep: int):
        theirs = self.kept.get(where)
        if theirs is None or layer >= len(theirs):
            return None
        want = theirs[layer]
        own = select_kept(scores, positions, n_keep)
        s = scores.float().masked_fill(positions < 0, float("-inf"))
        kept_pos = positions.gather(-1, own)
        chosen = None
        B, H, _ = scores.shape
        for b in range(B):
            for h in range(H):
                mine = set(kept_pos[b, h][kept_pos[b, h] >= 0].tolist())
                cand = {int(p) for p in want[b, h] if p >= 0}
                if mine == cand:
                    continue
                take = torch.tensor([p in cand for p in positions[b, h].tolist()], device=s.device)
                if self._is_tie(s[b, h], positions[b, h] >= 0, take, len(cand), n_keep):
                    chosen = s.clone() if chosen is None else chosen
                    chosen[b, h] = take.float()  # exactly the candidate's set (invalid slots stay -inf)
                    self.accepted += 1
                else:
                    self.refused += 1
        return None if chosen is None else select_kept(chosen, positions, n_keep)

    def _is_tie(self, s: torch.Tensor, valid: torch.Tensor, take: torch.Tensor, n_cand: int, n_keep: int) -> bool:
        """s (S,) scores (-inf on invalid), valid (S,), take (S,): the candidate's set -> is it a tie here?"""
        take = take & valid
        if int(take.sum()) != n_cand or n_cand != min(int(valid.sum()), n_keep):
            return False  # the candidate kept something that is not a candidate here, or the wrong count
        ranked = s[valid].sort(descending=True).values
        k = min(n_keep, ranked.numel())
        sk = float(ranked[k - 1])
        sk1 = float(ranked[k]) if k < ranked.numel() else sk
        tol = self.rtol * (abs(sk) + abs(sk1))
        dropped = valid & ~take
        highest_dropped = float(s[dropped].max()) if bool(dropped.any()) else float("-inf")
        return float(s[take].min()) >= highest_dropped - tol
