# SPDX-License-Identifier: Apache-2.0
"""Error paths of `kvexport build-engine`, plugin library loading and the runner, without TensorRT or a GPU.

A missing TensorRT is simulated by making ``import tensorrt`` fail, and the plugin-loading logic is exercised with
a stand-in ``tensorrt`` module whose plugin registry is a dictionary (what TensorRT itself would do is covered by
the GPU test at the end, which skips here).
"""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
import sys
import types
from pathlib import Path

import onnx
import pytest

import kvexport.tensorrt.backend as backend
import kvexport.tensorrt.plugins as plugins_mod
from kvexport.cli import main
from kvexport.errors import BadArtifact, BadUsage, MissingBackend
from kvexport.manifest import write_manifest
from kvexport.tensorrt import TensorRTRunner, find_onnx_graphs, load_plugins
from tests.tensorrt.onnx_models import topk_gather_model


@pytest.fixture()
def no_tensorrt(monkeypatch):
    real = backend.importlib.import_module

    def fake(name, *a, **k):
        if name == "tensorrt":
            raise ModuleNotFoundError("No module named 'tensorrt'")
        return real(name, *a, **k)

    monkeypatch.setattr(backend.importlib, "import_module", fake)


@pytest.fixture()
def export_dir(tmp_path):
    d = tmp_path / "export"
    d.mkdir()
    for name in ("prefill.onnx", "decode.onnx"):
        onnx.save(topk_gather_model(), str(d / name))
    write_manifest(d, "onnx-export", {})  # build-engine verifies the export against its manifest first
    return d


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_no_tensorrt_is_missing_backend_exit_5(export_dir, no_tensorrt, capsys):
    assert main(["build-engine", str(export_dir)]) == 5
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: TensorRT is not installed")
    assert "pip install tensorrt" in line and "NVIDIA GPU" in line and "cmake" in line


def test_missing_dir_exit_2(tmp_path, capsys):
    assert main(["build-engine", str(tmp_path / "nope")]) == 2
    assert "does not exist" in _one_line(capsys.readouterr().err)


def test_dir_without_onnx_exit_4(tmp_path, capsys):
    write_manifest(tmp_path, "onnx-export", {})
    assert main(["build-engine", str(tmp_path)]) == 4
    assert "holds no .onnx graph" in _one_line(capsys.readouterr().err)


def test_plugins_not_a_library_exit_4(export_dir, tmp_path, capsys):
    fake = tmp_path / "libkvexport_plugins.so"
    fake.write_text("not an ELF file\n")
    assert main(["build-engine", str(export_dir), "--plugins", str(fake)]) == 4
    assert "is not a shared library" in _one_line(capsys.readouterr().err)


def test_plugins_missing_exit_2(export_dir, tmp_path, capsys):
    assert main(["build-engine", str(export_dir), "--plugins", str(tmp_path / "nope.so")]) == 2
    assert "does not exist" in _one_line(capsys.readouterr().err)


def test_plugins_directory_exit_4(export_dir, tmp_path, capsys):
    assert main(["build-engine", str(export_dir), "--plugins", str(tmp_path)]) == 4
    assert "is a directory" in _one_line(capsys.readouterr().err)


def test_find_onnx_graphs_builds_one_engine_per_graph(export_dir):
    (export_dir / "decode.trt103.onnx").write_bytes(b"")  # our temporary parser copy is ignored
    assert [p.name for p in find_onnx_graphs(export_dir)] == ["decode.onnx", "prefill.onnx"]
    nested = export_dir.parent / "nested"
    (nested / "graphs").mkdir(parents=True)
    onnx.save(topk_gather_model(), str(nested / "graphs" / "compact.onnx"))
    assert [p.name for p in find_onnx_graphs(nested)] == ["compact.onnx"]


def test_runner_without_tensorrt(tmp_path, no_tensorrt):
    r = TensorRTRunner(tmp_path / "decode.engine")
    with pytest.raises(MissingBackend, match="pip install tensorrt"):
        r.activate()


# ---- plugin loading with a stand-in tensorrt module ---------------------------------------------------------------


class _Registry:
    def __init__(self, creators=()):
        self.creators = set(creators)
        self.loaded = []

    def get_creator(self, name, version, namespace):
        return object() if (name, version, namespace) in self.creators else None

    def load_library(self, path):
        self.loaded.append(path)


