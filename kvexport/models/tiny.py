# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight HF models built from configs (tests, smoke runs; nothing is downloaded)."""

from __future__ import annotations

import torch


def tiny_config(family: str = "llama", *, vocab_size: int = 128, hidden_size: int = 64, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, head_dim: int | None = None, intermediate_size: int = 128,
                max_positions: int = 4096, **extra):
    """A transformers config of the given family ("llama", "qwen2", "qwen3", "mistral")."""
    import transformers as tf

    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
           "mistral": tf.MistralConfig}[family]
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate_size,
              max_position_embeddings=max_positions, tie_word_embeddings=False)
    if head_dim is not None:
        kw["head_dim"] = head_dim
    if family == "mistral":
        kw["sliding_window"] = None
    kw.update(extra)
    return cls(**kw)


def tiny_model(family: str = "llama", seed: int = 0, dtype=torch.float32, **kw):
    """A random-weight ``*ForCausalLM`` in eval mode with eager attention. Weights are scaled up a
    little from HF's init so that attention is not uniform (scores then differ between presses)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=dtype)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * (p.shape[1] ** -0.5))
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.1)
    return model.eval()
