# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: tiny random-weight HF models of every supported family, built from configs."""

from __future__ import annotations

import os
from pathlib import Path

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


def shared_root(tmp_path_factory) -> Path:
    """A folder all xdist workers of this run see (the run's base temp; alone: this session's own): where fixtures
    shared between workers build once under a file lock (tests/serve, tests/real)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
