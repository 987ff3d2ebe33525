# SPDX-License-Identifier: Apache-2.0
"""Generation with TensorRT engines: the step driver of an export on its engines.

``TrtGenerator(export_dir, engines=None, plugins=None)`` reads the export's manifest (settings, host rules) and
the engine folder ``kvexport build-engine`` wrote (default ``EXPORT_DIR-tensorrt``: ``<graph>.engine`` per ONNX
graph, ``engines.json``, its own ``manifest.json`` recording the sha256 of the export's manifest). The host side
(the cache plan, the writes of each step's new rows, compactions, kept positions) is the one host,
:class:`kvexport.runtime.host.GraphHost`; this module only says where the buffers live and how a graph is called
(:class:`TrtEngines`): each graph runs through a :class:`~kvexport.tensorrt.runner.TensorRTRunner` (or any object
with Polygraphy's ``infer(feed_dict)``), the cache buffers are device tensors (torch CUDA) written in place, and the
decode step's outputs are bound to preallocated device buffers. Static-cache exports only (the growing-past
baseline has no fixed shapes to build engines for).

Without TensorRT or a CUDA GPU, constructing one raises :class:`~kvexport.errors.MissingBackend` with one line.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvexport.errors import BadArtifact, MissingBackend
from kvexport.manifest import MANIFEST, ORT_ONLY_SUFFIX, sha256_file, verify_manifest
from kvexport.manifest import ONNX_EXPORT as KIND
from kvexport.runtime.host import GraphHost

ENGINE_KIND = "tensorrt-engines"


def default_engine_dir(export_dir: str | Path) -> Path:
    """Where ``kvexport build-engine EXPORT_DIR`` puts the engines: ``EXPORT_DIR-tensorrt`` beside it."""
    p = Path(export_dir)
    return p.with_name(p.name + "-tensorrt")


def verify_engine_dir(export_dir: Path, engines: Path) -> dict[str, Any]:
    """Check the engine folder against its manifest and against the export it was built from."""
    if not engines.is_dir():
        raise BadArtifact(f"no TensorRT engines at {engines}; build them with `kvexport build-engine {export_dir}` "
                          "(or give --engines PATH)")
    man = verify_manifest(engines, ENGINE_KIND)
    want = man.get("settings", {}).get("export_manifest_sha256")
    if want is not None and want != sha256_file(export_dir / MANIFEST):
        raise BadArtifact(f"the engines in {engines} were built from another version of {export_dir}; "
                          f"rebuild them with `kvexport build-engine {export_dir}`")
    return man


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class TrtEngines:
    """The engines of an export as the host's backend: one Polygraphy-style runner (context manager with ``infer``)
    per graph, device buffers as torch CUDA tensors (host arrays with a stand-in runner on the CPU).

    runner_factory(engine_path, plugins) -> a runner; the default is
    :class:`~kvexport.tensorrt.runner.TensorRTRunner`, which needs TensorRT and a CUDA GPU."""

    backend = "tensorrt"
    inplace = False

    def __init__(self, path: str | Path, engines: str | Path | None = None, plugins: str | Path | None = None,
                 runner_factory: Callable | None = None):
        self.path = Path(path)
        if runner_factory is None:
            runner_factory = _real_runner_factory()  # MissingBackend first: what is missing matters most
        self.manifest = verify_manifest(self.path, KIND)
        self.settings = s = self.manifest["settings"]
        if s["mode"] != "static":
            raise BadArtifact(f"{self.path} is a growing-past (--dynamic-cache) export; the tensorrt backend runs "
                              "static-cache exports (use --backend onnxruntime for the baseline)")
        self.engine_dir = Path(engines) if engines is not None else default_engine_dir(self.path)
        self.engine_manifest = verify_engine_dir(self.path, self.engine_dir)
        graphs = {name: g for name, g in s["graphs"].items()
                  if isinstance(g, dict) and "file" in g and not g["file"].endswith(ORT_ONLY_SUFFIX)}
        self.runners = {}
        for name, g in graphs.items():
            eng = self.engine_dir / (Path(g["file"]).stem + ".engine")
            if not eng.is_file():
                raise BadArtifact(f"{self.engine_dir} has no {eng.name} for {g['file']}; rebuild with "
                                  f"`kvexport build-engine {self.path}`")
            r = runner_factory(eng, plugins)
            r.activate()
            self.runners[name] = r
        self.providers = ["TensorRT"]
        self.device = getattr(runner_factory, "device", "cpu")  # a stand-in runner: host arrays

    def close(self) -> None:
        for r in self.runners.values():
            r.deactivate()
        self.runners = {}

    def array(self, shape, dtype, fill=0):
        if self.device == "cpu":  # a stand-in runner without a GPU (tests)
            return np.full(shape, fill, dtype)
        import torch

        return torch.from_numpy(np.full(shape, fill, dtype)).to("cuda")

    def to_device(self, x):
        if self.device == "cpu" or not isinstance(x, np.ndarray):
            return x
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def forget(self, buffers, unbind: bool = False) -> None:
        return None  # nothing is bound across calls

    def bound(self, graph: str) -> bool:
        return False

    def call(self, graph: str, feeds: dict, arrays: dict, outputs: dict, persistent: bool = False) -> dict:
        r = self.runners[graph]
        feed = {**feeds, **arrays}
        impl = getattr(r, "infer_impl", None)
        params = inspect.signature(impl).parameters if impl is not None else {}
        if "outputs" in params:  # TensorRTRunner: write into our buffers, nothing allocated per call
            return r.infer(feed, check_inputs=False, copy_outputs_to_host=False, outputs=outputs)
        got = r.infer(feed, check_inputs=False)
        out = dict(outputs)
        for name, value in got.items():
            if name in outputs:
                outputs[name][...] = self.to_device(_to_numpy(value)) if self.device == "cpu" else value
            else:
                out[name] = self.to_device(_to_numpy(value))
        return out


class TrtGenerator(GraphHost):
    """Greedy generation / the step driver on TensorRT engines: the one host
    (:class:`~kvexport.runtime.host.GraphHost`) over :class:`TrtEngines`."""

    backend = "tensorrt"

    def __init__(self, path: str | Path, engines: str | Path | None = None, plugins: str | Path | None = None,
                 runner_factory: Callable | None = None):
        super().__init__(TrtEngines(path, engines, plugins, runner_factory))
        self.engine_dir = self.graphs.engine_dir

    @property
    def runners(self) -> dict:
        """The engines' runners, by graph."""
        return self.graphs.runners


def _real_runner_factory() -> Callable:
    from kvexport.tensorrt.backend import import_tensorrt

    import_tensorrt()  # MissingBackend (exit 5) with the install hint
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        raise MissingBackend("the tensorrt backend needs PyTorch with CUDA for its device buffers") from None
    if not torch.cuda.is_available():
        raise MissingBackend("the tensorrt backend needs an NVIDIA GPU (torch.cuda.is_available() is False); run "
                             "on a machine with a GPU and a CUDA build of PyTorch, or use --backend onnxruntime")
    from kvexport.tensorrt.runner import TensorRTRunner

    def factory(engine, plugins):
        return TensorRTRunner(engine, plugins)

    factory.device = "cuda"
    return factory


__all__ = ["TrtGenerator", "TrtEngines", "default_engine_dir", "verify_engine_dir", "ENGINE_KIND"]
