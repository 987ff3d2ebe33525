# SPDX-License-Identifier: Apache-2.0
"""Artifact integrity: every output directory carries a manifest (kvexport version, settings, input model hash,
sha256 of every file), and the commands that read a directory verify it first, refusing a missing, altered or
foreign file by name (BadArtifact, exit 4) before doing anything else.

Cases marked xfail are known gaps, reported to the owners of those modules (see docs/guarantees.md).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import kvexport
from kvexport.errors import BadArtifact
from kvexport.manifest import verify_manifest
from tests.hardening.conftest import copy_of, run_cli

DAMAGE = {
    "missing": (lambda d: (d / "prefill.onnx").unlink(), "missing prefill.onnx"),
    "altered": (lambda d: (d / "decode.onnx").open("ab").write(b"\0"), "decode.onnx was altered"),
    "foreign": (lambda d: (d / "notes.txt").write_text("x"), "notes.txt is a foreign file"),
}
COMMANDS = {
    "generate": lambda d: ["generate", d, "-p", "hello world", "-n", "2"],
    "validate": lambda d: ["validate", d, "--steps", "1"],
    "profile": lambda d: ["profile", d, "--no-baseline", "--no-report", "--contexts", "16", "--decode-steps", "2",
                          "--out", d.parent / "profile.json"],
    "build-engine": lambda d: ["build-engine", d],
}


def test_export_manifest_lists_everything(export_dir, model_dir):
    m = json.loads((export_dir / "manifest.json").read_text())
    assert m["kvexport_version"] == kvexport.__version__ and m["kind"] == "onnx-export"
    assert m["settings"]["press"]["name"] == "streaming_llm" and m["settings"]["budgets"] == [16, 16]
    assert m["model_hash"].startswith("sha256:")
    files = {p.relative_to(export_dir).as_posix() for p in export_dir.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(m["files"]) == files
    for rel, digest in m["files"].items():
        assert hashlib.sha256((export_dir / rel).read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_readers_verify_first(command, damage, export_dir, tmp_path, capsys):
    d = copy_of(export_dir, tmp_path / "x")
    mutate, words = DAMAGE[damage]
    mutate(d)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, err = run_cli(COMMANDS[command](d), capsys)
    assert rc == 4 and len(err) == 1 and words in err[0], err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written (no parity.json, no engines)


def _convert_like(export_dir: Path, tmp_path: Path) -> Path:
    """The layout of a `kvexport convert` directory (convert.json + onnx/), without running a conversion."""
    c = tmp_path / "conv"
    c.mkdir()
    copy_of(export_dir, c / "onnx")
    (c / "convert.json").write_text(json.dumps({"settings": {}}))
    return c


def test_report_refuses_damaged_conversion(export_dir, tmp_path, capsys):
    c = _convert_like(export_dir, tmp_path)
    (c / "onnx" / "decode.onnx").open("ab").write(b"\0")
    rc, err = run_cli(["report", c], capsys)
    assert rc == 4 and "decode.onnx" in err[0]
    assert not (c / "report.html").exists()


def test_profile_keeps_export_verifiable(export_dir, tmp_path, capsys):
    """profile never adds files an export's manifest does not list: its profile goes beside the export, or to --out."""
    d = copy_of(export_dir, tmp_path / "x")
    args = ["profile", d, "--no-baseline", "--no-report", "--contexts", "16", "--decode-steps", "2"]
    rc, _ = run_cli(args, capsys)
    assert rc == 0 and json.loads((tmp_path / "x.profile-onnxruntime.json").read_text())
    verify_manifest(d)
    rc, _ = run_cli([*args, "--out", tmp_path / "p.json"], capsys)
    assert rc == 0 and json.loads((tmp_path / "p.json").read_text())
    verify_manifest(d)


def test_mla_dir_carries_manifest(mla_dir):
    m = verify_manifest(mla_dir, "mla-model")
    assert set(m["files"]) >= {"kvexport_mla.json", "model.safetensors", "tokenizer.json"}
    assert m["settings"]["kv_ranks"] == [16, 16]


def _flip_weights(d: Path) -> None:
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 1  # a bit of the last tensor: the file still loads, with a wrong weight
    f.write_bytes(bytes(data))


MLA_DAMAGE = {
    "altered": (_flip_weights, "model.safetensors was altered"),
    "missing": (lambda d: (d / "tokenizer.json").unlink(), "missing tokenizer.json"),
    "foreign": (lambda d: (d / "extra.safetensors").write_bytes(b"x"), "extra.safetensors is a foreign file"),
    "no-manifest": (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
}


@pytest.mark.parametrize("damage", list(MLA_DAMAGE))
@pytest.mark.parametrize("command", ["generate", "export", "distill"])
def test_mla_readers_verify_first(command, damage, mla_dir, tmp_path, capsys):
    d = copy_of(mla_dir, tmp_path / "m")
    mutate, words = MLA_DAMAGE[damage]
    mutate(d)
    args = {"generate": ["generate", d, "-p", "hello world", "-n", "2"],
            "export": ["export", d, "--out", tmp_path / "o"],
            "distill": ["distill", d, "--teacher", d, "--data", d / "kvexport_mla.json", "--tokens", "64",
                               "--out", tmp_path / "o"]}[command]
    rc, err = run_cli(args, capsys)
    assert rc == 4 and len(err) == 1 and words in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_distill_output_verifies_with_its_working_files(mla_dir, model_dir, tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("hello world " * 200)
    out = tmp_path / "dist"
    rc, _ = run_cli(["distill", mla_dir, "--teacher", model_dir, "--data", data, "--tokens", "64", "--seq-len", "16",
                     "--batch-size", "2", "--save-every", "1", "--out", out, "--no-progress"], capsys)
    assert rc == 0 and (out / "checkpoints").is_dir() and (out / "distill_summary.json").is_file()
    from kvexport.mla.io import load_mla, verify_mla_files

    verify_mla_files(out)  # checkpoints/, the log and the summary are allowed beside the model
    load_mla(out)
    _flip_weights(out)
    with pytest.raises(BadArtifact, match="altered"):
        load_mla(out)


def test_validate_writes_only_its_report(export_dir, tmp_path, capsys):
    """validate adds parity.json, which the manifest allows; the directory still verifies afterwards."""
    d = copy_of(export_dir, tmp_path / "x")
    rc, _ = run_cli(["validate", d, "-p", "hello world", "--steps", "2"], capsys)
    assert rc == 0 and (d / "parity.json").is_file()
    verify_manifest(d)
    rc, err = run_cli(["generate", d, "-p", "hello world", "-n", "2"], capsys)
    assert rc == 0
    shutil.rmtree(d)
