# SPDX-License-Identifier: Apache-2.0
"""A tiny HF model directory with a real tokenizer, for end-to-end tests of convert/profile/report."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvexport.paths import MODELS_DIR

TOKENIZER_DIR = MODELS_DIR / "tokenizer"


def make_tiny_hf_dir(path: Path, family: str = "llama", **kw) -> Path:
    """Save a random tiny ``family`` model (vocab 4096 = the bundled tokenizer's) with that tokenizer."""
    from kvexport.models.tiny import tiny_model

    cfg = dict(vocab_size=4096, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
               max_positions=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    cfg.update(kw)
    model = tiny_model(family, **cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / f, path / f)
    return path
