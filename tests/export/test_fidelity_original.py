# SPDX-License-Identifier: Apache-2.0
"""The fidelity check reads the original model's long prefix in chunks (kvexport.export.fidelity._prefill_chunks):
its scored logits equal one transformers forward over the whole window, and greedy answers continued from the
chunked cache equal transformers' own generate."""

from __future__ import annotations

import pytest
import torch

from kvexport.export.fidelity import _cache_kw, _prefill_chunks
from kvexport.models.tiny import tiny_model


@pytest.mark.parametrize("family,kw", [("llama", {}), ("mistral", {"sliding_window": 24})])
def test_chunked_prefix_gives_the_whole_forward_logits(family, kw):
    hf = tiny_model(family, vocab_size=128, **kw)
    ids = torch.randint(0, 128, (2, 101), generator=torch.Generator().manual_seed(0))
    P, T = 90, 11
    with torch.no_grad():
        whole = hf(ids).logits[:, P - 1 : P + T - 1]
        cache = _prefill_chunks(hf, ids[:, : P - 1], chunk=16)
        assert cache.get_seq_length() == P - 1 or kw  # a sliding layer keeps its window only
        part = hf(ids[:, P - 1 : P + T - 1], use_cache=True, **{_cache_kw(hf): cache}).logits
    assert part.shape == whole.shape
    torch.testing.assert_close(part, whole, atol=1e-5, rtol=1e-5)


def test_generate_from_the_chunked_cache_is_transformers_generate():
    hf = tiny_model("llama", vocab_size=128)
    t = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(t), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = hf.generate(t, **kw)
        got = hf.generate(t, **{_cache_kw(hf): _prefill_chunks(hf, t[:, :-1], chunk=16)}, **kw)
    assert torch.equal(got, ref)
