# SPDX-License-Identifier: Apache-2.0
"""build_engine's glue (version-dependent ONNX preparation, parse errors, FP16 flag, outputs) against a stand-in
``tensorrt`` module that records what the parser was given. The real builder runs only where TensorRT and a GPU
exist (tests/tensorrt/test_build_engine_cli.py::test_engine_matches_onnxruntime)."""

from __future__ import annotations

import json
import sys
import types

import onnx
import pytest

import kvexport.tensorrt.engine as engine_mod
from kvexport.cli import main
from kvexport.errors import BadArtifact, BadUsage
from kvexport.tensorrt import build_engine
from tests.tensorrt.onnx_models import topk_gather_model


def make_fake_trt(version: str, parse_ok: bool = True, has_fp16: bool = True, input_shape=(1, 2, 10)):
    seen: dict = {"flags": []}

    class ILogger:
        class Severity:
            ERROR, INTERNAL_ERROR, WARNING = 1, 0, 2

        def __init__(self):
            pass

    class Tensor:
        name, shape = "scores", input_shape

    class Network:
        num_inputs = 1

        def get_input(self, i):
            return Tensor()

    class Parser:
        num_errors = 0 if parse_ok else 1

        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            m = onnx.load(path)
            seen["functions"] = [f.name for f in m.functions]
            seen["parsed"] = path
            return parse_ok

        def get_error(self, i):
            return "In node 1 (TopKGather): plugin not found"

        def set_flag(self, f):
            seen["flags"].append(f)

    class Config:
        def set_flag(self, f):
            seen["flags"].append(f)

        def set_memory_pool_limit(self, pool, n):
            seen["workspace"] = n

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return Network()

        def create_builder_config(self):
            return Config()

        def build_serialized_network(self, network, config):
            return b"PLAN"

    flags = types.SimpleNamespace(FP16="FP16") if has_fp16 else types.SimpleNamespace()
    mod = types.SimpleNamespace(
        __version__=version,
        ILogger=ILogger,
        Builder=Builder,
        OnnxParser=Parser,
        BuilderFlag=flags,
        MemoryPoolType=types.SimpleNamespace(WORKSPACE="ws"),
    )
    return mod, seen


@pytest.fixture()
def export_dir(tmp_path, monkeypatch):
    d = tmp_path / "export"
    d.mkdir()
    onnx.save(topk_gather_model(), str(d / "decode.onnx"))
    onnx.save(topk_gather_model(), str(d / "prefill.onnx"))
    monkeypatch.setattr(engine_mod, "load_plugins", lambda p: p)  # plugin loading has its own tests
    return d


def _with_manifest(d):
    """`kvexport build-engine` verifies the export against its manifest first."""
    from kvexport.manifest import write_manifest

    write_manifest(d, "onnx-export", {})
    return d


@pytest.mark.parametrize("version,functions", [("10.3.0", []), ("10.13.3", ["TopKGather"])])
def test_parser_sees_version_prepared_graph(export_dir, monkeypatch, version, functions):
    fake, seen = make_fake_trt(version)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    rep = build_engine(export_dir / "decode.onnx", export_dir / "e" / "decode.engine", fp16=True, workspace_gib=1)
    assert seen["functions"] == functions
    assert (export_dir / "e" / "decode.engine").read_bytes() == b"PLAN"
    assert rep.plugin_nodes == {"TopKGather": 1} and rep.stripped_functions == ([] if functions else ["TopKGather"])
    assert "FP16" in seen["flags"] and seen["workspace"] == 1 << 30
    assert not any(p.name.endswith(".onnx") and ".trt" in p.name for p in export_dir.iterdir())  # temp copy removed


def test_parse_error_is_bad_artifact(export_dir, monkeypatch):
    fake, _ = make_fake_trt("10.13.3", parse_ok=False)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(BadArtifact, match="could not parse decode.onnx: In node 1"):
        build_engine(export_dir / "decode.onnx", export_dir / "decode.engine")


def test_dynamic_input_is_bad_artifact(export_dir, monkeypatch):
    fake, _ = make_fake_trt("10.13.3", input_shape=(-1, 2, 10))
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(BadArtifact, match="dynamic shape"):
        build_engine(export_dir / "decode.onnx", export_dir / "decode.engine")


def test_fp16_on_strongly_typed_tensorrt_is_bad_usage(export_dir, monkeypatch):
    fake, _ = make_fake_trt("11.1.0", has_fp16=False)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(BadUsage, match="strongly typed"):
        build_engine(export_dir / "decode.onnx", export_dir / "decode.engine", fp16=True)


def test_cli_builds_one_engine_per_graph(export_dir, monkeypatch, capsys):
    fake, _ = make_fake_trt("10.3.0")
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    assert main(["build-engine", str(_with_manifest(export_dir))]) == 0
    out = export_dir.with_name(export_dir.name + "-tensorrt")  # beside the export: its manifest stays valid
    assert sorted(p.name for p in out.glob("*.engine")) == ["decode.engine", "prefill.engine"]
    from kvexport.manifest import verify_manifest

    assert verify_manifest(out, "tensorrt-engines")["settings"]["tensorrt"] == "10.3.0"
    verify_manifest(export_dir, "onnx-export")
    record = json.loads((out / "engines.json").read_text())
    assert [r["tensorrt"] for r in record] == ["10.3.0", "10.3.0"]
    assert all(r["stripped_functions"] == ["TopKGather"] for r in record)
    assert "2 engine(s)" in capsys.readouterr().out
