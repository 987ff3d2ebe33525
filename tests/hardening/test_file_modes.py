# SPDX-License-Identifier: Apache-2.0
"""Outputs follow the user's umask (0644 files / 0755 directories by default), so an engine build running as
another user can read them: temporary files (mkstemp) and onnx's external data are created 0600 otherwise."""

from __future__ import annotations

import os
import stat

import pytest

from kvexport.export import export_model, validate


def modes(root):
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def assert_modes(root, file_mode: int, dir_mode: int) -> dict:
    """Every file under ``root`` has ``file_mode`` and every directory (``root`` too) ``dir_mode``; -> the modes."""
    got = modes(root)
    for name, mode in got.items():
        want = dir_mode if (root / name).is_dir() else file_mode
        assert mode == want, f"{name}: {oct(mode)} != {oct(want)}"
    return got


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_export_and_parity_follow_the_umask(tiny_models, tmp_path, mask, file_mode, dir_mode):
    old = os.umask(mask)
    try:
        hf = tiny_models("llama")
        out = export_model(hf, tmp_path / "x", press="knorm", budget=12, window=4, chunk=8)
        validate(out, model=hf, prompts=[9], steps=2, fidelity=False)
    finally:
        os.umask(old)
    got = assert_modes(out, file_mode, dir_mode)
    assert "weights.data" in got and "parity.json" in got
