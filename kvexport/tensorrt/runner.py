# SPDX-License-Identifier: Apache-2.0
"""A Polygraphy-compatible runner for kvexport's TensorRT engines.

``TensorRTRunner(engine_path, plugins)`` is a ``polygraphy.backend.base.BaseRunner``: use it as a context manager
and call ``infer(feed_dict)`` with NumPy arrays, or hand it to ``polygraphy.comparator.Comparator.run`` next to an
onnxruntime runner. It loads the plugin library before deserializing the engine and keeps device buffers in torch
CUDA tensors (int64 positions included).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

from polygraphy.backend.base import BaseRunner

from kvexport.errors import BadArtifact, MissingBackend
from kvexport.tensorrt.backend import import_tensorrt
from kvexport.tensorrt.plugins import load_plugins


class TensorRTRunner(BaseRunner):
    """Runs one serialized engine (static shapes) on the current CUDA device."""

    def __init__(self, engine_path: str | Path, plugins: str | Path | None = None, name: str | None = None):
        super().__init__(name=name, prefix="kvexport-trt-runner")
        self.engine_path = Path(engine_path)
        self.plugins = plugins
        self.engine = self.context = None

    def activate_impl(self):
        import torch

        trt = import_tensorrt()
        if not torch.cuda.is_available():
            raise MissingBackend("running a TensorRT engine needs a CUDA GPU and a CUDA build of PyTorch")
        if not self.engine_path.is_file():
            raise BadArtifact(f"engine {self.engine_path} does not exist; build it with `kvexport build-engine`")
        load_plugins(self.plugins)
        self._trt = trt
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self._runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
        if self.engine is None:
            raise BadArtifact(
                f"TensorRT {trt.__version__} could not deserialize {self.engine_path} (built by another "
                "TensorRT version or for another GPU?)"
            )
        self.context = self.engine.create_execution_context()
        self._names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]

    def _is_input(self, name: str) -> bool:
        return self.engine.get_tensor_mode(name) == self._trt.TensorIOMode.INPUT

    def _torch_dtype(self, name: str):
        import torch

        trt = self._trt
        m = {
            trt.float32: torch.float32,
            trt.float16: torch.float16,
            trt.int64: torch.int64,
            trt.int32: torch.int32,
            trt.bool: torch.bool,
            trt.int8: torch.int8,
            trt.uint8: torch.uint8,
        }
        if hasattr(trt, "bfloat16"):
            m[trt.bfloat16] = torch.bfloat16
        return m[self.engine.get_tensor_dtype(name)]

    def get_input_metadata_impl(self):
        from polygraphy.common import TensorMetadata
        from polygraphy.datatype import DataType

        meta = TensorMetadata()
        for n in self._names:
            if self._is_input(n):
                meta.add(n, DataType.from_dtype(self._torch_dtype(n)), tuple(self.engine.get_tensor_shape(n)))
        return meta

    def infer_impl(self, feed_dict, copy_outputs_to_host=True, outputs=None):
        """``outputs``: preallocated device tensors by name to write into (the rest are allocated here)."""
        import numpy as np
        import torch

        dev = torch.device("cuda")
        keep = []
        for n in self._names:
            if self._is_input(n):
                if n not in feed_dict:
                    raise BadArtifact(f"missing input {n!r} for engine {self.engine_path.name}")
                x = feed_dict[n]
                t = (x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))).to(dev)
                t = t.to(self._torch_dtype(n)).contiguous()
                self.context.set_input_shape(n, tuple(t.shape))
                self.context.set_tensor_address(n, t.data_ptr())
                keep.append(t)
        given = outputs or {}
        outputs = OrderedDict()
        for n in self._names:
            if not self._is_input(n):
                shape = tuple(self.context.get_tensor_shape(n))
                t = given.get(n)
                if t is None or tuple(t.shape) != shape:
                    t = torch.empty(shape, dtype=self._torch_dtype(n), device=dev)
                self.context.set_tensor_address(n, t.data_ptr())
                outputs[n] = t
        stream = torch.cuda.current_stream()
        t0 = time.perf_counter()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise BadArtifact(f"TensorRT failed to run {self.engine_path.name}")
        stream.synchronize()
        self.inference_time = time.perf_counter() - t0
        if copy_outputs_to_host:
            return OrderedDict((k, v.cpu().numpy()) for k, v in outputs.items())
        return outputs

    def deactivate_impl(self):
        self.context = self.engine = self._runtime = None
