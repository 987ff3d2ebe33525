# SPDX-License-Identifier: Apache-2.0
"""Private virtual environments for the comparison rows whose packages cannot share kvexport's environment.

Optimum's exporter pins ``transformers<4.58``; onnxruntime-genai's model builder wants its own onnx_ir and
pulls packages of its own; llama-cpp-python ships no wheel on PyPI and is compiled from its sdist (llama.cpp's C/C++
sources, CPU backend only, ``-march=native``): 10 min on 2 busy cores (``nice``, 2 jobs), 140 MB. Each gets a venv under ``~/.cache/kvexport/<name>-venv`` (``python -m venv`` + pip,
torch pinned to ``==2.13.0`` so pip reuses the CPU wheel instead of a multi-GB CUDA build), marked ready with a
stamp file holding the versions it imported. :meth:`SideVenv.python` answers whether one is built without
building it (``--quick``); :meth:`SideVenv.ensure` builds it once (a full benchmark run does, except llama.cpp's:
``python -m benchmarks.side_venv llamacpp``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STAMP = "kvexport-ready"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SideVenv:
    name: str  # "optimum", "ortgenai"
    packages: tuple[str, ...]
    check: str  # python code that imports what the row needs and prints its versions
    env_var: str
    pip_args: tuple[str, ...] = ()  # e.g. ("--no-binary", "llama-cpp-python"): build from the sdist
    build_env: tuple[tuple[str, str], ...] = ()  # environment of the pip run (a compiled package's CMAKE_ARGS)
    nice: int = 0  # niceness of the pip run (a long compile on a shared machine)
    timeout_s: float = 1500.0
    auto_build: bool = True  # a full benchmark run builds it when missing (False: a long compile, built by hand)

    @property
    def root(self) -> Path:
        return Path(os.environ.get(self.env_var, Path.home() / ".cache" / "kvexport" / f"{self.name}-venv"))

    def python(self) -> Path | None:
        """The venv's python if the venv is complete (stamp written after a successful install), else None."""
        py = self.root / "bin" / "python"
        return py if (self.root / STAMP).is_file() and py.is_file() else None

    def ensure(self, log=print, timeout_s: float | None = None) -> Path:
        """Create (once) and return the venv's python. Raises RuntimeError with pip's tail on failure."""
        py = self.python()
        if py is not None:
            return py
        t0 = time.time()
        root = self.root
        root.parent.mkdir(parents=True, exist_ok=True)
        if not (root / "bin" / "python").is_file():
            log(f"creating the {self.name} venv at {root} (one time, a few minutes)")
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        py = root / "bin" / "python"
        env = {**os.environ, **dict(self.build_env)}
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        if self.build_env:
            log(f"building {self.name}'s packages from source (timeout {timeout_s or self.timeout_s:.0f} s): "
                + " ".join(f"{k}={v!r}" for k, v in self.build_env))
        cmd = [str(py), "-m", "pip", "install", "--quiet", *self.pip_args, *self.packages]
        if self.nice:
            cmd = ["nice", "-n", str(self.nice), *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s or self.timeout_s, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"pip install in the {self.name} venv failed:\n" + (r.stdout + r.stderr)[-2000:])
        chk = subprocess.run([str(py), "-c", self.check], capture_output=True, text=True)
        if chk.returncode != 0:
            raise RuntimeError(f"the {self.name} venv does not import what it needs:\n" + chk.stderr[-2000:])
        (root / STAMP).write_text(chk.stdout.strip() + "\n")
        log(f"{self.name} venv ready in {time.time() - t0:.0f} s: {chk.stdout.strip()}")
        return py

    def versions(self) -> str | None:
        stamp = self.root / STAMP
        return stamp.read_text().strip() if stamp.is_file() else None


OPTIMUM = SideVenv("optimum", ("torch==2.13.0", "optimum-onnx", "onnxruntime", "numpy", "psutil"),
                   "import optimum.exporters.onnx, onnxruntime, transformers, torch;"
                   "print('transformers', transformers.__version__, 'torch', torch.__version__, 'onnxruntime', "
                   "onnxruntime.__version__)", "KVEXPORT_OPTIMUM_VENV")
ORTGENAI = SideVenv("ortgenai", ("torch==2.13.0", "transformers>=5.0,<6", "onnxruntime-genai==0.18.0", "onnx_ir",
                                 "numpy", "psutil"),
                    "import onnxruntime_genai, onnxruntime, transformers, torch;"
                    "print('onnxruntime-genai', onnxruntime_genai.__version__, 'onnxruntime', onnxruntime.__version__)",
                    "KVEXPORT_ORTGENAI_VENV")
# llama.cpp's CPU backend for this machine only (GGML_NATIVE), without the multimodal library (LLAVA_BUILD) and,
# through llamacpp_lean.cmake, without llama.cpp's "common" library that llama-cpp-python forces on but never loads
LLAMACPP_CMAKE_ARGS = ("-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                       "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF "
                       f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={HERE / 'llamacpp_lean.cmake'}")
LLAMACPP = SideVenv("llamacpp", ("llama-cpp-python==0.3.36", "numpy", "psutil"),
                    "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, '(',"
                    "llama_cpp.llama_print_system_info().decode().strip(), ')')",
                    "KVEXPORT_LLAMACPP_VENV", pip_args=("--no-binary", "llama-cpp-python"),
                    build_env=(("CMAKE_ARGS", LLAMACPP_CMAKE_ARGS),), nice=19, timeout_s=3600.0, auto_build=False)
VENVS = {v.name: v for v in (OPTIMUM, ORTGENAI, LLAMACPP)}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(VENVS):
        print(VENVS[name].ensure())
