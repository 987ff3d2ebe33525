# SPDX-License-Identifier: Apache-2.0
"""The bundled student's int8 / fp8 exports at convert's defaults (MLA at the default rank, SnapKV budget 256,
window 32, chunk 64: what ``kvexport convert --kv-dtype int8`` builds) against the PyTorch cache in the same format.

On a trained model and prompts of hundreds of tokens, onnxruntime and PyTorch compute a row to within float
rounding, and a number within that distance of a rounding boundary is stored one code apart; both runs then go on
from slightly different caches. Checked here, against the library path (:func:`kvexport.generation.generate` with
the export's settings, eager PyTorch): every stored code of every layer is at most one step of its format's value
grid from the reference's (int8: the code; fp8: the rank of its e4m3 value; measured: 117 int8 codes one step
apart over the two prompts, none more), every scale within 2^-7 of the reference's (rows written after a first
difference come from a cache that differs, so their scales can be a few float16 steps apart: measured 1.4e-3),
the slots' positions (what the press kept) and the number of compactions equal; and ``validate`` passes on the default prompts with the lossy-cache gates
(:data:`kvexport.export.parity.LOSSY_CACHE_TOLERANCES`), which the strict fp32 gates (1e-4) did not: this
conversion failed ``kvexport convert --kv-dtype int8`` before them (max logit error 0.14, tokens equal, 28 of 36 kept sets).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.cache.quant import FP8_VALUES
from kvexport.convert.config import DEFAULT_WINDOW, showcase_mla
from kvexport.export import OrtGenerator, export_model, verify_manifest
from kvexport.export.parity import LOSSY_CACHE_TOLERANCES, TOLERANCES, tolerances
from kvexport.export.reference import load_reference_model, reference_generate
from kvexport.export.source import press_from_dict
from kvexport.export.validation import validate
from kvexport.paths import DEFAULT_MODEL
from kvexport.presses import make_press
from kvexport.profile.run import model_spec

#: the cache these checks were measured on (convert's defaults before the real-model sweep chose 2048 / 512)
DEFAULT_BUDGET, DEFAULT_CHUNK = 256, 64


def _export(tmp_path, kv_dtype):
    rank, rope = showcase_mla(model_spec(DEFAULT_MODEL))
    return export_model(DEFAULT_MODEL, tmp_path / kv_dtype, press=make_press("snapkv", budget=DEFAULT_BUDGET),
                        window=DEFAULT_WINDOW, chunk=DEFAULT_CHUNK, mla_rank=rank, rope_dim=rope, kv_dtype=kv_dtype)


def _grid_rank(codes: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Position of each stored code on its format's sorted value grid (int8: the code itself)."""
    if kv_dtype == "int8":
        return codes.astype(np.int64)
    values = FP8_VALUES.double().numpy()
    grid = np.unique(values[~np.isnan(values)])  # +0 and -0 are one point
    return np.searchsorted(grid, values[codes.astype(np.int64)])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_student_codes_within_one_step_of_pytorch_and_validate_passes(tmp_path, kv_dtype):
    out = _export(tmp_path, kv_dtype)
    manifest = verify_manifest(out)
    s = manifest["settings"]
    assert s["kv_dtype"] == kv_dtype
    press = press_from_dict(s["press"])
    dec = load_reference_model(manifest, None, root=out)
    gen = OrtGenerator(out)
    steps = 64
    rng = np.random.default_rng(0)
    flipped, worst_scale = 0, 0.0
    for n in (1, 2 * DEFAULT_BUDGET + 3):  # one token then 64 decode steps; a prompt compacted at prefill
        ids = rng.integers(3, int(s["vocab_size"]), size=(1, n))
        mask = np.ones_like(ids)
        free = gen.generate(ids, mask, steps + 1, keep_logits=True)
        ref = reference_generate(dec, s, press, ids, mask, steps + 1, forced=torch.as_tensor(np.asarray(free.tokens)))
        assert ref.compactions == free.compactions
        for i, layer in enumerate(ref.cache.layers):
            a, b = np.asarray(gen.cache[f"k_{i}"]), layer.k.numpy()
            assert a.dtype == np.uint8 and a.shape == b.shape
            step = np.abs(_grid_rank(a, kv_dtype) - _grid_rank(b, kv_dtype))
            assert step.max() <= 1, (n, i, int(step.max()))
            flipped += int((step > 0).sum())
            sa = np.asarray(gen.cache[f"ks_{i}"]).astype(np.float64)
            sb = layer.ks.numpy().astype(np.float64)
            rel = float((np.abs(sa - sb) / np.maximum(np.abs(sb), 2.0 ** -24)).max())
            worst_scale = max(worst_scale, rel)
            assert rel <= 2.0 ** -7, (n, i, rel)
            assert np.array_equal(np.asarray(gen.cache[f"pos_{i}"]), layer.pos.numpy()), (n, i)
    gen.close()
    rep = validate(out, write=False)
    pair = rep["pairs"]["pytorch~onnxruntime"]
    atol, rtol, min_tok, min_idx = LOSSY_CACHE_TOLERANCES
    assert pair["tolerances"]["rtol"] == rtol
    # the gate scales with the logits (2 % of the largest |logit|, 0.25 at least); the student's stay within ±25
    assert atol <= pair["tolerances"]["atol"] <= 2 * atol, pair["tolerances"]
    assert pair["passed"], pair
    assert pair["max_abs_logit_error"] <= atol and pair["token_agreement"] >= min_tok
    print(f"{kv_dtype}: {flipped} codes one step apart, scales within {worst_scale:.2e}; validate max abs logit error {pair['max_abs_logit_error']:.3g}")


def test_lossy_cache_gates_only_for_lossy_formats():
    assert tolerances({"dtype": "fp32", "kv_dtype": "fp32"}) == TOLERANCES["fp32"]
    assert tolerances({"dtype": "fp32"}) == TOLERANCES["fp32"]
    assert tolerances({"dtype": "fp16", "kv_dtype": "fp16"}) == TOLERANCES["fp16"]
    for kvd in ("int8", "fp8", "fp16", "bf16"):
        assert tolerances({"dtype": "fp32", "kv_dtype": kvd}) == LOSSY_CACHE_TOLERANCES
    assert tolerances({"dtype": "fp16", "kv_dtype": "int8"}) == LOSSY_CACHE_TOLERANCES  # at least as wide as the fp16 gates


def test_lossy_cache_ties_and_prompts():
    """A lossy cache widens the score-tie tolerance to fp16's (two runtimes may store a value one code apart), and
    validation's default prompts include one above twice the budget whenever the positions hold it (an evicting
    cache: SmolLM2's default budget 2048 of 8192 positions compacts in prefill only past 4096 tokens)."""
    from kvexport.export.parity import ParityRule, default_prompt_lengths
    from kvexport.export.ties import TIE_RTOL, TIE_RTOL_LOSSY_CACHE

    assert ParityRule({"dtype": "fp32", "kv_dtype": "int8"}).tie_rtol == TIE_RTOL_LOSSY_CACHE == TIE_RTOL["fp16"]
    assert ParityRule({"dtype": "fp32", "kv_dtype": "fp32"}).tie_rtol == TIE_RTOL["fp32"]
    evicting = {"chunk": 512, "budgets": [2048] * 30, "max_positions": 8192, "mode": "static",
                "capacities": [2080] * 30}
    assert 2 * 2048 + 3 in default_prompt_lengths(evicting)
    full = {"chunk": 64, "budgets": None, "max_positions": 1024, "mode": "static", "capacities": [512]}
    assert max(default_prompt_lengths(full)) < 256  # a full cache: prompt and decode steps fit the slots
