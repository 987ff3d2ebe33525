# SPDX-License-Identifier: Apache-2.0
"""Compile checks of the TensorRT plugins without a GPU.

- every CUDA kernel (plugins/**/*.cu) compiles with nvcc for Jetson Orin (sm_87) and Hopper (sm_90);
- with ``TENSORRT_INCLUDE_DIR`` set (e.g. the ``include/`` of an NVIDIA/TensorRT tag), every plugin ``.cpp``
  compiles against those headers without warnings in our files, and a host-side check program
  (tests/plugins/plugin_host_check.cpp: creator field names, attribute parsing, serialization round trip, formats,
  getCreators) builds and passes;
- (slow) the CMake project configures and builds the kernels-only library.

Skips cleanly where nvcc (or TensorRT's headers) is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"
CU_SOURCES = sorted(PLUGINS.rglob("*.cu"))
CPP_SOURCES = sorted(PLUGINS.rglob("*.cpp"))
ARCHS = ("87", "90")


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cuda_include(nvcc: str) -> Path | None:
    """The CUDA toolkit's include dir (nvcc may be a wrapper script, so try the usual places too)."""
    cands = []
    if os.environ.get("CUDA_HOME"):
        cands.append(Path(os.environ["CUDA_HOME"]) / "include")
    real = Path(nvcc).resolve()
    cands.append(real.parent.parent / "include")
    try:  # a wrapper script: `exec /usr/local/cuda-X/bin/nvcc "$@"`
        text = real.read_text(errors="ignore")[:4096]
        for tok in text.split():
            if tok.endswith("/bin/nvcc"):
                cands.append(Path(tok).parent.parent / "include")
    except OSError:
        pass
    cands += [Path("/usr/local/cuda/include")] + sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)
    return next((c for c in cands if (c / "cuda_runtime_api.h").exists()), None)


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
TRT_INCLUDE = os.environ.get("TENSORRT_INCLUDE_DIR")
needs_trt = pytest.mark.skipif(
    not TRT_INCLUDE or not (Path(TRT_INCLUDE) / "NvInferRuntime.h").exists(),
    reason="TENSORRT_INCLUDE_DIR not set to a TensorRT include/ directory",
)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def kernel_objects(tmp_path_factory) -> dict[str, Path | str]:
    """Each .cu compiled once for sm_87 + sm_90: name -> object path, or the compiler's error text."""
    out = tmp_path_factory.mktemp("kernels")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    objs: dict[str, Path | str] = {}
    for src in CU_SOURCES:
        obj = out / (src.stem + ".o")
        r = _run([NVCC, "-c", "-std=c++17", "-Xcompiler", "-fPIC", *gencode, str(src), "-o", str(obj)], out)
        objs[src.name] = obj if r.returncode == 0 else (r.stderr + r.stdout)
    return objs


def test_sources_present():
    assert {p.name for p in CU_SOURCES} == {"topKGatherKernel.cu", "latentAttentionKernel.cu"}
    assert {p.name for p in CPP_SOURCES} == {
        "pluginRegistration.cpp",
        "topKGatherPlugin.cpp",
        "latentAttentionPlugin.cpp",
    }
    for p in [*CU_SOURCES, *CPP_SOURCES, *PLUGINS.rglob("*.h"), *PLUGINS.rglob("*.cuh")]:
        assert p.read_text().startswith("// SPDX-License-Identifier: Apache-2.0"), p


@needs_nvcc
@pytest.mark.parametrize("name", [p.name for p in CU_SOURCES])
def test_kernel_compiles_sm87_sm90(kernel_objects, name):
    res = kernel_objects[name]
    assert isinstance(res, Path), f"nvcc failed for {name}:\n{res}"
    assert res.stat().st_size > 0
    # both architectures are in the fat binary
    listing = (
        _run([str(Path(NVCC).parent / "cuobjdump"), "--list-elf", str(res)], res.parent)
        if (Path(NVCC).parent / "cuobjdump").exists()
        else None
    )
    if listing is not None and listing.returncode == 0:
        for a in ARCHS:
            assert f"sm_{a}" in listing.stdout, listing.stdout


