# SPDX-License-Identifier: Apache-2.0
"""Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution"): score each key by the attention that *future* queries are
expected to pay it, modelling those queries as a Gaussian fitted to the observed ones.

Per query head (pre-RoPE observation queries q_t with position >= n_sink, the sinks' outliers left out):
  mu = mean_t q_t, Sigma = mean_t (q_t - mu)(q_t - mu)^T                    (biased, like kvpress)
  R  = mean over p in [s, s + n_future_positions) of the RoPE matrix R(p), s = last query position + 1
  mu' = R mu,  Sigma' = R Sigma R^T
  logit_j = scaling * mu' . k_j + scaling^2 / 2 * k_j^T Sigma' k_j          (scaling = 1/sqrt(d))
  score_j = softmax_j(logit) over the non-sink valid candidates, mean over the G heads of the group,
            then (score_j + epsilon) * ||v_j|| if use_vnorm.
Candidates at positions < n_sink are always kept (``max + 1``). At a single-shot prefill this is
kvpress's ExpectedAttentionPress, so the kept sets are equal.

Per chunk: the statistics come from the chunk's queries, R from the positions after the chunk; the
softmax runs over kept slots + chunk. At decode compaction: the statistics come from the last ``window``
decoded tokens' queries. MLA (Hc = 1): queries are absorbed into the latent space, ``R`` rotates only
the rope slice (``rotary.matrix`` is the identity elsewhere); with an empty value (Dv = 0) there is no
value norm to use, so ``use_vnorm`` is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvexport.errors import BadUsage
from kvexport.presses.base import ScoreInputs, ScorerPress
from kvexport.presses.observation import keep_always

_R_CHUNK = 128  # positions per rotation-matrix batch (bounds memory for wide MLA latents)


@dataclass
class ExpectedAttentionPress(ScorerPress):
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    name: ClassVar[str] = "expected_attention"

    def __post_init__(self):
        if self.n_future_positions < 1 or self.n_sink < 0:
            raise BadUsage(f"n_future_positions ({self.n_future_positions}) must be >= 1 and n_sink "
                           f"({self.n_sink}) >= 0")
        super().__post_init__()

    def always_kept(self) -> int:
        return int(self.n_sink)

    def averaged_rotation(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> R (B, D, D): RoPE matrix averaged over the next n_future_positions positions of each row."""
        D = inputs.queries.shape[-1]
        start = inputs.query_positions.max(dim=1).values.clamp(min=0) + 1  # (B,)
        B = start.shape[0]
        total = None
        P = int(self.n_future_positions)
        for lo in range(0, P, _R_CHUNK):  # static loop: bounds memory to (B * 128, D, D)
            n = min(_R_CHUNK, P - lo)
            pos = start[:, None] + torch.arange(lo, lo + n, device=start.device)  # (B, n)
            R = inputs.rotary.matrix(pos.reshape(-1), total_dim=D).to(start.device)  # (B * n, D, D)
            part = R.reshape(B, n, D, D).sum(1)
            total = part if total is None else total + part
        return total / P

    def query_statistics(self, inputs: ScoreInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> mu' (B, Hq, D) and Sigma' (B, Hq, D, D) (None without covariance), RoPE-averaged."""
        q = inputs.queries.float()  # (B, Hq, Q, D) pre-RoPE
        w = (inputs.query_positions >= self.n_sink).float()[:, None, :, None]  # (B, 1, Q, 1)
        n = w.sum(2, keepdim=True).clamp(min=1.0)
        mu = (q * w).sum(2, keepdim=True) / n  # (B, Hq, 1, D)
        cov = None
        if self.use_covariance:
            c = (q - mu) * w
            cov = torch.einsum("bhsi,bhsj->bhij", c, c) / n  # (B, Hq, D, D)
        R = self.averaged_rotation(inputs)  # (B, D, D)
        mu = torch.einsum("bij,bhj->bhi", R, mu[:, :, 0])
        if cov is not None:
            cov = torch.einsum("bij,bhjk,blk->bhil", R, cov, R)
        return mu, cov

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """-> (B, Hc, S) expected attention (x value norm), sinks on top."""
        k = inputs.keys.float()  # (B, Hc, S, D)
        B, Hc, S, D = k.shape
        mu, cov = self.query_statistics(inputs)
        G = mu.shape[1] // Hc
        mu = mu.reshape(B, Hc, G, D)
        logits = torch.einsum("bcgd,bcsd->bcgs", mu, k) * inputs.scaling
        if cov is not None:
            cov = cov.reshape(B, Hc, G, D, D)
            logits = logits + torch.einsum("bcsi,bcgij,bcsj->bcgs", k, cov, k) * (inputs.scaling**2 / 2)
        sink = inputs.valid & (inputs.positions < self.n_sink)  # (B, Hc, S)
        scored = (inputs.valid & ~sink)[:, :, None]  # (B, Hc, 1, S)
        logits = logits.masked_fill(~scored, torch.finfo(torch.float32).min)
        scores = torch.softmax(logits, dim=-1).mean(2)  # (B, Hc, S)
        if self.use_vnorm and inputs.values.shape[-1] > 0:
            scores = (scores + self.epsilon) * inputs.values.float().norm(dim=-1)
        return keep_always(scores, sink, inputs.valid)
