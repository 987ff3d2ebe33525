# SPDX-License-Identifier: Apache-2.0
"""The error taxonomy through the real CLI: every kind exits with its code and prints one line
(``error: ...``); a traceback only with ``--debug``; unexpected exceptions become internal errors (70)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvexport.errors as E
from kvexport.cli import main
from tests.hardening.conftest import copy_of, messages, run_cli

KINDS = [(E.BadUsage, 2), (E.BadModel, 3), (E.BadArtifact, 4), (E.MissingBackend, 5), (E.ParityFailure, 6),
         (E.InternalError, 70)]


@pytest.mark.parametrize(("cls", "code"), KINDS, ids=[c.__name__ for c, _ in KINDS])
def test_each_kind_has_its_exit_code(cls, code):
    assert issubclass(cls, E.KVExportError) and cls.exit_code == code
    assert sorted(c.exit_code for c, _ in KINDS) == [2, 3, 4, 5, 6, 70]  # distinct codes


def _raising(monkeypatch, exc):
    """Make `kvexport generate MODEL` raise exc once the model is resolved (where it builds the press)."""
    import kvexport.presses as g

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(g, "build_press", boom)


@pytest.mark.parametrize(("cls", "code"), KINDS[:5], ids=[c.__name__ for c, _ in KINDS[:5]])
def test_cli_one_line_then_traceback_with_debug(cls, code, model_dir, monkeypatch, capsys):
    _raising(monkeypatch, cls("what went wrong, and what is accepted"))
    rc, err = run_cli(["generate", model_dir, "-p", "hi"], capsys)
    assert rc == code and err == ["error: what went wrong, and what is accepted"]
    assert main(["--debug", "generate", str(model_dir), "-p", "hi"]) == code
    full = capsys.readouterr().err
    assert "Traceback" in full and full.rstrip().endswith("error: what went wrong, and what is accepted")


def test_unexpected_exception_is_internal_error(model_dir, monkeypatch, capsys):
    _raising(monkeypatch, ZeroDivisionError("division by zero"))
    rc, err = run_cli(["generate", model_dir, "-p", "hi"], capsys)
    assert rc == 70 and len(err) == 1
    assert err[0].startswith("error: internal error: ZeroDivisionError") and "--debug" in err[0]
    assert main(["--debug", "generate", str(model_dir), "-p", "hi"]) == 70
    full = capsys.readouterr().err
    assert "Traceback" in full and "ZeroDivisionError" in full


def test_real_commands_produce_each_kind(model_dir, export_dir, tmp_path, capsys):
    """One real trigger per kind (no monkeypatching)."""
    rc, err = run_cli(["generate", model_dir, "-p", "hi", "--max-new-tokens", "0"], capsys)
    assert (rc, len(err)) == (2, 1) and "--max-new-tokens" in err[0]
    rc, err = run_cli(["generate", tmp_path / "nope", "-p", "hi"], capsys)
    assert (rc, len(err)) == (3, 1) and "does not exist" in err[0]
    rc, err = run_cli(["validate", model_dir], capsys)
    assert (rc, len(err)) == (4, 1) and "manifest.json" in err[0]
    # parity with zero tolerance cannot pass (fp32 onnxruntime and PyTorch differ in the last bits)
    d = copy_of(export_dir, tmp_path / "x")
    rc, err = run_cli(["validate", d, "-p", "hello world", "--steps", "2", "--atol", "0", "--rtol", "0"], capsys)
    assert (rc, len(err)) == (6, 1) and "outside tolerance" in err[0] and "parity.json" in err[0]


def test_missing_backend_is_exit_5(export_dir, tmp_path, monkeypatch, capsys):
    import kvexport.tensorrt.backend as backend

    real = backend.importlib.import_module

    def no_trt(name, *a, **k):
        if name == "tensorrt":
            raise ModuleNotFoundError("No module named 'tensorrt'")
        return real(name, *a, **k)

    monkeypatch.setattr(backend.importlib, "import_module", no_trt)
    d = copy_of(export_dir, tmp_path / "x")
    rc, err = run_cli(["build-engine", d], capsys)
    assert (rc, len(err)) == (5, 1) and "TensorRT is not installed" in err[0]
    assert not (tmp_path / "x-tensorrt").exists() and [p.name for p in tmp_path.iterdir()] == ["x"]


def test_subprocess_one_line(tmp_path):
    """`python -m kvexport` as a user runs it: one line on stderr, the exit code of the kind."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "kvexport"]
    r = subprocess.run([*cmd, "generate", str(tmp_path / "nope"), "-p", "hi"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 3 and messages(r.stderr) == [f"error: model directory {str(tmp_path / 'nope')!r} does not exist"]
    assert "Traceback" not in r.stderr  # (--debug's traceback is checked in-process above)
