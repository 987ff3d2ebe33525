# SPDX-License-Identifier: Apache-2.0
"""Finding and loading libkvexport_plugins.so (TopKGather, LatentAttention plugins).

The library exports ``getCreators`` / ``setLoggerFinder`` for ``IPluginRegistry.load_library`` (trtexec
``--dynamicPlugins``), the registration TensorRT documents; it registers itself on load only when built with
``-DKVEXPORT_STATIC_REGISTRATION=ON``. kvexport loads it with ctypes first and falls back to the registry when the
creators did not appear (the default build).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from kvexport.errors import BadArtifact, BadUsage, MissingBackend
from kvexport.tensorrt.onnx_prep import KVEXPORT_DOMAIN, PLUGIN_OPS

LIBRARY_NAME = "libkvexport_plugins.so"
_ROOT = Path(__file__).resolve().parents[2]
SEARCH_DIRS = ("build/plugins", "plugins/build", "build")
_loaded: dict[str, object] = {}


def find_plugin_library() -> Path | None:
    """``KVEXPORT_PLUGINS`` or the usual CMake build folders of this checkout."""
    env = os.environ.get("KVEXPORT_PLUGINS")
    if env:
        return Path(env)
    for d in SEARCH_DIRS:
        p = _ROOT / d / LIBRARY_NAME
        if p.is_file():
            return p
    return None


def check_plugin_library_file(path: str | Path) -> Path:
    """An existing ELF shared object, or BadUsage / BadArtifact with one line (runs without TensorRT)."""
    p = Path(path)
    if not p.exists():
        raise BadUsage(
            f"plugin library {p} does not exist (build it: cmake -S plugins -B build/plugins && "
            "cmake --build build/plugins)"
        )
    if not p.is_file():
        raise BadArtifact(f"plugin library {p} is a directory, not {LIBRARY_NAME}")
    with open(p, "rb") as f:
        head = f.read(18)
    # ELF magic, e_type (bytes 16-17, little endian) == ET_DYN (3)
    if len(head) < 18 or head[:4] != b"\x7fELF" or int.from_bytes(head[16:18], "little") != 3:
        raise BadArtifact(f"{p} is not a shared library; --plugins takes {LIBRARY_NAME} built from plugins/")
    return p


def _has_creators(trt) -> bool:
    reg = trt.get_plugin_registry()
    get = getattr(reg, "get_creator", None) or reg.get_plugin_creator
    return all(get(op, "1", KVEXPORT_DOMAIN) is not None for op in PLUGIN_OPS)


def load_plugins(path: str | Path | None = None):
    """Load the plugin library into this process and check TopKGather / LatentAttention are registered.

    Returns the resolved library path. MissingBackend without TensorRT; BadArtifact for a library that is not
    kvexport's plugin library.
    """
    from kvexport.tensorrt.backend import import_tensorrt

    if path is None:
        path = find_plugin_library()
        if path is None:
            raise BadUsage(
                f"no plugin library given and none found in {', '.join(SEARCH_DIRS)}; build it with "
                "cmake -S plugins -B build/plugins && cmake --build build/plugins, or pass --plugins PATH"
            )
    p = check_plugin_library_file(path).resolve()
    trt = import_tensorrt()
    if str(p) in _loaded:
        return p
    try:
        handle = ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise BadArtifact(f"cannot load plugin library {p}: {e}") from None
    if not hasattr(handle, "getCreators"):
        raise BadArtifact(f"{p} is a shared library but not a TensorRT plugin library (no getCreators symbol)")
    if not _has_creators(trt):
        try:
            trt.get_plugin_registry().load_library(str(p))
        except Exception as e:  # noqa: BLE001 - TensorRT raises its own types
            raise BadArtifact(f"TensorRT could not load plugin library {p}: {e}") from None
        if not _has_creators(trt):
            raise BadArtifact(
                f"{p} loaded but registers no {'/'.join(PLUGIN_OPS)} plugins (namespace "
                f"'{KVEXPORT_DOMAIN}', version 1); is it kvexport's {LIBRARY_NAME}?"
            )
    _loaded[str(p)] = handle
    return p


def _reset_for_tests() -> None:
    _loaded.clear()


__all__ = ["LIBRARY_NAME", "find_plugin_library", "check_plugin_library_file", "load_plugins", "MissingBackend"]
