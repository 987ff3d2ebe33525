# SPDX-License-Identifier: Apache-2.0
"""Our decoder against HF's model: logits with a full cache, every family (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from kvexport.generation import generate
from kvexport.models.decoder import Decoder
from tests.conftest import FAMILIES, FAMILY_IDS


@pytest.mark.parametrize("family,kw", FAMILIES, ids=FAMILY_IDS)
def test_logits_match_hf(tiny_models, family, kw):
    hf = tiny_models(family, **kw)
    dec = Decoder.from_hf(hf)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 33))
    pos = torch.arange(33).expand(2, 33)
    with torch.no_grad():
        ref = hf(ids).logits
        # whole prompt, then in three chunks through a cache that never evicts
        assert (dec(ids, pos) - ref).abs().max().item() < 1e-4
        cache = dec.new_cache(2, None, 64, 4)
        outs = [dec(ids[:, s : s + 11], pos[:, s : s + 11], cache) for s in (0, 11, 22)]
    assert (torch.cat(outs, 1) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family,kw", FAMILIES, ids=FAMILY_IDS)
def test_greedy_decode_matches_hf_generate(tiny_models, family, kw):
    hf = tiny_models(family, **kw)
    dec = Decoder.from_hf(hf)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    res = generate(dec, ids, max_new_tokens=16, keep_logits=True)
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(res.tokens, ref.sequences[:, 20:])
    for ours, theirs in zip(res.step_logits, ref.logits[1:], strict=True):
        assert (ours - theirs).abs().max().item() < 1e-4


def test_left_padding_matches_unpadded(tiny_models):
    """A padded row gives the logits it gives alone: padding is never attended."""
    hf = tiny_models("llama")
    dec = Decoder.from_hf(hf)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, 128, (1, 12), generator=g), torch.randint(1, 128, (1, 7), generator=g)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 12), torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], 1)]).long()
    batch = generate(dec, ids, mask, max_new_tokens=8, keep_logits=True)
    alone = generate(dec, b, max_new_tokens=8, keep_logits=True)
    assert torch.equal(batch.tokens[1], alone.tokens[0])
    assert (batch.prompt_logits[1] - alone.prompt_logits[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("family,kw", FAMILIES, ids=FAMILY_IDS)
def test_last_only_prefill_gives_hf_logits_at_each_chunk_end(tiny_models, family, kw):
    """``last_only`` (what generate's prefill runs): each chunk returns only its last column's logits, HF's at that
    position, and the cache it leaves gives HF's logits to the next chunk."""
    hf = tiny_models(family, **kw)
    dec = Decoder.from_hf(hf)
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(33).expand(2, 33)
    with torch.no_grad():
        ref = hf(ids).logits
        assert (dec(ids, pos, last_only=True) - ref[:, -1:]).abs().max().item() < 1e-4
        cache = dec.new_cache(2, None, 64, 4)
        for s in (0, 11, 22):
            out = dec(ids[:, s : s + 11], pos[:, s : s + 11], cache, last_only=True)
            assert out.shape == (2, 1, ref.shape[-1])
            assert (out[:, 0] - ref[:, s + 10]).abs().max().item() < 1e-4
