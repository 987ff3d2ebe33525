# SPDX-License-Identifier: Apache-2.0
"""TensorRT deployment: plugin loading, ONNX preparation for the parser, engine builds, a Polygraphy runner.

Everything imports TensorRT lazily: ``import kvexport.tensorrt`` works on any machine, and the functions that need
TensorRT (or a GPU) raise :class:`kvexport.errors.MissingBackend` with one line saying what is missing.
"""

from kvexport.tensorrt.backend import import_tensorrt, parse_version, tensorrt_version
from kvexport.tensorrt.engine import EngineReport, build_engine, find_onnx_graphs
from kvexport.tensorrt.generator import TrtGenerator, default_engine_dir
from kvexport.tensorrt.onnx_prep import PLUGIN_OPS, PreparedOnnx, needs_function_strip, prepare_onnx_for_trt
from kvexport.tensorrt.plugins import check_plugin_library_file, find_plugin_library, load_plugins
from kvexport.tensorrt.runner import TensorRTRunner

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
