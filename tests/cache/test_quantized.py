# SPDX-License-Identifier: Apache-2.0
"""Quantized caches (kvexport.cache.quant / formats): the row quantization against independent NumPy math (int8)
and the float8 e4m3fn casts of torch and ml_dtypes (fp8), its round-trip bounds, and the PyTorch cache of every
family in int8 / fp8 against its fp32 twin (same model, press and prompt; only the storage differs).

Stated tolerances (tiny random models, prompt of 40 tokens, teacher-forced decode of 12 steps):

- full cache (no press): normwise relative logit error ``max|a - b| / max|b|`` <= 0.02 (int8), <= 0.08 (fp8),
  0.005 (fp16);
- with a press (SnapKV, budget 12): the kept sets overlap the twin's by >= 0.9 (kept positions, all layers and
  heads; a near-tie may flip); fp16 keeps the twin's sets exactly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kvexport.cache import quant
from kvexport.cache.formats import FORMATS, KV_DTYPES, SCALE_BYTES, kv_format, layer_fields
from kvexport.errors import BadUsage
from kvexport.generation import generate
from kvexport.models.decoder import Decoder
from kvexport.presses import make_press
from tests.conftest import FAMILIES, FAMILY_IDS

INT8, FP8 = FORMATS["int8"], FORMATS["fp8"]


def _rows(seed: int = 0, n: int = 3000, d: int = 48) -> torch.Tensor:
    """Rows spanning 10 decades of magnitude, with zeros, one-hot rows, ties at rounding midpoints, and negatives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-7, 3, n)[:, None]
    x[0] = 0.0
    x[1] = 0.0
    x[1, 3] = -5.0
    x[2] = torch.linspace(-1, 1, d)
    x[3, :8] = torch.tensor([448.0, 1.0625, 1.1875, 1.9375, -2.0 ** -7, 2.0 ** -9 * 1.5, 3.0, -447.0])
    return x


def _numpy_scale(x: np.ndarray, qmax: float) -> np.ndarray:
    a = np.abs(x.astype(np.float32)).max(-1)
    return np.clip(a / np.float32(qmax), np.float32(2.0**-14), np.float32(65504)).astype(np.float16)


def test_int8_codes_equal_numpy_math():
    x = _rows()
    codes, scale = quant.quantize(x, INT8)
    xn = x.numpy()
    s = _numpy_scale(xn, 127)
    q = np.clip(np.rint(xn / s.astype(np.float32)[:, None]), -127, 127)  # np.rint: round half to even
    np.testing.assert_array_equal(scale.numpy(), s)
    np.testing.assert_array_equal(codes.numpy(), (q + 128).astype(np.uint8))
    back = quant.dequantize(codes, scale, INT8, torch.float32).numpy()
    np.testing.assert_array_equal(back, (q * s.astype(np.float32)[:, None]).astype(np.float32))


def test_fp8_codes_equal_the_e4m3fn_casts_of_torch_and_ml_dtypes():
    x = _rows(1)
    codes, scale = quant.quantize(x, FP8)
    s = _numpy_scale(x.numpy(), 448)
    np.testing.assert_array_equal(scale.numpy(), s)
    y = x / torch.from_numpy(s).float()[:, None]
    want_torch = y.to(torch.float8_e4m3fn).view(torch.uint8)
    want_ml = y.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    neg_zero = (want_torch == 0x80) & (codes == 0)  # -0 is stored as +0: the same value
    assert bool((neg_zero | (codes == want_torch)).all())
    np.testing.assert_array_equal(np.where(neg_zero.numpy(), 0, want_ml), codes.numpy())
    back = quant.dequantize(codes, scale, FP8, torch.float32)
    ref = codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32) * s.astype(np.float32)[:, None]
    np.testing.assert_array_equal(back.numpy(), ref)


def test_fp8_value_table_is_e4m3fn():
    table = quant.FP8_VALUES.numpy()
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(table), np.isnan(want))
    np.testing.assert_array_equal(table[~np.isnan(table)], want[~np.isnan(want)])


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_round_trip_bounds(name):
    """int8: |x - x'| <= scale / 2. fp8: |x - x'| <= max(|x| / 16, 2^-10 scale). Scales are normal float16."""
    fmt = FORMATS[name]
    x = _rows(2)
    codes, scale = quant.quantize(x, fmt)
    back = quant.dequantize(codes, scale, fmt, torch.float32)
    s = scale.float()[:, None]
    err = (x - back).abs()
    tiny = 1e-6 * s  # float32 rounding of the product
    if name == "int8":
        assert bool((err <= s / 2 + tiny).all()), float((err / s).max())
    else:
        assert bool((err <= torch.maximum(x.abs() / 16, s * 2.0**-10) + tiny).all())
    assert bool((scale.float() >= 2.0**-14).all()) and bool(torch.isfinite(scale.float()).all())
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float16
    # an all-zero row reads back as zeros; the largest magnitude of a row is kept within the bound
    assert bool((back[0] == 0).all())


def test_encode_decode_float_formats_and_width_zero():
    x = torch.randn(2, 1, 5, 6)
    for name in ("fp32", "fp16", "bf16"):
        stored, scale = quant.encode(x, FORMATS[name])
        assert scale is None and stored.dtype == quant.storage_dtype(FORMATS[name])
        torch.testing.assert_close(quant.decode(stored, None, FORMATS[name], torch.float32), x.to(stored.dtype).float())
    empty = torch.zeros(2, 1, 5, 0)
    for name in ("int8", "fp8"):
        stored, scale = quant.encode(empty, FORMATS[name])
        assert stored.shape == empty.shape and stored.dtype == torch.uint8 and scale is None


