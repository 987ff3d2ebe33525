# SPDX-License-Identifier: Apache-2.0
"""sliding_window is honoured, not ignored: logits equal transformers' for Mistral (every layer windowed) and
Qwen2/Qwen3 (the layers ``layer_types`` marks sliding) with a window shorter than the prompt, in PyTorch and in
the exported graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.generation import generate
from kvexport.models.decoder import Decoder
from kvexport.models.spec import ModelSpec
from kvexport.models.tiny import tiny_model

CASES = {
    "mistral": ("mistral", dict(sliding_window=16)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, head_dim=32)),
}


@pytest.fixture(scope="module", params=list(CASES))
def windowed(request):
    family, kw = CASES[request.param]
    return request.param, tiny_model(family, **kw)


def test_spec_reads_the_windows(windowed):
    name, hf = windowed
    spec = ModelSpec.from_hf_config(hf.config)
    want = {"mistral": (16, 16), "qwen2": (None, 16), "qwen3": (16, 16)}[name]
    assert spec.sliding_windows == want


@torch.no_grad()
def test_logits_equal_transformers_past_the_window(windowed):
    _, hf = windowed
    dec = Decoder.from_hf(hf)
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: the window counts positions, as transformers' mask counts indices
    ref = hf(ids, attention_mask=mask).logits
    pos = torch.where(mask.bool(), mask.cumsum(-1) - 1, torch.full_like(mask, -1))
    got = dec(ids, pos, None)
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)
    # chunked through the cache and greedy decoding: transformers' generate
    res = generate(dec, ids, mask, chunk=16, max_new_tokens=12)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, 60:]
    assert torch.equal(res.tokens, want)


def test_export_keeps_the_window(windowed, tmp_path):
    from kvexport.export import OrtGenerator, export_model, validate
    from kvexport.runtime import Stream

    _, hf = windowed
    out = export_model(hf, tmp_path / "x", press="snapkv", budget=70, window=8, chunk=16)
    gen = OrtGenerator(out)
    ids = np.random.default_rng(1).integers(3, 128, (1, 50))
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits[0, -1].numpy()
    np.testing.assert_allclose(Stream(gen, ids).prefill()[0], ref, atol=1e-4, rtol=1e-4)  # 50 < budget: nothing evicted yet
    pair = validate(out, model=hf, prompts=[50, 90], steps=12, fidelity=False, write=False)["pairs"]
    assert pair["pytorch~onnxruntime"]["passed"]
