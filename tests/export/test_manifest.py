# SPDX-License-Identifier: Apache-2.0
"""Manifest and atomic output: every way an artifact directory can be wrong is refused with one line."""

from __future__ import annotations

import json

import pytest

from kvexport.errors import BadArtifact, BadUsage
from kvexport.manifest import atomic_output, check_out_dir, sha256_file, verify_manifest, write_manifest


def _artifact(root):
    with atomic_output(root) as tmp:
        (tmp / "a.bin").write_bytes(b"abc")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("hello")
        write_manifest(tmp, "test", {"x": 1}, "sha256:00", reports=("parity.json",))
    return root


def test_manifest_roundtrip(tmp_path):
    root = _artifact(tmp_path / "art")
    doc = verify_manifest(root, "test")
    assert doc["files"] == {"a.bin": sha256_file(root / "a.bin"), "sub/b.txt": sha256_file(root / "sub" / "b.txt")}
    assert doc["settings"] == {"x": 1} and doc["model_hash"] == "sha256:00"
    (root / "parity.json").write_text("{}")  # a declared report is allowed
    verify_manifest(root)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


@pytest.mark.parametrize("damage,needle", [
    (lambda r: (r / "a.bin").unlink(), "missing a.bin"),
    (lambda r: (r / "sub" / "b.txt").write_text("HELLO"), "sub/b.txt was altered"),
    (lambda r: (r / "extra.onnx").write_bytes(b"x"), "extra.onnx is a foreign file"),
    (lambda r: (r / "manifest.json").unlink(), "no manifest.json"),
    (lambda r: (r / "manifest.json").write_text("{not json"), "not valid JSON"),
])
def test_verify_refuses_damage(tmp_path, damage, needle):
    root = _artifact(tmp_path / "art")
    damage(root)
    with pytest.raises(BadArtifact, match=needle):
        verify_manifest(root)


def test_verify_refuses_other_version_and_kind(tmp_path):
    root = _artifact(tmp_path / "art")
    with pytest.raises(BadArtifact, match="is a 'test' artifact"):
        verify_manifest(root, "onnx-export")
    doc = json.loads((root / "manifest.json").read_text())
    doc["kvexport_version"] = "0.0.1"
    (root / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(BadArtifact, match="written by kvexport 0.0.1"):
        verify_manifest(root)


def test_atomic_output_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output(out) as tmp:
            (tmp / "half.onnx").write_bytes(b"x")
            raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_atomic_output_refuses_nonempty_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(BadUsage, match="not empty; pass --force"):
        with atomic_output(out):
            pass
    assert (out / "keep").read_text() == "mine"
    with atomic_output(out, force=True) as tmp:
        (tmp / "new").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_output_refuses_file_and_unwritable(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(BadUsage, match="is a file"):
        with atomic_output(f):
            pass
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if os.access(ro, os.W_OK):  # running as root: permissions are not enforced
            pytest.skip("permissions not enforced for this user")
        with pytest.raises(BadUsage, match="not writable"):
            with atomic_output(ro / "out"):
                pass
    finally:
        ro.chmod(0o700)


def test_out_under_a_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(BadUsage, match=r"afile is a file"):
        check_out_dir(f / "sub", force=False)


def test_package_validate_is_the_function():
    import kvexport.export
    from kvexport.export import validate
    from kvexport.export.validation import validate as fn

    assert validate is fn and kvexport.export.validate is fn and callable(validate)
