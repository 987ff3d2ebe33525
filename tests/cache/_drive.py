# SPDX-License-Identifier: Apache-2.0
"""Driving a StaticCache through the decoder by hand, for the tests of the cache itself (the library path feeds it
through :class:`kvexport.runtime.torch_driver.TorchDriver` and the one loop)."""

from __future__ import annotations

import torch

from kvexport.cache import plan


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """mask (B, N) 0/1, left padded -> positions (B, N), -1 on padding (plan rule 1)."""
    return torch.from_numpy(plan.positions_from_mask(mask.numpy()))


@torch.no_grad()
def prefill(decoder, cache, ids: torch.Tensor, positions: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """The prompt (B, N) whole or in chunks of ``chunk`` columns (plan rule 2) -> the last chunk's logits."""
    logits = None
    for c in plan.CachePlan((1,), 0, False, chunk).chunks(ids.shape[1]):
        logits = decoder(ids[:, c.start : c.stop], positions[:, c.start : c.stop], cache, mode="prefill")
    return logits
