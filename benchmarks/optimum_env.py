# SPDX-License-Identifier: Apache-2.0
"""A private virtual environment holding Hugging Face Optimum's ONNX exporter (row 2 of the benchmark).

``optimum-onnx`` pins ``transformers<4.58`` while kvexport needs transformers 5, so it cannot share our
environment. :func:`ensure_venv` creates ``~/.cache/kvexport/optimum-venv`` (``python -m venv`` + pip, torch
pinned to ``==2.13.0`` so pip reuses the CPU wheel instead of a multi-GB CUDA build) and marks it ready with
a stamp file; :func:`venv_python` answers whether it is built without building it (``--quick``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ["torch==2.13.0", "optimum-onnx", "onnxruntime", "numpy", "psutil"]
STAMP = "kvexport-ready"


def default_dir() -> Path:
    return Path(os.environ.get("KVEXPORT_OPTIMUM_VENV", Path.home() / ".cache" / "kvexport" / "optimum-venv"))


def venv_python(root: Path | None = None) -> Path | None:
    """The venv's python if the venv is complete (stamp written after a successful install), else None."""
    root = Path(root or default_dir())
    py = root / "bin" / "python"
    return py if (root / STAMP).is_file() and py.is_file() else None


def ensure_venv(root: Path | None = None, log=print, timeout_s: float = 1500.0) -> Path:
    """Create (once) and return the python of the Optimum venv. Raises RuntimeError with pip's tail on failure."""
    root = Path(root or default_dir())
    py = venv_python(root)
    if py is not None:
        return py
    t0 = time.time()
    root.parent.mkdir(parents=True, exist_ok=True)
    if not (root / "bin" / "python").is_file():
        log(f"creating the Optimum venv at {root} (one time, a few minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    py = root / "bin" / "python"
    cmd = [str(py), "-m", "pip", "install", "--quiet", *PACKAGES]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError("pip install in the Optimum venv failed:\n" + (r.stdout + r.stderr)[-2000:])
    chk = subprocess.run([str(py), "-c", "import optimum.exporters.onnx, onnxruntime, transformers, torch;"
                          "print(transformers.__version__, torch.__version__, onnxruntime.__version__)"],
                         capture_output=True, text=True)
    if chk.returncode != 0:
        raise RuntimeError("the Optimum venv does not import optimum.exporters.onnx:\n" + chk.stderr[-2000:])
    (root / STAMP).write_text(chk.stdout.strip() + "\n")
    log(f"Optimum venv ready in {time.time() - t0:.0f} s: transformers/torch/onnxruntime {chk.stdout.strip()}")
    return py


def versions(root: Path | None = None) -> str | None:
    """'transformers torch onnxruntime' versions recorded when the venv was built, or None."""
    root = Path(root or default_dir())
    stamp = root / STAMP
    return stamp.read_text().strip() if stamp.is_file() else None


if __name__ == "__main__":
    print(ensure_venv())
