# SPDX-License-Identifier: Apache-2.0
"""Generation with TensorRT engines: the step API of :class:`kvexport.export.runtime.OrtGenerator` on engines.

``TrtGenerator(export_dir, engines=None, plugins=None)`` reads the export's manifest (settings, host rules) and
the engine folder ``kvexport build-engine`` wrote (default ``EXPORT_DIR-tensorrt``: ``<graph>.engine`` per ONNX
graph, ``engines.json``, its own ``manifest.json`` recording the sha256 of the export's manifest). The host side
(chunked prefill, decode at slot ``fill``, host-triggered compaction, ``kept_positions``, ``on_compaction``) is
inherited from ``OrtGenerator``; only the graph calls differ: each graph runs through a
:class:`~kvexport.tensorrt.runner.TensorRTRunner` (or any object with Polygraphy's ``infer(feed_dict)``), and
the caches stay on the device between calls (each call's ``*_out`` tensors become the next call's ``*_in``).
Static-cache exports only (the growing-past baseline has no fixed shapes to build engines for).

Without TensorRT or a CUDA GPU, constructing one raises :class:`~kvexport.errors.MissingBackend` with one line.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvexport.errors import BadArtifact, MissingBackend
from kvexport.export.manifest import MANIFEST, sha256_file, verify_manifest
from kvexport.export.manifest import ONNX_EXPORT as KIND
from kvexport.export.runtime import NP_DTYPES, OrtGenerator

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


class TrtGenerator(OrtGenerator):
    """Greedy generation / step API on TensorRT engines (same host rules and results as ``OrtGenerator``).

    runner_factory(engine_path, plugins) -> a Polygraphy-style runner (context manager with ``infer``); the
    default is :class:`~kvexport.tensorrt.runner.TensorRTRunner`, which needs TensorRT and a CUDA GPU.
    """

    backend = "tensorrt"

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
        graphs = {name: g for name, g in s["graphs"].items() if isinstance(g, dict) and "file" in g}
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
        self.device = "cuda"
        self.batch = int(s["batch"])
        self.dtype = NP_DTYPES[s["dtype"]]
        self.dynamic = False
        self.press = s["press"]
        self.on_compaction = None
        self.last_logits = None
        self._alloc()
        self.reset()

    def close(self) -> None:
        for r in self.runners.values():
            r.deactivate()
        self.runners = {}

    def __enter__(self) -> "TrtGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ buffers: one live tensor per cache input
    def _alloc(self) -> None:
        self._init_cache_layout()
        self.tensors: dict[str, Any] = {}
        self.arrays = {}
        self._logits = None

    def _logits_now(self) -> np.ndarray:
        return _to_numpy(self._logits).copy()

    def _reset_buffers(self) -> None:
        self.tensors = {n: self._empty(n) for n in self.shapes}  # moved to the device by the first call

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the live cache tensors (device or host), by kind, and ``total``."""
        from kvexport.export.runtime import _kind

        out = dict.fromkeys(("kv", "positions", "queries", "query_positions", "logits"), 0)
        for n, t in self.tensors.items():
            out[_kind(n)] += int(t.nbytes) if hasattr(t, "nbytes") else int(t.numel() * t.element_size())
        if self._logits is not None:
            out["logits"] = _to_numpy(self._logits).nbytes
        out["total"] = sum(out.values())
        return out

    def _call(self, graph: str, feeds: dict) -> dict:
        r = self.runners[graph]
        impl = getattr(r, "infer_impl", None)
        if impl is not None and "copy_outputs_to_host" in inspect.signature(impl).parameters:
            return r.infer(feeds, check_inputs=False, copy_outputs_to_host=False)  # outputs stay on the device
        return r.infer(feeds, check_inputs=False)

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> None:
        ins, outs, _ = self._io_plan(graph)
        feed = dict(feeds)
        for name, base in ins:
            feed[name] = self.tensors[base]
        out = self._call(graph, feed)
        for name, base in outs:
            if base is None:
                self._logits = out[name]
            else:
                self.tensors[base] = out[name]

    def _positions_now(self) -> list[np.ndarray]:
        return [_to_numpy(self.tensors[f"pos_{i}"]).copy() for i in range(len(self.layers))]

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

    return lambda engine, plugins: TensorRTRunner(engine, plugins)


__all__ = ["TrtGenerator", "default_engine_dir", "verify_engine_dir", "ENGINE_KIND"]
