# SPDX-License-Identifier: Apache-2.0
"""Decoder.from_hf shares the HF model's tensors (no copy), and nothing kvexport does afterwards with the Decoder
(the MLA rewrite, an fp16 export, a forward pass) writes into them: the HF model stays the reference it was."""

from __future__ import annotations

import pytest
import torch

from kvexport.models.decoder import Decoder
from kvexport.models.tiny import tiny_model


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    now = model.state_dict()
    return [k for k, v in before.items() if now[k].dtype != v.dtype or not torch.equal(now[k], v)]


@pytest.mark.parametrize("family,kw", [("llama", {}), ("qwen3", {"head_dim": 32}),
                                       ("llama", {"tie_word_embeddings": True})])
def test_from_hf_shares_every_weight(family, kw):
    hf = tiny_model(family, **kw)
    dec = Decoder.from_hf(hf)
    hf_ptrs = {p.data_ptr() for p in hf.parameters()}
    dec_params = {id(p): p for p in dec.parameters()}.values()
    assert all(p.data_ptr() in hf_ptrs for p in dec_params)  # no parameter of its own
    assert not any(t.is_meta for t in list(dec.parameters()) + list(dec.buffers()))
    if hf.config.tie_word_embeddings:
        assert dec.lm_head.weight is dec.embed_tokens.weight
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        ref = hf(ids).logits
        out = dec(ids, pos)  # (B, T, V)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_rewrite_and_half_export_leave_the_original_alone(tmp_path):
    """The MLA rewrite (reads the layers, builds new ones) and an fp16 export of the shared Decoder (the export
    casts its module) leave every HF tensor bit for bit as it was."""
    from kvexport.export import export_model
    from kvexport.mla.config import MLASettings
    from kvexport.mla.rewrite import rewrite_to_mla

    hf = tiny_model("llama", tie_word_embeddings=True)
    before = _snapshot(hf)
    dec = Decoder.from_hf(hf)
    mla = rewrite_to_mla(dec, MLASettings(kv_rank=16, rope_dim=8))
    assert not _unchanged(hf, before)
    hf_ptrs = {p.data_ptr() for p in hf.parameters()}
    assert not any(p.data_ptr() in hf_ptrs for p in mla.parameters())  # the rewrite's model is its own copy
    export_model(dec, tmp_path / "fp16", dtype="fp16", max_positions=128)
    assert not _unchanged(hf, before)
    export_model(hf, tmp_path / "hf-fp16", dtype="fp16", max_positions=128)  # an in-memory HF model as well
    assert not _unchanged(hf, before)
