# SPDX-License-Identifier: Apache-2.0
"""Config keys are read where the family's HF modules read them: ``attention_bias`` (Llama, Qwen3) and
``mlp_bias`` (Llama) add biases there; the same keys in another family's config.json are ignored by
transformers, and by kvexport too (the logits stay the HF model's)."""

from __future__ import annotations

import pytest
import torch

from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model


@pytest.mark.parametrize("family, extra, biased", [
    ("llama", {"attention_bias": True, "mlp_bias": True}, True),
    ("qwen3", {"attention_bias": True}, True),
    ("mistral", {"attention_bias": True, "mlp_bias": True}, False),
    ("qwen3", {"mlp_bias": True}, False),
    ("qwen2", {"attention_bias": True, "mlp_bias": True}, False),
])
def test_bias_keys_follow_the_hf_family(family, extra, biased):
    model = tiny_model(family, **extra)
    n_bias_hf = sum(1 for n, _ in model.named_parameters() if n.endswith("bias"))
    dec = Decoder.from_hf(model)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (dec(ids, torch.arange(40).expand(2, -1)) - model(ids).logits).abs().max().item()
    assert diff < 1e-4
    n_bias_ours = sum(1 for n, _ in dec.named_parameters() if n.endswith("bias"))
    assert n_bias_ours == n_bias_hf
    qwen2_qkv = 3 * len(model.model.layers) if family == "qwen2" else 0  # Qwen2 always biases q / k / v
    assert (n_bias_hf > qwen2_qkv) == biased
