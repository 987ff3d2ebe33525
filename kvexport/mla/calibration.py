# SPDX-License-Identifier: Apache-2.0
"""What the rewrite and the refit learn from: every layer's attention inputs on calibration token ids, taken from the
original model."""

from __future__ import annotations

import torch


@torch.no_grad()
def calibration_inputs(dec, ids: torch.Tensor) -> list[torch.Tensor]:
    """ids (B, T) -> per layer of the kvexport Decoder ``dec`` the attention inputs (B·T, H) (after input_layernorm),
    from the original model, in its dtype."""
    caught: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a: caught.append(a[0].reshape(-1, a[0].shape[-1])))
             for layer in dec.layers]
    try:
        B, T = ids.shape
        dec(ids, torch.arange(T, device=ids.device).expand(B, T), last_only=True)  # no (B, T, V) logits
    finally:
        for hk in hooks:
            hk.remove()
    return [c.detach().cpu() for c in caught]  # the model's dtype: plan_layer widens one layer at a time


__all__ = ["calibration_inputs"]
