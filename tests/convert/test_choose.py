# SPDX-License-Identifier: Apache-2.0
"""``kvexport convert --choose`` on the bundled student: the search's record is consistent with what was exported
(the chosen candidate meets every target by its own numbers, every measured candidate holding fewer bytes missed
one, convert.json's settings and the export's manifest are the chosen ones and reproduce without searching), and
targets nothing can meet stop the conversion in one line with nothing written."""

from __future__ import annotations

import json

import pytest

from kvexport.cli import main
from kvexport.manifest import verify_manifest

FAST = ["--choose-context", "512", "--chunk", "128", "--no-profile", "--no-baseline", "--no-validate"]


@pytest.fixture(scope="module")
def chosen(tmp_path_factory):
    out = tmp_path_factory.mktemp("choose") / "kvx-chosen"
    rc = main(["convert", "--choose", "--min-agreement", "0.4", "--max-ppl-increase", "1.0", "--min-recall", "0",
               "--out", str(out), *FAST])
    return out, rc


def test_the_choice_meets_the_targets_and_is_what_was_exported(chosen):
    out, rc = chosen
    assert rc == 0
    choice = json.loads((out / "choice.json").read_text())
    c = choice["chosen"]
    assert c is not None and c["meets"] and not c["misses"]
    assert c["agreement"] >= 0.4 and c["ppl_increase"] <= 1.0
    assert choice["targets"] == {"min_agreement": 0.4, "max_ppl_increase": 1.0, "min_recall": 0.0}
    assert [r for r in choice["trail"] if r["chosen"]] == [c]
    for r in choice["trail"]:  # nothing measured that holds fewer bytes met the targets
        if r["resident_bytes"] < c["resident_bytes"]:
            assert r["misses"], r
    cj = json.loads((out / "convert.json").read_text())
    s = cj["settings"]
    assert cj["choice"]["chosen"] == c
    assert (s["press"], s["budget"], s["kv_dtype"]) == (c["press"] or "none", c["budget"], c["kv_dtype"])
    assert not s["choose"] and s["min_recall"] is None  # --config DIR/convert.json redoes the chosen conversion
    m = verify_manifest(out / "onnx")["settings"]
    if c["press"]:
        assert m["press"]["name"] == c["press"] and m["press"]["params"]["budget"] == c["budget"]
        assert m["press"]["params"]["neighbors"] == c["neighbors"] and m["lookahead"] == c["lookahead"]
    assert m["kv_dtype"] == (c["kv_dtype"] or m["dtype"])
    stages = {st["name"]: st["status"] for st in cj["stages"]}
    assert stages["choose"] == "done"
    if c["mla"]:  # a rank was chosen: the rewrite stage made that rank, and the export runs it
        assert stages["rewrite"] == "done" and (s["mla_rank"], s["rope_dim"]) == (c["mla"]["kv_rank"],
                                                                                 c["mla"]["rope_dim"])
        assert set(m["mla"]["kv_ranks"]) == {c["mla"]["kv_rank"]} and m["mla"]["rope_dim"] == c["mla"]["rope_dim"]
    else:
        assert stages["rewrite"] == "skipped" and s["mla_rank"] is None and m["mla"] is None


def test_the_search_tries_the_mla_ranks(chosen):
    """The MLA ranks are candidates, under the best family's press and cache format: a rank is measured when its
    latent cache would hold fewer bytes than the best found so far (on the student the 2x rank does, and keeps
    these loose targets), from the least compressed up, and a more compressed one only after a less compressed
    one kept the targets."""
    from kvexport.convert.choose import MLA_RATIOS

    out, _ = chosen
    choice = json.loads((out / "choice.json").read_text())
    gqa = [r for r in choice["trail"] if not r["mla"]]
    mla = [r for r in choice["trail"] if r["mla"]]
    assert mla and any(r["meets"] for r in mla)
    best_gqa = min((r for r in gqa if r["meets"]), key=lambda r: r["resident_bytes"])
    for r in mla:
        assert (r["press"], r["kv_dtype"]) == (best_gqa["press"], best_gqa["kv_dtype"])
        assert r["resident_bytes"] < best_gqa["resident_bytes"]
        assert r["mla"]["ratio"] in MLA_RATIOS
    ratios = [r["mla"]["ratio"] for r in mla]
    assert ratios == sorted(ratios)
    measured = sorted(set(ratios))
    for lo in measured[:-1]:
        assert any(r["meets"] for r in mla if r["mla"]["ratio"] == lo), lo


def test_unreachable_targets_stop_with_one_line(tmp_path, capsys):
    out = tmp_path / "never"
    rc = main(["convert", "--choose", "--min-agreement", "1.0", "--max-ppl-increase", "0", "--out", str(out), *FAST])
    err = capsys.readouterr().err
    assert rc == 6 and "no candidate met the targets" in err and "closest:" in err
    assert "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_choose_refuses_compression_flags(tmp_path, capsys):
    rc = main(["convert", "--choose", "--press", "knorm", "--out", str(tmp_path / "x")])
    assert rc == 2 and "--choose picks the press, budget, cache format and MLA rank itself; drop --press" in capsys.readouterr().err
