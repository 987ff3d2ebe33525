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
    """steps of Adam per layer at learning rate ``lr`` (cosine to 0), on calibration sequences of ``seq_len``."""

    steps: int = 200
    lr: float = 1e-3
    seq_len: int = 512

    def __post_init__(self):
        if self.steps < 1 or self.lr <= 0 or self.seq_len < 2:
            raise BadUsage(f"refit needs steps >= 1, lr > 0 and seq_len >= 2 (got {self.steps}, {self.lr}, "
                           f"{self.seq_len})")


def _attention_out(attn, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One attention module over x (B, T, H) alone (causal, no cache) -> (B, T, H)."""
    B = x.shape[0]
    Hc, Dk, Dv = attn.cache_heads, attn.key_dim, attn.value_dim
    empty_k = x.new_zeros(B, Hc, 0, Dk)
    empty_v = x.new_zeros(B, Hc, 0, Dv)
    empty_p = positions.new_zeros(B, Hc, 0)
    return attn(x, positions, empty_k, empty_v, empty_p)[0]


def refit(original, mla, calibration_ids: torch.Tensor, settings: RefitSettings | None = None, progress=None) -> dict:
    """Fit ``mla``'s new projections layer by layer to ``original``'s attention outputs (module docstring), in place.

    original: the kvexport Decoder the rewrite started from; mla: its MLA rewrite (same layers);
    calibration_ids (B, T) token ids. Returns {"layers": [{"loss_before", "loss_after"}], "seconds", "tokens"}.
    """
    from kvexport.mla.rewrite import calibration_inputs

    s = settings or RefitSettings()
    if len(original.layers) != len(mla.layers):
        raise BadUsage("refit needs the MLA rewrite of the same model")
    B, T = calibration_ids.shape
    t0 = time.time()
    xs = calibration_inputs(original, calibration_ids)  # per layer (B·T, H), float64
    positions = torch.arange(T).expand(B, T)
    report = []
    for i, (lo, lm) in enumerate(zip(original.layers, mla.layers, strict=True)):
        if progress is not None:
            progress(f"refit: layer {i + 1}/{len(mla.layers)}")
        x = xs[i].float().view(B, T, -1)
        xs[i] = None  # type: ignore[call-overload]
        with torch.no_grad():
            target = _attention_out(lo.self_attn, x, positions)
            norm = target.pow(2).mean()
        attn = lm.self_attn
        absorb = attn.absorb
        attn.absorb = False  # the decompressed path trains the same function with plain autograd ops
        named = dict(attn.named_parameters())
        params = [named[n] for n in NEW_PARAMETERS if n in named]
        frozen = [p for n, p in named.items() if n not in NEW_PARAMETERS]
        for p in frozen:
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=s.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=s.steps)
        with torch.no_grad():
            before = ((_attention_out(attn, x, positions) - target).pow(2).mean() / norm).item()
        for _ in range(s.steps):
            opt.zero_grad(set_to_none=True)
            loss = (_attention_out(attn, x, positions) - target).pow(2).mean() / norm
            loss.backward()
            opt.step()
            sched.step()
        with torch.no_grad():
            after = ((_attention_out(attn, x, positions) - target).pow(2).mean() / norm).item()
        for p in named.values():
            p.requires_grad_(False)
        attn.absorb = absorb
        report.append({"loss_before": before, "loss_after": after})
    return {"layers": report, "seconds": round(time.time() - t0, 1), "tokens": int(B * T), "steps": s.steps,
            "lr": s.lr}


__all__ = ["RefitSettings", "refit", "NEW_PARAMETERS"]
