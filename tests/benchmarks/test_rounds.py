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
