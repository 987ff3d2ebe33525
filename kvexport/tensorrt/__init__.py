# SPDX-License-Identifier: Apache-2.0
"""TensorRT deployment: plugin loading, ONNX preparation for the parser, engine builds, a Polygraphy runner.

Everything imports TensorRT lazily: ``import kvexport.tensorrt`` works on any machine, and the functions that need
TensorRT (or a GPU) raise :class:`kvexport.errors.MissingBackend` with one line saying what is missing.
"""

from importlib import import_module

_WHERE = {
    "import_tensorrt": "backend", "parse_version": "backend", "tensorrt_version": "backend",
    "EngineReport": "engine", "build_engine": "engine", "find_onnx_graphs": "engine",
    "TrtGenerator": "generator", "default_engine_dir": "generator",
    "PLUGIN_OPS": "onnx_prep", "PreparedOnnx": "onnx_prep", "needs_function_strip": "onnx_prep",
    "prepare_onnx_for_trt": "onnx_prep",
    "check_plugin_library_file": "plugins", "find_plugin_library": "plugins", "load_plugins": "plugins",
    "TensorRTRunner": "runner",
}


def __getattr__(name):
    """Public names, imported on first use (polygraphy and TensorRT stay unloaded until a function needs them)."""
    if name in _WHERE:
        return getattr(import_module(f"kvexport.tensorrt.{_WHERE[name]}"), name)
    raise AttributeError(name)


__all__ = [
    "import_tensorrt",
    "parse_version",
    "tensorrt_version",
    "EngineReport",
    "build_engine",
    "find_onnx_graphs",
    "PLUGIN_OPS",
    "PreparedOnnx",
    "needs_function_strip",
    "prepare_onnx_for_trt",
    "check_plugin_library_file",
    "find_plugin_library",
    "load_plugins",
    "TensorRTRunner",
    "TrtGenerator",
    "default_engine_dir",
]
