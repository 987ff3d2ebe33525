# SPDX-License-Identifier: Apache-2.0
"""checkpoint_size reads parameters and bytes from the safetensors headers, as the loaded model counts them."""

from __future__ import annotations

import pytest
import torch

from kvexport.models.loading import checkpoint_size
from kvexport.models.tiny import tiny_model


@pytest.mark.parametrize("dtype,tie", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, True)])
def test_checkpoint_size_matches_the_model(tmp_path, dtype, tie):
    hf = tiny_model("llama", tie_word_embeddings=tie).to(dtype)
    hf.save_pretrained(str(tmp_path))
    n = sum(p.numel() for p in hf.parameters())  # a tied head counted once
    assert checkpoint_size(tmp_path) == (n, n * torch.finfo(dtype).bits // 8)