@pytest.fixture()
def fake_trt(monkeypatch):
    reg = _Registry()
    mod = types.SimpleNamespace(__version__="10.3.0", get_plugin_registry=lambda: reg)
    monkeypatch.setitem(sys.modules, "tensorrt", mod)
    plugins_mod._reset_for_tests()
    yield reg
    plugins_mod._reset_for_tests()


def _shared_lib(tmp_path: Path, body: str, name: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a test shared library")
    src = tmp_path / (name + ".c")
    src.write_text(body)
    out = tmp_path / (name + ".so")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return out


def test_shared_library_without_getcreators_is_bad_artifact(tmp_path, fake_trt):
    lib = _shared_lib(tmp_path, "int not_a_plugin(void) { return 1; }\n", "libother")
    with pytest.raises(BadArtifact, match="not a TensorRT plugin library"):
        load_plugins(lib)


def test_plugin_library_registering_nothing_is_bad_artifact(tmp_path, fake_trt):
    lib = _shared_lib(
        tmp_path,
        "void* getCreators(int* n) { *n = 0; return 0; }\nvoid setLoggerFinder(void* f) {}\n",
        "libempty_plugins",
    )
    with pytest.raises(BadArtifact, match="registers no TopKGather/LatentAttention"):
        load_plugins(lib)
    assert fake_trt.loaded == [str(lib.resolve())]  # fell back to IPluginRegistry.load_library


def test_plugin_library_with_static_registration_loads(tmp_path, fake_trt):
    lib = _shared_lib(tmp_path, "void* getCreators(int* n) { *n = 0; return 0; }\n", "libkv_plugins")
    fake_trt.creators |= {("TopKGather", "1", "kvexport"), ("LatentAttention", "1", "kvexport")}
    assert load_plugins(lib) == lib.resolve()
    assert fake_trt.loaded == []  # already registered by loading: no second registration


def test_no_plugins_found(monkeypatch, fake_trt):
    monkeypatch.setattr(plugins_mod, "find_plugin_library", lambda: None)
    with pytest.raises(BadUsage, match="no plugin library given"):
        load_plugins(None)


def test_libc_is_not_a_plugin_library(fake_trt):
    libc = ctypes.util.find_library("c")
    path = next(
        (
            p
            for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/aarch64-linux-gnu/libc.so.6", "/lib64/libc.so.6")
            if Path(p).exists()
        ),
        None,
    )
    if libc is None or path is None:
        pytest.skip("libc not found")
    with pytest.raises(BadArtifact, match="not a TensorRT plugin library"):
        load_plugins(path)


# ---- the real thing, where TensorRT, a GPU and the built plugins exist -------------------------------------------


def _have_trt_gpu() -> str | None:
    try:
        import tensorrt  # noqa: F401
        import torch
    except Exception:  # noqa: BLE001
        return "tensorrt not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if plugins_mod.find_plugin_library() is None:
        return "libkvexport_plugins.so not built (cmake -S plugins -B build/plugins)"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_have_trt_gpu() is not None, reason=str(_have_trt_gpu()))
def test_engine_matches_onnxruntime(export_dir):
    import numpy as np
    import onnxruntime as ort

    from kvexport.tensorrt import build_engine

    feeds = dict(
        scores=np.random.default_rng(0).standard_normal((1, 2, 10)).astype(np.float32),
        keys=np.random.default_rng(1).standard_normal((1, 2, 10, 4)).astype(np.float32),
        values=np.random.default_rng(2).standard_normal((1, 2, 10, 3)).astype(np.float32),
        positions=np.tile(np.arange(10), (1, 2, 1)),
    )
    rep = build_engine(export_dir / "decode.onnx", export_dir / "decode.engine")
    assert rep.plugin_nodes == {"TopKGather": 1}
    ref = ort.InferenceSession(str(export_dir / "decode.onnx")).run(None, feeds)
    with TensorRTRunner(export_dir / "decode.engine") as r:
        out = r.infer(feeds)
    for name, x in zip(["kept_keys", "kept_values", "kept_positions", "kept_indices"], ref, strict=True):
        np.testing.assert_array_equal(out[name], x)
