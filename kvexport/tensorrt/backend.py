# SPDX-License-Identifier: Apache-2.0
"""Lazy access to TensorRT: ``import kvexport.tensorrt`` works without it; using it says what is missing."""

from __future__ import annotations

import importlib
import re
from types import ModuleType

from kvexport.errors import BadUsage, MissingBackend

INSTALL_HINT = (
    "`pip install tensorrt` on a machine with an NVIDIA GPU, then build the plugins: "
    "cmake -S plugins -B build/plugins && cmake --build build/plugins (docs/tensorrt.md)"
)


def import_tensorrt() -> ModuleType:
    """The ``tensorrt`` module, or MissingBackend with one line saying how to get it."""
    try:
        return importlib.import_module("tensorrt")
    except ImportError as e:
        raise MissingBackend(f"TensorRT is not installed ({e.__class__.__name__}: {e}); {INSTALL_HINT}") from None
    except OSError as e:  # the wheel is there but libnvinfer / CUDA libraries are not loadable
        raise MissingBackend(f"TensorRT is installed but cannot load its libraries ({e}); {INSTALL_HINT}") from None


def parse_version(version: str | tuple[int, ...]) -> tuple[int, int, int]:
    """'10.3.0' / '10.13.3.9' / (10, 7) -> (major, minor, patch)."""
    if isinstance(version, tuple):
        parts = [int(v) for v in version]
    else:
        m = re.match(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", str(version))
        if not m:
            raise BadUsage(f"TensorRT version {version!r} is not like '10.3.0'")
        parts = [int(g) for g in m.groups() if g is not None]
    parts = (parts + [0, 0, 0])[:3]
    return parts[0], parts[1], parts[2]


def tensorrt_version() -> tuple[int, int, int]:
    """Version of the installed TensorRT (MissingBackend when there is none)."""
    return parse_version(import_tensorrt().__version__)