@needs_nvcc
@needs_trt
@pytest.mark.parametrize("src", CPP_SOURCES, ids=lambda p: p.name)
def test_plugin_source_compiles_against_tensorrt_headers(tmp_path, src):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    inc = _cuda_include(NVCC)
    assert inc is not None, "CUDA include dir not found next to nvcc"
    r = _run(
        [
            cxx,
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-c",
            "-fPIC",
            "-isystem",
            TRT_INCLUDE,
            "-isystem",
            str(inc),
            str(src),
            "-o",
            str(tmp_path / "x.o"),
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    ours = [ln for ln in r.stderr.splitlines() if "warning:" in ln and str(PLUGINS) in ln]
    assert not ours, "\n".join(ours)


@needs_nvcc
@needs_trt
def test_plugin_host_checks_pass(tmp_path, kernel_objects):
    """Creator fields, attribute parsing, serialization, formats, getCreators: run on the host (no GPU used)."""
    objs = [v for v in kernel_objects.values()]
    assert all(isinstance(o, Path) for o in objs), objs
    exe = tmp_path / "plugin_host_check"
    srcs = [ROOT / "tests/plugins/plugin_host_check.cpp", *CPP_SOURCES]
    r = _run(
        [
            NVCC,
            "-std=c++17",
            "-DKVEXPORT_STATIC_REGISTRATION=0",
            "-Xcompiler",
            "-Wno-deprecated-declarations",
            "-isystem",
            TRT_INCLUDE,
            "-gencode=arch=compute_90,code=sm_90",
            *map(str, srcs),
            *map(str, objs),
            "-o",
            str(exe),
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    run = _run([str(exe)], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "0 failures"
    assert sum(ln.startswith("PASS") for ln in lines) >= 40
    # the bad-attribute paths log one line naming the plugin
    assert "[kvexport::TopKGather] attribute k = 0 is outside [1, 2^31 - 1]" in run.stderr
    # the formats the plugins declare are the ones the TensorRT-parseability check assumes
    declared = {}
    for ln in lines:
        if ln.startswith("DECLARE "):
            _, plugin, pos, t = ln.split()
            declared.setdefault((plugin, int(pos)), set()).add(t)
    assert declared == _expected_declarations(), declared


def _expected_declarations() -> dict:
    """op_support.PLUGIN_IO at the host check's base combinations (TopKGather: f32 scores, f16 keys/values;
    LatentAttention: f16), one position varied at a time; BF16 follows KVEXPORT_ENABLE_BF16 (on)."""
    from kvexport.tensorrt.op_support import PLUGIN_IO

    base = {"TopKGather": ["f32", "f16", "f16", "i64", "f16", "f16", "i64", "i64"],
            "LatentAttention": ["f16", "f16", "i64", "i64", "f16"]}
    out = {}
    for plugin, types in base.items():
        io = PLUGIN_IO[plugin]
        decl = [*io.inputs, *io.outputs]
        index = {name: i for i, (name, _) in enumerate(decl)}
        for pos, (_, allowed) in enumerate(decl):
            out[(plugin, pos)] = {types[index[allowed[1:]]]} if isinstance(allowed, str) else set(allowed)
    return out


@pytest.mark.slow
@needs_nvcc
def test_cmake_kernels_only_build(tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not found")
    build = tmp_path / "build"
    env = {**os.environ, "CUDACXX": NVCC}
    r = subprocess.run(
        [cmake, "-S", str(PLUGINS), "-B", str(build), "-DKVEXPORT_KERNELS_ONLY=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([cmake, "--build", str(build), "-j2"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lib = build / "libkvexport_kernels.so"
    assert lib.exists()
    nm = shutil.which("nm")
    if nm:
        syms = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
        exported = {ln.split()[-1] for ln in syms.splitlines() if " T " in ln}
        assert {
            "kvx_topk_gather",
            "kvx_topk_gather_workspace_size",
            "kvx_latent_attention",
            "kvx_latent_attention_workspace_size",
            "kvx_latent_attention_plan",
            "kvx_query_device",
            "kvx_abi_version",
        } <= exported


@pytest.mark.slow
@needs_nvcc
@needs_trt
def test_cmake_plugin_library_needs_no_libnvinfer(tmp_path):
    """The default build registers nothing itself: it exports getCreators / setLoggerFinder and links no TensorRT
    library (so the lean runtime can load it); found with headers only."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not found")
    build = tmp_path / "build"
    env = {**os.environ, "CUDACXX": NVCC}
    r = subprocess.run([cmake, "-S", str(PLUGINS), "-B", str(build), f"-DTENSORRT_INCLUDE_DIR={TRT_INCLUDE}",
                        "-DCMAKE_CUDA_ARCHITECTURES=90"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([cmake, "--build", str(build), "-j2"], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    lib = build / "libkvexport_plugins.so"
    readelf, nm = shutil.which("readelf"), shutil.which("nm")
    if readelf is None or nm is None:
        pytest.skip("binutils (readelf, nm) not found")
    needed = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True).stdout
    assert "nvinfer" not in needed, needed
    syms = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    exported = {ln.split()[-1] for ln in syms.splitlines() if " T " in ln}
    assert {"getCreators", "setLoggerFinder", "kvx_topk_gather", "kvx_latent_attention"} <= exported
