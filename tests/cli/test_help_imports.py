# SPDX-License-Identifier: Apache-2.0
"""``kvexport --help`` and every subcommand's ``--help`` load none of the heavy libraries, and the help reads
as a user types it: flags without value placeholders, no commands that do not exist, no raw markup.

Each help runs in a fresh interpreter (this process has imported torch long ago), which then lists the
heavy top-level packages found in ``sys.modules``. No time is asserted: the import list is what makes the
start fast, and it does not depend on how loaded the machine is."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "onnxruntime", "onnx")

PROBE = r"""
import contextlib, io, json, sys
from kvexport.cli import app, main
import typer.main

cli = typer.main.get_command(app)
paths = [[]]
for name, cmd in sorted(cli.commands.items()):
    paths.append([name])
    for sub in sorted(getattr(cmd, "commands", {}) or {}):
        paths.append([name, sub])
out = {}
for path in paths:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            rc = main([*path, "--help"])
        except SystemExit as e:  # kvexport bench hands --help to argparse
            rc = e.code
    out[" ".join(path)] = {"rc": rc, "help": buf.getvalue()}
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[1])))
print(json.dumps({"helps": out, "heavy": heavy}))
"""


@pytest.fixture(scope="module")
def helps():
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HEAVY)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_help_imports_no_heavy_library(helps):
    assert helps["heavy"] == []


def test_every_subcommand_has_help(helps):
    h = helps["helps"]
    expected = {"", "convert", "profile", "report", "export", "validate", "generate", "rewrite", "inspect", "distill",
                "build-engine", "bench", "eval", "eval presses", "eval mla", "eval combo"}
    assert expected <= set(h), sorted(set(h))
    for path, v in h.items():
        assert v["rc"] in (0, None), (path, v)
        assert "Usage" in v["help"] or "usage" in v["help"], path


def test_help_text_reads_as_typed(helps):
    commands = {p.split(" ")[0] for p in helps["helps"] if p}
    for path, v in helps["helps"].items():
        text = " ".join(v["help"].split())
        assert "<bool>" not in text, path  # a flag takes no value: `--force`, not `--force true`
        assert "``" not in text and ":class:" not in text, path  # no RST markup
        for cmd in re.findall(r"`kvexport ([a-z-]+)", text):
            assert cmd in commands, (path, cmd)


def test_eval_presses_default_names_the_study_set(helps):
    from kvexport.eval.press_study import STUDY_PRESSES

    text = " ".join(helps["helps"]["eval presses"]["help"].split())
    assert ", ".join(STUDY_PRESSES) in text
