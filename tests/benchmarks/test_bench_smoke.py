# SPDX-License-Identifier: Apache-2.0
"""Smoke test of ``python -m benchmarks --tiny`` plus the harness's bookkeeping (no timing assertions).

The run is one HF row and one kvexport static-budget row on a tiny random Llama at contexts 128/256; its
JSON must hold every (row, context) cell with positive numbers or an explicit OOM/timeout marker, and the
KV-cache bytes must equal the analytic formula (2·n_kv·d_h·L·4 bytes per token for a full fp32 cache;
(budget + window) slots for a static one) and the bytes onnxruntime actually allocated.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import quality, report
from benchmarks.rows import ROWS, SHAPES, Shape, prompt_tokens

TINY = SHAPES["tiny"]


def full_cache_bytes(s: Shape, tokens: int) -> int:
    return 2 * s.kv_heads * s.head_dim * s.layers * 4 * tokens


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from benchmarks.__main__ import main

    out = tmp_path_factory.mktemp("bench")
    cache = tmp_path_factory.mktemp("cache")
    rc = main(["--tiny", "--rows", "hf,kvx-streaming", "--steps", "4", "--no-optimum", "--out", str(out),
               "--cache", str(cache), "--cell-timeout", "120"])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_json_has_every_cell(tiny_run):
    out, res = tiny_run
    assert set(res["rows"]) == {"hf", "kvx-streaming"}
    cells = {(c["row"], c["context"]): c for c in res["cells"]}
    assert set(cells) == {(r, c) for r in ("hf", "kvx-streaming") for c in (128, 256)}
    for c in cells.values():
        assert c["status"] in ("ok", "oom", "timeout"), c
        if c["status"] == "ok":
            assert c["prefill_s"] > 0 and c["decode_ms_median"] > 0 and c["peak_rss"] > 0
            assert c["decode_steps"] == 4 and all(t > 0 for t in c["result"]["decode_ms"])
            assert c["bound"]["bytes_per_step"] > c["kv_bytes"]
    assert res["bandwidth"]["copy_gbps"] > 0
    md = (out / "results.md").read_text()
    assert "| hf |" in md and "| kvx-streaming |" in md and "### tiny" in md
    assert (out / "decode_ms.png").stat().st_size > 0 and (out / "peak_memory.png").stat().st_size > 0


def test_kv_bytes_match_formula_and_allocation(tiny_run):
    _, res = tiny_run
    for c in res["cells"]:
        n = c["prompt_tokens"] + res["settings"]["steps"]
        if c["row"] == "hf":
            assert c["kv_bytes"] == full_cache_bytes(TINY, n)
        else:
            assert c["kv_bytes"] == full_cache_bytes(TINY, TINY.budget + TINY.window)
            if c["status"] == "ok":  # what OrtGenerator bound as k/v buffers
                assert c["kv_bytes_measured"] == c["kv_bytes"]


#: K/V bytes of one sequence at 16,384 tokens, fp32, by hand: layers x elements per token and layer x 4 bytes x slots.
#: student: 4 layers, 2·2·32 = 128 elements (MLA 12 + 8 = 20); llama1b: 2 layers, 2·8·64 = 1024 (MLA 128 + 32 = 160);
#: a press holds budget 256 + window 32 = 288 slots, every other row the whole context (no capacity given);
#: convert's default export ("default") 2048 + 32 = 2080 slots of int8, 1 byte an element (its scales are resident
#: bytes, not K/V).
KV_BYTES_16K = {
    "student": {"full": 33_554_432, "press": 589_824, "mla": 5_242_880, "mla_press": 92_160, "default": 1_064_960},
    "llama1b": {"full": 134_217_728, "press": 2_359_296, "mla": 20_971_520, "mla_press": 368_640,
                "default": 4_259_840},
}


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("shape", ["student", "llama1b"])
def test_kv_bytes_by_hand(row, shape):
    """rows.Shape.kv_bytes (kvexport.cache.memory) against the numbers written out above (fp32; llama.cpp's
    cache is fp16, half)."""
    s, r = SHAPES[shape], ROWS[row]
    kind = {(False, False): "full", (False, True): "press", (True, False): "mla", (True, True): "mla_press"}
    if r.convert_defaults:
        assert s.kv_bytes(r, 16384) == KV_BYTES_16K[shape]["default"]
        return
    assert s.kv_bytes(r, 16384) == KV_BYTES_16K[shape][kind[r.mla, r.press is not None]] * r.kv_dtype_bytes // 4
    if r.mla:
        assert s.mla_ratio() == pytest.approx(6.4)


def test_mla_budget_goal_is_analytically_reachable():
    """The ≥50× KV goal at 16k on the student follows from the shapes alone (no run needed)."""
    s = SHAPES["student"]
    ratio = s.kv_bytes(ROWS["optimum"], 16384) / s.kv_bytes(ROWS["kvx-mla-snapkv"], 16384)
    assert ratio == pytest.approx(16384 * 128 / (288 * 20))


def test_prompt_tokens_leave_room_for_decoding():
    s = SHAPES["student"]
    assert prompt_tokens(s, 2048, 64) == 2048
    n = prompt_tokens(s, 32768, 64)
    assert -(-n // s.chunk) * s.chunk + 65 <= s.max_positions


def test_quality_lookup_matches_prompt_and_ratio(tmp_path):
    study = {"settings": {"prompt_len": 512}, "results": {"snapkv": {"0.5": {"agreement": 0.9, "ppl": 3.0},
                                                                     "0.9": {"agreement": 0.7, "ppl": 5.0}}}}
    (tmp_path / "study.json").write_text(json.dumps(study))
    st = quality.load_studies(tmp_path)
    assert quality.lookup(st, "snapkv", 256, 512)["agreement"] == 0.9  # 1 - 256/512 = 0.5
    assert quality.lookup(st, "snapkv", 256, 2048) is None  # no study at that prompt length
    assert quality.lookup(st, "snapkv", 100, 512) is None  # r = 0.80: no ratio within 0.05
    assert quality.lookup(st, None, None, 512) is None


def test_goals_from_synthetic_results():
    """Issue 15's targets computed from a synthetic results dict (the arithmetic, not a run)."""
    def cell(row, ctx, ms, peak=300, kv=1000, status="ok", bytes_per_step=None, shape="student"):
        c = {"shape": shape, "row": row, "context": ctx, "status": status, "decode_ms_median": ms, "peak_rss": peak,
             "kv_bytes": kv, "prompt_tokens": ctx, "prefill_tok_s": 1000.0}
        if bytes_per_step:
            c["bound"] = {"bytes_per_step": bytes_per_step, "fraction_of_bandwidth": 0.6, "floor_ms": ms * 0.6}
        return c

    res = {"shapes": {"student": {"weight_bytes": 1000}}, "settings": {"contexts": [512, 16384]},
           "cells": [cell("ortgenai", 512, 0.8), cell("ortgenai", 16384, 13.0),
                     cell("optimum", 16384, 20, 4000, kv=10**7),
                     cell("hf", 512, 5, 500), cell("hf", 16384, 40, 900),
                     cell("kvx-snapkv", 512, 0.9), cell("kvx-snapkv", 16384, 0.95),
                     cell("kvx-full", 512, 2.0, bytes_per_step=100), cell("kvx-full", 16384, 5.0, bytes_per_step=300),
                     cell("kvx-mla-snapkv", 16384, 1.0, kv=10**5)]}
    res["cells"][5]["export_bytes"] = 1050
    g = {x["goal"]: (x["measured"], x["met"]) for x in report.goals(res)}
    assert g["student 512: kvx-snapkv no slower per token than ortgenai"] == ("0.900 vs 0.800 ms (1.12×)", "no")
    assert g["student 16k: kvx-snapkv ≥10× faster than ortgenai"] == ("13.7×", "yes")  # 13 / 0.95
    assert g["student 16k: kvx-snapkv ≥20× faster than hf generate"] == ("42.1×", "yes")
    assert g["student: kvx-snapkv decode grows ≤10% 512→16k"] == ("+6%", "yes")
    assert g["student: kvx-full decode growth 512→16k ≤ bytes-read growth + 20 %"] == ("+150% vs bytes +200%", "yes")
    assert g["student: kvx-snapkv export size ≤1.1× its weights"] == ("1.05× (1.0 KiB)", "yes")
    assert g["student 16k: MLA+budget KV bytes ≥50× smaller than optimum"][1] == "yes"  # 100×
