# SPDX-License-Identifier: Apache-2.0
"""``twin_compare_exports``: an int8 export against an fp32 export of the same model on onnxruntime (what
``bench_quantized.py --runtime onnxruntime`` reports), its figures checked against runs of the two exports made
here and compared with NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from kvexport.errors import BadUsage
from kvexport.export import OrtGenerator, export_model
from kvexport.export.twin import twin_compare_exports
from kvexport.presses import make_press

P, T = 40, 6


@pytest.fixture(scope="module")
def exports(tiny_models, tmp_path_factory):
    hf = tiny_models("llama")
    root = tmp_path_factory.mktemp("twin-exports")
    kw = dict(press=make_press("snapkv", budget=12, window_size=4), window=4, chunk=8, batch=2, mla_rank=16, rope_dim=4)
    return {k: export_model(hf, root / k, kv_dtype=k, **kw) for k in ("fp32", "int8")}


def test_figures_equal_runs_of_the_two_exports(exports):
    wins = np.random.default_rng(3).integers(3, 128, (4, P + T + 1))
    got = twin_compare_exports(exports["fp32"], {"int8": exports["int8"]}, wins, P, T)["int8"]
    ref_gen, q_gen = OrtGenerator(exports["fp32"]), OrtGenerator(exports["int8"])
    agree, kl, n = 0, 0.0, 0
    for s in (0, 2):
        ref = ref_gen.generate(wins[s : s + 2, :P], max_new_tokens=T, keep_logits=True)
        q = q_gen.generate(wins[s : s + 2, :P], max_new_tokens=T, forced_tokens=ref.tokens, keep_logits=True)
        a = np.stack([ref.prompt_logits, *ref.step_logits], 1)[:, :T].astype(np.float64)
        b = np.stack([q.prompt_logits, *q.step_logits], 1)[:, :T].astype(np.float64)
        np.testing.assert_array_equal(a.argmax(-1), ref.tokens[:, :T])  # the reference decoded greedily
        la = a - np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True)) - a.max(-1, keepdims=True)
        lb = b - np.log(np.exp(b - b.max(-1, keepdims=True)).sum(-1, keepdims=True)) - b.max(-1, keepdims=True)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kl += float((np.exp(la) * (la - lb)).sum())
        n += a.shape[0] * a.shape[1]
    assert got["scored_tokens"] == n == 4 * T and got["windows"] == 4
    assert got["next_token_agreement"] == agree / n
    assert got["mean_kl"] == pytest.approx(kl / n, rel=1e-6, abs=1e-12)
    assert got["cache_bytes"]["int8"] < got["cache_bytes"]["fp32"]
    assert got["candidate"].startswith("int8 export") and "fp32 export" in got["reference"]


def test_windows_must_fill_the_exports_batches(exports):
    wins = np.zeros((3, P + T + 1), np.int64)
    with pytest.raises(BadUsage, match="3 windows do not fill batches of 2"):
        twin_compare_exports(exports["fp32"], {"int8": exports["int8"]}, wins, P, T)
