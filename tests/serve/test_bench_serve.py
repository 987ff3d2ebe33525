# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_serve.py end to end at a tiny size on the test export: every phase's requests come back
complete (the asked number of tokens, finish "length", [DONE]), the soak's memory samples are taken and the cache
bytes they report are the server's, unchanged; the results file holds what was printed."""

from __future__ import annotations

import json

from benchmarks import bench_serve


def test_bench_serve_tiny(export_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    assert bench_serve.main(["--export", str(export_dir), "--streams", "2", "--tokens", "4", "--prompt", "20",
                             "--single-requests", "2", "--per-stream", "1", "--rounds", "1", "--requests", "4",
                             "--sample-every", "2", "--out", str(out)]) == 0
    res = json.loads((out / "serve_results.json").read_text())
    assert res["one_stream"]["complete"] == res["one_stream"]["requests"] == 2
    assert res["n_streams"]["complete"] == res["n_streams"]["requests"] == 2 and res["n_streams"]["streams"] == 2
    soak = res["soak"]
    assert soak["complete"] == soak["served_ok"] == soak["requests"] == 4 and soak["errors"] == 0
    assert [s["requests"] for s in soak["samples"]] == [0, 2, 4]
    assert len({s["cache_bytes"] for s in soak["samples"]}) == 1 and soak["cache_spread"] == 0
    assert res["ratio"] == res["n_streams"]["tokens_per_s"] / res["one_stream"]["tokens_per_s"]
    assert res["config"]["server_exit"] == 0 and "2 sequences at once" in res["config"]["server"]
    printed = capsys.readouterr().out
    assert f"{res['ratio']:.2f}x" in printed and "4/4 complete" in printed
    g, w = res.get("graph_ceiling"), res.get("workload_ceiling")
    if g is not None:  # the prompts' prefill dilutes what batching gives: between no gain and the graph's
        assert w is not None and min(1.0, g["ratio"]) <= w["ratio"] <= max(1.0, g["ratio"]), (g, w)
        assert f"{w['ratio']:.2f}x" in printed
