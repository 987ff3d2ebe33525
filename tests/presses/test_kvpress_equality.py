# SPDX-License-Identifier: Apache-2.0
"""At a single-shot prefill, the kept index sets equal NVIDIA kvpress's, for every press kvpress has.

How it is proven: a **recorded fixture**. kvpress needs transformers<5.3 and kvexport transformers 5.x,
so ``tests/fixtures/kvpress/make_fixtures.py`` was run once in a separate venv (kvpress 0.5.5,
transformers 5.2.0, torch 2.13.0): it built tiny random-weight models of each family (Llama GQA, Llama
MHA, Qwen2, Qwen3, Mistral; fixed seeds, saved next to it as config + fp16 safetensors), ran each kvpress
press through kvpress's own hooks at ratios 0.25 / 0.5 / 0.75 on a fixed 2 x 160-token prompt with eager
attention, and recorded which tokens each layer kept per (batch, KV head), plus kvpress's score gap at
the top-k boundary. This test loads the same weights with transformers 5, runs kvexport's single-shot
prefill with the press of the same name and ratio, and asserts set equality per layer / (batch, head).

SnapKV and PyramidKV are recorded only where the budget exceeds their 64-token window (below it kvpress
keeps an arbitrary subset of 64 equal window scores). Every recorded case currently matches exactly; a
mismatch is tolerated only where kvpress's own boundary gap is below ``NEAR_TIE`` (a float near-tie
whose side depends on summation order) and then at most one token per head may differ.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from kvexport.models.decoder import Decoder
from kvexport.presses import make_press
from tests.cache._drive import prefill

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kvpress"
NEAR_TIE = 1e-6
RECORD = json.loads((FIXTURES / "kept.json").read_text())
CASES = [(r["family"], r["press"], r["ratio"]) for r in RECORD["kept"]]
EXTRA = {"random": {"seed": 42}}


@lru_cache(maxsize=None)
def decoder_for(family: str) -> Decoder:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(FIXTURES / RECORD["families"][family], dtype=torch.float32,
                                              attn_implementation="eager")
    return Decoder.from_hf(hf.eval())


def kept_sets(family: str, press_name: str, ratio: float) -> list[list[list[set[int]]]]:
    """Our single-shot prefill -> per layer, per batch row, per KV head: the kept token indices."""
    dec = decoder_for(family)
    ids = torch.tensor(RECORD["prompt"])
    B, N = ids.shape
    press = make_press(press_name, compression_ratio=ratio, **EXTRA.get(press_name, {}))
    cache = dec.new_cache(B, press, press.layer_budgets(dec.spec.num_layers, N), window=1)
    positions = torch.arange(N).expand(B, N)
    with torch.no_grad():
        prefill(dec, cache, ids, positions)
    return [[[set(row.tolist()) for row in layer.pos[b, :, : layer.fill]] for b in range(B)]
            for layer in cache.layers]


def unpack(mask_hex: str) -> set[int]:
    m = int(mask_hex, 16)
    return {i for i in range(m.bit_length()) if (m >> i) & 1}


@pytest.mark.parametrize("family,press_name,ratio", CASES, ids=[f"{f}-{p}-{r}" for f, p, r in CASES])
def test_kept_indices_equal_kvpress(family, press_name, ratio):
    rec = next(r for r in RECORD["kept"] if (r["family"], r["press"], r["ratio"]) == (family, press_name, ratio))
    ours = kept_sets(family, press_name, ratio)
    assert len(ours) == len(rec["layers"])
    for li, (our_layer, ref_layer) in enumerate(zip(ours, rec["layers"], strict=True)):
        for b, (our_row, ref_row) in enumerate(zip(our_layer, ref_layer, strict=True)):
            for h, (mine, ref_hex) in enumerate(zip(our_row, ref_row, strict=True)):
                ref = unpack(ref_hex)
                assert len(mine) == len(ref), f"layer {li} b{b} h{h}: kept {len(mine)} tokens, kvpress {len(ref)}"
                if mine == ref:
                    continue
                diff = sorted(mine ^ ref)
                assert rec["gaps"][li] < NEAR_TIE and len(diff) <= 2, (
                    f"layer {li} batch {b} head {h}: sets differ at {diff} (kvpress boundary gap {rec['gaps'][li]:.2e})"
                )
