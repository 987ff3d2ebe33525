# SPDX-License-Identifier: Apache-2.0
"""Private virtual environments for the comparison rows whose packages cannot share kvexport's environment.

Optimum's exporter pins ``transformers<4.58``; onnxruntime-genai's model builder wants its own onnx_ir and
pulls packages of its own. Each gets a venv under ``~/.cache/kvexport/<name>-venv`` (``python -m venv`` + pip,
torch pinned to ``==2.13.0`` so pip reuses the CPU wheel instead of a multi-GB CUDA build), marked ready with a
stamp file holding the versions it imported. :meth:`SideVenv.python` answers whether one is built without
building it (``--quick``); :meth:`SideVenv.ensure` builds it once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STAMP = "kvexport-ready"


@dataclass(frozen=True)
class SideVenv:
    name: str  # "optimum", "ortgenai"
    packages: tuple[str, ...]
    check: str  # python code that imports what the row needs and prints its versions
    env_var: str

    @property
    def root(self) -> Path:
        return Path(os.environ.get(self.env_var, Path.home() / ".cache" / "kvexport" / f"{self.name}-venv"))

    def python(self) -> Path | None:
        """The venv's python if the venv is complete (stamp written after a successful install), else None."""
        py = self.root / "bin" / "python"
        return py if (self.root / STAMP).is_file() and py.is_file() else None

    def ensure(self, log=print, timeout_s: float = 1500.0) -> Path:
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
        r = subprocess.run([str(py), "-m", "pip", "install", "--quiet", *self.packages], capture_output=True, text=True,
                           timeout=timeout_s)
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
VENVS = {v.name: v for v in (OPTIMUM, ORTGENAI)}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(VENVS):
        print(VENVS[name].ensure())