def test_format_table():
    assert list(FORMATS) == list(KV_DTYPES)
    assert [FORMATS[n].row_bytes(64) for n in KV_DTYPES] == [256, 128, 128, 64 + SCALE_BYTES, 64 + SCALE_BYTES]
    assert layer_fields(32, INT8) == ("k", "v", "pos", "ks", "vs")
    assert layer_fields(0, FP8) == ("k", "v", "pos", "ks")
    assert layer_fields(32, FORMATS["fp16"]) == ("k", "v", "pos")


@pytest.mark.parametrize("bad", ["int4", "float8", "FP8", ""])
def test_bad_kv_dtype_is_one_line(bad):
    with pytest.raises(BadUsage) as e:
        kv_format(bad)
    msg = str(e.value)
    assert "\n" not in msg and "fp32, fp16, bf16, int8, fp8" in msg and repr(bad) in msg


def _rel(a, b) -> float:
    a, b = torch.stack(a).float(), torch.stack(b).float()
    return float((a - b).abs().max() / b.abs().max())


def _kept_overlap(ra, rb) -> float:
    same = total = 0
    for ka, kb in zip(ra.kept_positions, rb.kept_positions, strict=True):
        for a, b in zip(ka, kb, strict=True):
            for r in range(a.shape[0]):
                for h in range(a.shape[1]):
                    x, y = set(a[r, h][a[r, h] >= 0].tolist()), set(b[r, h][b[r, h] >= 0].tolist())
                    same, total = same + len(x & y), total + len(y)
    return same / max(total, 1)


TWIN_TOL = {"fp16": 0.005, "int8": 0.02, "fp8": 0.08}


@pytest.mark.parametrize("family,extra", FAMILIES, ids=FAMILY_IDS)
def test_pytorch_cache_against_its_fp32_twin(tiny_models, family, extra):
    dec = Decoder.from_hf(tiny_models(family, **extra))
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    twin = generate(dec, ids, max_new_tokens=12, chunk=16, keep_logits=True)
    press = make_press("snapkv", budget=12, window_size=4)
    twin_p = generate(dec, ids, press=press, window=4, chunk=16, max_new_tokens=12, keep_logits=True, track_kept=True)
    for name, tol in TWIN_TOL.items():
        got = generate(dec, ids, max_new_tokens=12, chunk=16, keep_logits=True, kv_dtype=name, forced_tokens=twin.tokens)
        rel = _rel([got.prompt_logits, *got.step_logits], [twin.prompt_logits, *twin.step_logits])
        assert rel <= tol, (name, rel)
        got_p = generate(dec, ids, press=press, window=4, chunk=16, max_new_tokens=12, keep_logits=True,
                         track_kept=True, kv_dtype=name, forced_tokens=twin_p.tokens)
        assert got_p.compaction_steps == twin_p.compaction_steps
        overlap = _kept_overlap(got_p, twin_p)
        assert overlap >= (1.0 if name == "fp16" else 0.9), (name, overlap)


def test_cache_stores_codes_and_counts_them():
    """Buffers as stated: uint8 K/V codes, float16 scales per token and head; resident bytes count both; the
    PyTorch cache reads back exactly what kvexport.cache.quant decodes from its own buffers."""
    dec = Decoder.from_hf(__import__("kvexport.models.tiny", fromlist=["tiny_model"]).tiny_model("llama"))
    s = dec.spec
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    for name in ("int8", "fp8"):
        res = generate(dec, ids, press=make_press("knorm", budget=12), window=4, chunk=8, max_new_tokens=6,
                       kv_dtype=name)
        cache = res.cache
        ly = cache.layers[0]
        assert ly.k.dtype == torch.uint8 and ly.ks.dtype == torch.float16 and ly.ks.shape == ly.k.shape[:3]
        k, v, _ = ly.view(ly.fill)  # GQA attention is handed the codes (it reads a decode step's past by them)
        assert isinstance(k, quant.QuantizedRows) and isinstance(v, quant.QuantizedRows)
        assert k.codes.data_ptr() == ly.k.data_ptr() and v.scale.data_ptr() == ly.vs.data_ptr()  # views, no copy
        k = k.dequantize(torch.float32)
        torch.testing.assert_close(k, quant.dequantize(ly.k[:, :, : ly.fill], ly.ks[:, :, : ly.fill], FORMATS[name],
                                                       torch.float32), atol=0, rtol=0)
        L, H, cap, D, Hq, W = s.num_layers, s.num_kv_heads, 16, s.head_dim, s.num_heads, 4
        assert res.resident_bytes == {"kv": 2 * L * H * cap * D, "scales": 2 * L * H * cap * SCALE_BYTES,
                                      "positions": L * H * cap * 8, "queries": L * Hq * W * D * 4,
                                      "query_positions": W * 8, "step_outputs": 0, "logits": 0, "staging": 0,
                                      "total": res.resident_bytes["total"]}  # the PyTorch cache has no step buffers
        assert res.resident_bytes["total"] == sum(v for k, v in res.resident_bytes.items() if k != "total")
