# SPDX-License-Identifier: Apache-2.0
"""Layer-wise recovery of an MLA rewrite on a CPU: each layer's new projections fitted to reproduce the original
attention's output on calibration text.

X-EcoMLA and MHA2MLA repair the rewrite with end-to-end training on billions of tokens (GPUs). Here each layer is
repaired on its own, the way post-training quantization repairs a layer (GPTQ, AdaRound: reconstruct the layer's
output on calibration inputs): the inputs of layer l's attention (after its input norm) are taken from the
*original* model on calibration text, the target is the original attention's output (after o_proj), and only the
projections the rewrite made are trained (``kv_a_proj``, ``k_rope_proj``, ``kv_b_proj``, ``q_rope``; the queries,
o_proj, MLP, norms and embeddings stay the original's), by Adam on the relative squared error

    loss_l = ‖attn_mla(x_l) − attn_orig(x_l)‖² / ‖attn_orig(x_l)‖²      over the calibration tokens (causal).

Layers are independent (their inputs come from the original model), so the cost is L small problems, not one
deep one: one layer's attention forward and backward per step, no MLP, no LM head. The rewrite's PCA is the
starting point; what the PCA cannot see (the softmax, the positions that RoPE makes of the kept components) the
fit can. Measured on SmolLM2-135M (docs/mla.md, "Recovery on a CPU").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvexport.errors import BadUsage

#: the parameters the rewrite created (the only ones refit trains)
NEW_PARAMETERS = ("kv_a_proj.weight", "k_rope_proj.weight", "k_rope_proj.bias", "kv_b_proj.weight",
                  "kv_b_proj.bias", "q_rope")


@dataclass(frozen=True)
class RefitSettings:
    """``steps`` of Adam per layer at learning rate ``lr`` (cosine to 0), on ``sequences`` calibration sequences of
    ``seq_len`` tokens. The defaults are the measured choice on SmolLM2-135M (docs/mla.md, "Recovery on a CPU"):
    lr 1e-3 diverges there (every layer's loss rises), 1e-5 is 3x slower to the same loss."""

    steps: int = 100
    lr: float = 1e-4
    sequences: int = 8
    seq_len: int = 256

    def __post_init__(self):
        if self.steps < 1 or not self.lr > 0 or self.seq_len < 2 or self.sequences < 1:
            raise BadUsage(f"refit needs steps >= 1, lr > 0, sequences >= 1 and seq_len >= 2 (got {self.steps}, "
                           f"{self.lr}, {self.sequences}, {self.seq_len})")

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len


def _attention_out(attn, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One attention module over x (B, T, H) alone (causal, no cache) -> (B, T, H)."""
    B = x.shape[0]
    Hc, Dk, Dv = attn.cache_heads, attn.key_dim, attn.value_dim
    empty_k = x.new_zeros(B, Hc, 0, Dk)
    empty_v = x.new_zeros(B, Hc, 0, Dv)
    empty_p = positions.new_zeros(B, Hc, 0)
    return attn(x, positions, empty_k, empty_v, empty_p)[0]


def refit_layer(original_attn, mla_attn, x: torch.Tensor, settings: RefitSettings) -> dict:
    """Fit ``mla_attn``'s new projections (:data:`NEW_PARAMETERS`) to ``original_attn``'s output on x (B, T, H), the
    layer's attention inputs from the original model, in place. -> {"loss_before", "loss_after", "fitted",
    "seconds"}: the relative squared error on x before and after; when the fit did not lower it (``fitted`` False:
    e.g. an exact rewrite, whose error is rounding) the rewrite's weights are put back."""
    s = settings
    t0 = time.perf_counter()
    B, T = x.shape[:2]
    positions = torch.arange(T, device=x.device).expand(B, T)
    with torch.enable_grad():
        with torch.no_grad():
            target = _attention_out(original_attn, x, positions)
            norm = target.pow(2).mean().clamp(min=1e-30)
        absorb = mla_attn.absorb
        mla_attn.absorb = False  # the decompressed path trains the same function with plain autograd ops
        named = dict(mla_attn.named_parameters())
        params = [named[n] for n in NEW_PARAMETERS if n in named]
        was = {n: p.requires_grad for n, p in named.items()}
        for n, p in named.items():
            p.requires_grad_(n in NEW_PARAMETERS)
        start = [q.detach().clone() for q in params]
        try:
            opt = torch.optim.Adam(params, lr=s.lr)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=s.steps)
            before = after = None
            for _ in range(s.steps):
                opt.zero_grad(set_to_none=True)
                loss = (_attention_out(mla_attn, x, positions) - target).pow(2).mean() / norm
                if before is None:
                    before = loss.item()
                loss.backward()
                opt.step()
                sched.step()
            with torch.no_grad():
                after = ((_attention_out(mla_attn, x, positions) - target).pow(2).mean() / norm).item()
                kept = after < before
                if not kept:  # never worse than the rewrite on the calibration text (e.g. an exact rewrite)
                    for q, q0 in zip(params, start, strict=True):
                        q.copy_(q0)
                    after = before
        finally:
            for n, p in named.items():
                p.requires_grad_(was[n])
                p.grad = None
            mla_attn.absorb = absorb
    return {"loss_before": before, "loss_after": after, "fitted": kept, "seconds": round(time.perf_counter() - t0, 2)}


def refit(original, mla, calibration_ids: torch.Tensor, settings: RefitSettings | None = None, progress=None) -> dict:
    """Fit ``mla``'s new projections layer by layer to ``original``'s attention outputs (module docstring), in place.

    original: the kvexport Decoder the rewrite started from; mla: its MLA rewrite (same layers);
    calibration_ids (B, T) token ids. Returns :func:`summary` of the per-layer results.
    (``rewrite_to_mla(..., refit=settings)`` does the same inside the rewrite, one layer at a time.)
    """
    from kvexport.mla.calibration import calibration_inputs

    s = settings or RefitSettings()
    if len(original.layers) != len(mla.layers):
        raise BadUsage("refit needs the MLA rewrite of the same model")
    B, T = calibration_ids.shape
    xs = calibration_inputs(original, calibration_ids)  # per layer (B·T, H)
    layers = []
    for i, (lo, lm) in enumerate(zip(original.layers, mla.layers, strict=True)):
        if progress is not None:
            progress(f"refit: layer {i + 1}/{len(mla.layers)}")
        x = xs[i].view(B, T, -1).to(next(lm.self_attn.parameters()).dtype)
        xs[i] = None  # type: ignore[call-overload]
        layers.append(refit_layer(lo.self_attn, lm.self_attn, x, s))
    return summary(layers, s, B * T)


def summary(layers: list[dict], settings: RefitSettings, tokens: int) -> dict:
    """Per-layer refit results on ``tokens`` calibration tokens -> {"layers", "seconds", "tokens", "steps", "lr",
    "loss_before", "loss_after"} (the losses: mean over layers)."""
    n = max(1, len(layers))
    return {"layers": layers, "seconds": round(sum(r["seconds"] for r in layers), 1), "tokens": int(tokens),
            "steps": settings.steps, "lr": settings.lr,
            "loss_before": sum(r["loss_before"] for r in layers) / n,
            "loss_after": sum(r["loss_after"] for r in layers) / n}


__all__ = ["RefitSettings", "refit", "refit_layer", "summary", "NEW_PARAMETERS"]
