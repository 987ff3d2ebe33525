# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: tiny random-weight HF models of every supported family, built from configs."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

#: (family, extra config) covering MHA and GQA, biases, q/k norms and explicit head_dim
FAMILIES = [
    ("llama", {}),
    ("llama", {"kv_heads": 4}),  # MHA
    ("qwen2", {}),  # q/k/v bias
    ("qwen3", {"head_dim": 32}),  # q_norm/k_norm, head_dim != hidden/heads
    ("mistral", {}),
]
FAMILY_IDS = ["llama-gqa", "llama-mha", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="session")
def tiny_models():
    """Cache of (family, kw) -> HF model, made on first use."""
    from kvexport.models.tiny import tiny_model

    made: dict = {}

    def get(family: str = "llama", **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = tiny_model(family, **kw)
        return made[key]

    return get
