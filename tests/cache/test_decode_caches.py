# SPDX-License-Identifier: Apache-2.0
"""Several independent caches decoded in one batched forward (``Decoder.decode_caches``, what the PyTorch serve
backend steps its slots with): full caches of different fills give HF's logits; evicting caches (SnapKV, int8
storage, an MLA latent read as int8 codes) keep what each cache keeps when it is decoded alone and give its logits."""

from __future__ import annotations

import pytest
import torch

from kvexport.errors import BadUsage
from kvexport.mla import MLASettings, rewrite_to_mla
from kvexport.models.decoder import Decoder
from kvexport.presses import make_press

LENGTHS = (5, 19, 11)
PROMPTS = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
STEPS = 12


def prefill(dec, cache, ids):
    with torch.no_grad():
        return dec(ids, torch.arange(ids.shape[1])[None], cache, mode="prefill", last_only=True)[:, -1]


def test_full_caches_of_different_fills_give_hf_logits(tiny_models):
    hf = tiny_models("llama")
    dec = Decoder.from_hf(hf)
    caches = [dec.new_cache(1, None, 40, 0) for _ in PROMPTS]
    seqs = [p.clone() for p in PROMPTS]
    nxt = [prefill(dec, c, p).argmax(-1) for c, p in zip(caches, PROMPTS, strict=True)]
    for _ in range(STEPS):
        seqs = [torch.cat([s, t[:, None]], 1) for s, t in zip(seqs, nxt, strict=True)]
        ids = torch.cat([s[:, -1:] for s in seqs])
        pos = torch.tensor([[s.shape[1] - 1] for s in seqs])
        got = dec.decode_caches(ids, pos, caches)[:, -1]
        with torch.no_grad():
            want = torch.cat([hf(s).logits[:, -1] for s in seqs])
        assert (got - want).abs().max().item() < 1e-4
        nxt = list(got.argmax(-1, keepdim=True).unbind(0))


@pytest.mark.parametrize("model,kv_dtype", [("gqa", None), ("gqa", "int8"), ("mla", "int8")])
def test_evicting_caches_decoded_together_equal_each_alone(tiny_models, model, kv_dtype):
    dec = Decoder.from_hf(tiny_models("llama"))
    if model == "mla":
        dec = rewrite_to_mla(dec, MLASettings(kv_rank=16, rope_dim=8))
    press = make_press("snapkv", budget=6, window_size=4)

    def fresh():
        c = dec.new_cache(1, press, 6, 4)
        if kv_dtype:
            c.set_kv_dtype(kv_dtype, dec)
        return c

    together, alone = [fresh() for _ in PROMPTS], [fresh() for _ in PROMPTS]
    for a, b, p in zip(together, alone, PROMPTS, strict=True):
        prefill(dec, a, p)
        prefill(dec, b, p)
    if model == "mla" and kv_dtype:
        assert together[0].layers[0].reads_quantized  # the latent goes to attention as codes + scales
    tok = torch.randint(0, 128, (STEPS, len(PROMPTS)), generator=torch.Generator().manual_seed(3))
    for t in range(STEPS):
        pos = torch.tensor([[n + t] for n in LENGTHS])
        got = dec.decode_caches(tok[t][:, None], pos, together)[:, -1]
        with torch.no_grad():
            want = torch.cat([dec(tok[t][j].view(1, 1), pos[j:j + 1], c, mode="decode")[:, -1]
                              for j, c in enumerate(alone)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(together, alone, strict=True):
        assert a.compactions == b.compactions > 0
        for pa, pb in zip(a.kept_positions(), b.kept_positions(), strict=True):
            assert torch.equal(pa.sort(-1).values, pb.sort(-1).values)


def test_decode_caches_refuses_what_it_cannot_step(tiny_models):
    dec = Decoder.from_hf(tiny_models("llama"))
    caches = [dec.new_cache(1, None, 16, 0), dec.new_cache(1, make_press("snapkv", budget=6, window_size=4), 6, 4)]
    for c, p in zip(caches, PROMPTS[:2], strict=True):
        prefill(dec, c, p[:, :5])
    with pytest.raises(BadUsage, match="either all evict or none"):
        dec.decode_caches(torch.zeros(2, 1, dtype=torch.long), torch.tensor([[5], [5]]), caches)
    with pytest.raises(BadUsage, match="3 rows for caches of"):
        dec.decode_caches(torch.zeros(3, 1, dtype=torch.long), torch.tensor([[5], [5], [5]]), caches[:1])
