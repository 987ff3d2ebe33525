# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of the MLA tests: a partial-RoPE reference attention and KL."""

from __future__ import annotations

import torch
from torch import nn

from kvexport.models.attention import grouped_attention
from kvexport.models.rope import Rotary


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over tokens of KL(softmax(ref) || softmax(logits)), nats."""
    lp, lq = ref_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


class PartialRopeReference(nn.Module):
    """What an MLA rewrite means at full rank, computed from the *original* GQA weights, no SVD:
    per head, channels of the chosen frequency pairs use the head-averaged key with RoPE, all other
    channels use the head's own key without RoPE; values unchanged. (Not for Qwen3's k_norm.)"""

    def __init__(self, attn, pairs: list[int]):
        super().__init__()
        self.a = attn
        D = attn.head_dim
        pt = torch.tensor(pairs)
        self.pe = torch.cat([pt, pt + D // 2])
        self.nope = torch.tensor([i for i in range(D) if i not in set(self.pe.tolist())], dtype=torch.long)
        self.rot = Rotary(attn.rotary.inv_freq[pt], attn.rotary.scaling)

    cache_heads = property(lambda self: self.a.num_kv_heads)
    key_dim = property(lambda self: self.a.head_dim)
    value_dim = property(lambda self: self.a.head_dim)

    def forward(self, h, positions, past_k, past_v, past_pos):
        a = self.a
        B, T, _ = h.shape
        q = a.q_proj(h).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        G = a.num_heads // a.num_kv_heads
        k_pe = k[..., self.pe].mean(1, keepdim=True)  # (B, 1, T, dr)
        k_full = torch.cat([k[..., self.nope].repeat_interleave(G, 1),
                            self.rot.apply(k_pe, positions).expand(B, a.num_heads, T, -1)], -1)
        q_full = torch.cat([q[..., self.nope], self.rot.apply(q[..., self.pe], positions)], -1)
        kp = positions[:, None].expand(B, a.num_heads, T)
        out, _ = grouped_attention(q_full, k_full, v.repeat_interleave(G, 1), positions, kp, a.scaling)
        return a.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None, None, None
