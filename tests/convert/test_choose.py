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
    rc = main(["convert", "--choose", "--min-agreement", "0.5", "--max-ppl-increase", "1.0", "--min-recall", "0",
               "--out", str(out), *FAST])
    return out, rc


def test_the_choice_meets_the_targets_and_is_what_was_exported(chosen):
    out, rc = chosen
    assert rc == 0
    choice = json.loads((out / "choice.json").read_text())
    c = choice["chosen"]
    assert c is not None and c["meets"] and not c["misses"]
    assert c["agreement"] >= 0.5 and c["ppl_increase"] <= 1.0
    assert choice["targets"] == {"min_agreement": 0.5, "max_ppl_increase": 1.0, "min_recall": 0.0}
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
    assert {st["name"]: st["status"] for st in cj["stages"]}["choose"] == "done"


def test_unreachable_targets_stop_with_one_line(tmp_path, capsys):
    out = tmp_path / "never"
    rc = main(["convert", "--choose", "--min-agreement", "1.0", "--max-ppl-increase", "0", "--out", str(out), *FAST])
    err = capsys.readouterr().err
    assert rc == 6 and "no candidate met the targets" in err and "closest:" in err
    assert "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_choose_refuses_compression_flags(tmp_path, capsys):
    rc = main(["convert", "--choose", "--press", "knorm", "--out", str(tmp_path / "x")])
    assert rc == 2 and "--choose picks the press, budget and cache format itself; drop --press" in capsys.readouterr().err
