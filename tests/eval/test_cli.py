# SPDX-License-Identifier: Apache-2.0
"""`kvexport eval mla` and `kvexport eval combo` end to end on the bundled student with tiny budgets (slow)."""

from __future__ import annotations

import json

import pytest

from kvexport.eval.tasks import TASKS
from kvexport.paths import DEFAULT_MODEL

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="bundled student not trained"),
]
TINY = ["--budgets", "1024,2048", "--batch-size", "4", "--context-len", "64", "--n-recall", "2"]


def test_mla_and_combo_cli(tmp_path):
    from kvexport.cli import main
    from kvexport.eval.tasks import TaskSet, TaskSettings, evaluate_tasks
    from kvexport.mla.io import load_decoder
    from kvexport.models.loading import load_tokenizer

    cache = str(tmp_path / "cache")
    rc = main(["eval", "mla", str(DEFAULT_MODEL), "--teachers", str(DEFAULT_MODEL), "--ratios", "1.882,6.4", *TINY,
               "--out", str(tmp_path), "--cache-dir", cache])
    assert rc == 0
    res = json.loads((tmp_path / "mla_kvx-student.json").read_text())
    assert [r["kv_rank"] for r in res["ranks"]] == [36, 14]  # the measured splits 36+32, 14+6 (docs/studies.md)
    assert all(f"{k} {v}" in res["command"] for k, v in zip(TINY[::2], TINY[1::2], strict=True))  # as it was run
    assert list(res["results"]) == ["kvx-student"] and list(res["results"]["kvx-student"]) == ["1024", "2048"]
    ts = TaskSet(load_tokenizer(DEFAULT_MODEL), TaskSettings(**res["tasks"]["settings"]))
    assert res["baseline"] == pytest.approx(evaluate_tasks(load_decoder(DEFAULT_MODEL)[0], ts))
    for by_rank in res["results"]["kvx-student"].values():
        for r in by_rank.values():
            assert r["accuracy"] == pytest.approx(sum(r[k] for k in TASKS) / 4)
    assert (tmp_path / "mla_kvx-student.png").stat().st_size > 0

    rc = main(["eval", "combo", str(DEFAULT_MODEL), "--targets", "6.4", "--press", "knorm", "--tokens", "1024",
               "--batch-size", "4", "--context-len", "64", "--n-recall", "2", "--out", str(tmp_path),
               "--cache-dir", cache])
    assert rc == 0
    combo = json.loads((tmp_path / "combo_kvx-student.json").read_text())
    methods = [r["method"] for r in combo["rows"]]
    assert methods[0] == "full cache" and len(methods) == 1 + 3  # full; eviction, MLA, milder MLA + eviction
    for r in combo["rows"][1:]:
        assert r["memory_ratio"] == pytest.approx(6.4, rel=0.05)
    assert "| 6.40× |" in (tmp_path / "combo_kvx-student.md").read_text()
