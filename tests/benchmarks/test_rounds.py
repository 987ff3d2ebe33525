# SPDX-License-Identifier: Apache-2.0
"""``--rounds``: each row keeps its quietest run; and the real-model rows' bookkeeping (no model, no timing)."""

from __future__ import annotations

from benchmarks.__main__ import keep_quietest
from benchmarks.rows import ROWS, SHAPES


def cell(row: str, ctx: int, rnd: int, load: float) -> dict:
    return {"shape": "s", "row": row, "context": ctx, "quiet": {"round": rnd, "load_mean": load}}


def test_each_row_keeps_its_quietest_round():
    cells = [cell("a", c, 0, 5.0) for c in (512, 2048)] + [cell("b", c, 0, 2.0) for c in (512, 2048)]
    cells += [cell("b", c, 1, 3.0) for c in (512, 2048)] + [cell("a", c, 1, 4.0) for c in (512, 2048)]
    kept, others = keep_quietest(cells + [{"shape": "s", "row": "c", "context": 512}])  # a single-round cell stays
    assert {(c["row"], c.get("quiet", {}).get("round")) for c in kept} == {("a", 1), ("b", 0), ("c", None)}
    assert len(kept) == 5 and len(others) == 4
    assert {(c["row"], c["quiet"]["round"]) for c in others} == {("a", 0), ("b", 1)}


def test_llamacpp_row_counts_an_fp16_cache():
    s = SHAPES["smollm2"]
    n = 8000
    assert s.kv_bytes(ROWS["llamacpp"], n) == 2 * s.layers * s.kv_heads * s.head_dim * n * 2
    assert s.kv_bytes(ROWS["ortgenai-int4"], n) == 2 * s.kv_heads * s.head_dim * s.layers * n * 4  # fp32 cache


def test_real_model_goals_state_issue_33s_targets():
    """The goals table of a real-model run: decode speed-ups against the peers at equal weight precision, time to
    first token and the share of the bandwidth bound, each computed from the cells' own numbers."""
    from benchmarks.report import goals

    def cell(row, ctx, ms, ttft, frac=None):
        c = {"shape": "smollm2", "row": row, "context": ctx, "status": "ok", "decode_ms_median": ms, "prefill_s": ttft}
        if frac is not None:
            c["bound"] = {"fraction_of_bandwidth": frac, "floor_ms": ms * frac}
        return c

    cells = [cell("kvx-default", 512, 40.0, 1.5, 0.5), cell("ortgenai", 512, 42.0, 1.8),
             cell("kvx-default", 8192, 40.0, 30.0, 0.7), cell("ortgenai", 8192, 100.0, 50.0),
             cell("kvx-default-int4", 512, 20.0, 2.0), cell("ortgenai-int4", 512, 15.0, 1.9),
             cell("llamacpp", 512, 30.0, 4.0)]
    res = {"shapes": {"smollm2": {"source": "registry:smollm2"}}, "settings": {"contexts": [512, 8192]},
           "cells": cells}
    got = {g["goal"]: (g["measured"], g["met"]) for g in goals(res)}
    assert got["smollm2 512: kvx-default decode ≥ 1× ortgenai"] == ("1.05× (40.0 vs 42.0 ms)", "yes")
    assert got["smollm2 8k: kvx-default decode ≥ 1.5× ortgenai"] == ("2.50× (40.0 vs 100.0 ms)", "yes")
    assert got["smollm2 512: kvx-default-int4 decode ≥ 1× ortgenai-int4"] == ("0.75× (20.0 vs 15.0 ms)", "no")
    assert got["smollm2 512: kvx-default-int4 decode ≥ 1× llamacpp"] == ("1.50× (20.0 vs 30.0 ms)", "yes")
    assert got["smollm2 512: kvx-default-int4 time to first token ≤ 1.0× ortgenai-int4"][1] == "no"
    assert got["smollm2 8k: kvx-default time to first token ≤ 1.0× ortgenai"] == ("0.60× (30.00 vs 50.00 s)", "yes")
    assert got["smollm2 512: kvx-default decode ≥ 60% of the memory-bandwidth bound"][1] == "no"
    assert got["smollm2 8k: kvx-default decode ≥ 60% of the memory-bandwidth bound"][1] == "yes"
    assert not any("2k" in g for g in got)  # a context not run gives no goal, not a guess
