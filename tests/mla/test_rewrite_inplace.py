# SPDX-License-Identifier: Apache-2.0
"""rewrite_to_mla(inplace=True): the copying rewrite's model, built in the original's own Decoder (issue 20)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvexport.mla import MLASettings, rewrite_to_mla
from kvexport.mla.attention import MLAAttention
from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
POS = torch.arange(24).expand(2, 24)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_inplace_gives_the_copying_rewrites_logits_and_frees_the_gqa_projections(family):
    """Same logits as the default (copying) rewrite, bit for bit; the returned model is the Decoder passed in;
    once the HF model is dropped, no tensor of the old q/k/v/o projections is alive (weak references) and every
    tensor the model holds is either one it had before (embeddings, MLP, norms) or a new MLA weight."""
    settings = MLASettings(kv_rank=16, rope_dim=8)
    hf = tiny_model(family, num_hidden_layers=3, heads=4, kv_heads=2, seed=1)
    ref_dec = Decoder.from_hf(hf)
    want = rewrite_to_mla(ref_dec, settings)
    # the copy left the original alone: it is still GQA
    assert not any(isinstance(layer.self_attn, MLAAttention) for layer in ref_dec.layers)

    dec = Decoder.from_hf(hf)
    gqa = [weakref.ref(getattr(layer.self_attn, n).weight) for layer in dec.layers
           for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    kept_before = {n: t.data_ptr() for n, t in dec.state_dict().items() if ".self_attn." not in n}
    del hf, ref_dec
    got = rewrite_to_mla(dec, settings, inplace=True)
    assert got is dec
    assert all(isinstance(layer.self_attn, MLAAttention) for layer in got.layers)
    with torch.no_grad():
        assert torch.equal(got(IDS, POS), want(IDS, POS))
    gc.collect()
    assert [r() is None for r in gqa] == [True] * len(gqa)
    # the untouched modules are the original's own tensors, not copies
    now = {n: t.data_ptr() for n, t in got.state_dict().items() if ".self_attn." not in n}
    assert now == kept_before
    # and nothing of the copying result is shared with it
    theirs = {t.data_ptr() for t in want.state_dict().values()}
    assert not theirs & {t.data_ptr() for t in got.state_dict().values()}
