# SPDX-License-Identifier: Apache-2.0
"""An export directory's graphs as onnxruntime sessions, and how a graph is called on them (:class:`OrtSessions`):
the onnxruntime backend of the one host (:class:`~kvexport.runtime.host.GraphHost`) and of the growing-past
baseline (:class:`~kvexport.runtime.growing.GrowingPast`).

Buffers are bound with IO binding: a NumPy array the session reads without a copy on the CPU, a torch tensor on a
GPU. A call whose buffers never change (the decode step) binds them once, and only its host inputs are copied per
call, so a step costs the run, not the binding. Weights: one copy in memory for all graphs, and that copy the
weights file's pages (:meth:`OrtSessions._share_initializers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from kvexport.errors import BadUsage, MissingBackend
from kvexport.manifest import ONNX_EXPORT, verify_manifest

#: torch dtypes (by name) -> the NumPy types onnxruntime binds a device buffer as
NP_OF_TORCH = {"torch.float32": np.float32, "torch.float16": np.float16, "torch.int64": np.int64,
               "torch.int32": np.int32, "torch.bool": np.bool_, "torch.uint8": np.uint8}


def import_onnxruntime():
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - onnxruntime is a dependency
        raise MissingBackend("onnxruntime is not installed; pip install onnxruntime") from None
    return ort


class LazySessions(Mapping):
    """An export's onnxruntime sessions by graph name: those named in ``now`` made at once, every other one the
    first time it is asked for.

    Every graph of the export is a key (``in``, ``len`` and iteration see them all); a deferred session and what it
    would hold (its arenas, a packed copy of the weights for a decode graph, an int4 export's packed blocks) exists
    only once that graph runs, so a runtime that never runs a graph (``decode_batch`` when one sequence is
    generated) never holds its memory. ``made()``: the graphs whose sessions exist."""

    def __init__(self, make, names, now=()):
        self._make, self._names, self._made = make, list(names), {}
        for name in now:
            self[name]

    def __getitem__(self, name):
        sess = self._made.get(name)
        if sess is None:
            if name not in self._names:
                raise KeyError(name)
            sess = self._made[name] = self._make(name)
        return sess

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)

    def made(self) -> list[str]:
        return list(self._made)


#: the graphs a decode step runs (one token per sequence): where a packed copy of the weights pays for itself
HOT_GRAPHS = frozenset({"decode", "decode_inplace", "decode_batch"})


class OrtSessions:
    """The graphs of an export directory (verified against its manifest) as onnxruntime sessions.

    ``providers`` default to CUDA when onnxruntime offers it, else CPU; ``threads``: intra-op threads;
    ``share_weights``: one memory-mapped copy of the weights for every session (CPU); ``inplace``: run decode through
    ``decode_inplace.ort.onnx`` when the export has it (default on the CPU; False: decode.onnx, the graph TensorRT runs
    too; True: refused where it cannot run). ``manifest``: the directory's, verified already. ``prepack_decode``
    (CPU, shared weights): the decode graphs (:data:`HOT_GRAPHS`) keep onnxruntime's weight prepacking, so their
    sessions hold a packed copy of the weights they use (anonymous memory, about the float weights' bytes again) and
    decode from it, 1.3x faster per step on SmolLM2; every other graph reads the one mapped copy. False: one copy,
    prepacking off everywhere (int4 weights are packed per session in either case). ``sessions``
    (:class:`LazySessions`): the batched step's session (and decode.onnx's where the in-place graph decodes) is made
    when it first runs, so one sequence generated from an export with a ``decode_batch`` graph never holds that
    graph's packed weights."""

    backend = "onnxruntime"

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None,
                 share_weights: bool = True, inplace: bool | None = None, manifest: dict | None = None,
                 prepack_decode: bool = True):
        ort = import_onnxruntime()
        self.path = Path(path)
        self.manifest = manifest if manifest is not None else verify_manifest(self.path, ONNX_EXPORT)
        self.settings = s = self.manifest["settings"]
        if providers is None:
            avail = ort.get_available_providers()
            providers = ["CUDAExecutionProvider"] if "CUDAExecutionProvider" in avail else []
            providers.append("CPUExecutionProvider")
        self.providers = providers
        self.device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        self._ort = ort
        self._threads = threads
        self.prepack_decode = bool(prepack_decode)
        files = {name: g for name, g in s["graphs"].items() if isinstance(g, dict) and "file" in g}
        # the in-place decode graph (onnxruntime's GroupQueryAttention on the CPU), when the export has one
        has = "decode_inplace" in files
        if inplace and (not has or self.device != "cpu"):
            raise BadUsage(f"{self.path} has no in-place decode graph for this device (export it with "
                           "--inplace-decode; it runs on onnxruntime's CPU provider)")
        self.inplace = has and self.device == "cpu" and inplace is not False
        if has and not self.inplace:
            del files["decode_inplace"]
        if (s.get("kv_dtype") or s["dtype"]) == "bf16" and s["mode"] == "static":
            raise MissingBackend(f"{self.path} stores its cache in bf16, which onnxruntime's Python API cannot bind "
                                 "(NumPy has no bfloat16); run it with --backend tensorrt, or export with --kv-dtype "
                                 "fp16 / int8")
        opts = {name: self._options() for name in files}
        self._shared: dict = {}  # (file, offset, length, type, dims) -> (memory-mapped array, OrtValue over it)
        self._maps: dict = {}  # weights file -> its read-only np.memmap; alive as long as the sessions
        if share_weights and self.device == "cpu" and files:  # one graph too: file pages, not a copy
            opts = self._share_initializers(files)
        # made now: what one sequence runs (its first prompt is not slowed by a session's creation); deferred to
        # their first call: the batched step, and decode.onnx where the in-place graph decodes
        later = {"decode_batch"} | ({"decode"} if self.inplace else set())
        self.sessions = LazySessions(
            lambda name: ort.InferenceSession(str(self.path / files[name]["file"]), opts[name], providers=providers),
            files, now=[n for n in files if n not in later])
        self._ovs: dict = {}  # id(buffer) -> (buffer, its OrtValue): made once per buffer this runtime owns
        self._persistent: dict = {}  # graph -> (IO binding, host input arrays): bound once

    def _options(self):
        so = self._ort.SessionOptions()
        so.log_severity_level = 3
        if self._threads:
            so.intra_op_num_threads = int(self._threads)
        if (self.settings.get("weights") or {}).get("format") == "int4-qdq":
            # onnxruntime fuses its DequantizeLinear + MatMul into MatMulNBits, by default with int8 activations;
            # float32 ones keep the arithmetic of the PyTorch reference on the same weights (kvexport.quant)
            so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        return so

    def close(self) -> None:
        """Drop the sessions, then the shared initializers and the weights file's maps (in that order: the
        sessions read the maps' pages). Not usable afterwards; without a call, garbage collection does the same."""
        self.sessions = {}
        self._persistent.clear()
        self._ovs.clear()
        self._shared.clear()
        for m in self._maps.values():
            m._mmap.close()  # type: ignore[attr-defined]
        self._maps.clear()

    def _share_initializers(self, graphs: dict) -> dict:
        """One copy in memory of every weight for all graphs of the export (CPU), and that copy the file's.

        The graphs share one weights file on disk (each tensor once, by offset; kvexport.export.exporter); loaded
        as they are, onnxruntime would still keep one copy per session. The weights file is memory-mapped read-only
        once (``np.memmap``); each stored tensor is a view of that map, wrapped in an OrtValue without a copy, and
        handed to every session that uses it with ``SessionOptions.add_initializer`` (onnxruntime uses a user
        initializer's buffer as it is), so the weights are file-backed pages the kernel can drop, not anonymous
        memory. Weight prepacking is disabled for those sessions, since it would make a packed copy per session
        again, except for the decode graphs when ``prepack_decode`` (one packed copy, what a step reads: the float
        MatMuls run 1.3x faster from it) and for an export whose weights are int4 (the manifest's ``weights`` entry, kvexport.quant):
        MatMulNBits packs its blocks at session creation and, unpacked, dequantizes the whole weight on every call
        (tens of times slower); its uint8 blocks are not shared, each session packs its own (an int4 weight is an
        eighth of its float32 bytes)."""
        import onnx

        np_types = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
                    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32,
                    onnx.TensorProto.BOOL: np.bool_, onnx.TensorProto.DOUBLE: np.float64}
        opts = {}
        packs = (self.settings.get("weights") or {}).get("format") in ("int4", "int4-qdq")
        for name, g in graphs.items():
            so = self._options()
            if g.get("external_data"):
                if not packs and not (self.prepack_decode and name in HOT_GRAPHS):
                    so.add_session_config_entry("session.disable_prepacking", "1")
                model = onnx.load(str(self.path / g["file"]), load_external_data=False)
                for t in model.graph.initializer:
                    if t.data_location != onnx.TensorProto.EXTERNAL or t.data_type not in np_types:
                        continue
                    info = {e.key: e.value for e in t.external_data}
                    key = (info["location"], int(info.get("offset", 0)), int(info["length"]), t.data_type, tuple(t.dims))
                    if key not in self._shared:
                        loc = info["location"]
                        if loc not in self._maps:  # the whole file, read-only: its pages belong to the page cache
                            self._maps[loc] = np.memmap(self.path / loc, dtype=np.uint8, mode="r")
                        off = int(info.get("offset", 0))
                        raw = self._maps[loc][off : off + int(info["length"])]
                        arr = raw.view(np_types[t.data_type]).reshape(list(t.dims))
                        self._shared[key] = (arr, self._ort.OrtValue.ortvalue_from_numpy(arr))
                    so.add_initializer(t.name, self._shared[key][1])
            opts[name] = so
        return opts

    # ------------------------------------------------------------------ buffers
    def array(self, shape, dtype, fill=0):
        """A buffer the host writes with NumPy-style slicing: a NumPy array on the CPU (shared with onnxruntime
        without a copy), a torch tensor on a GPU."""
        if self.device == "cpu":
            return np.full(shape, fill, dtype)
        import torch

        return torch.from_numpy(np.full(shape, fill, dtype)).to(self.device)

    def to_device(self, x):
        """A host value in the buffers' kind (for writes into them)."""
        if self.device == "cpu" or not isinstance(x, np.ndarray):
            return x
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def forget(self, buffers, unbind: bool = False) -> None:
        """Drop the OrtValues made for ``buffers`` (about to be freed or replaced); ``unbind``: the persistent
        bindings too (they may hold them)."""
        for b in buffers:
            self._ovs.pop(id(b), None)
        if unbind:
            self._persistent.clear()

    def bound(self, graph: str) -> bool:
        return graph in self._persistent

    def _bind(self, io, name: str, arr, output: bool) -> None:
        if isinstance(arr, np.ndarray):
            if arr.base is not None:  # a view (e.g. one row of a bank of slots): wrapped for this call only
                ov = (arr, self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr)))
                if ov[1].data_ptr() != arr.ctypes.data:
                    raise BadUsage(f"{name}: a buffer view must be contiguous to be bound in place")
            else:  # a buffer this runtime owns: its OrtValue is made once
                ov = self._ovs.get(id(arr))
                if ov is None or ov[0] is not arr:
                    ov = self._ovs[id(arr)] = (arr, self._ort.OrtValue.ortvalue_from_numpy(arr))
            (io.bind_ortvalue_output if output else io.bind_ortvalue_input)(name, ov[1])
        else:  # a torch tensor on the session's device
            bind = io.bind_output if output else io.bind_input
            bind(name, arr.device.type, arr.device.index or 0, NP_OF_TORCH[str(arr.dtype)], tuple(arr.shape),
                 arr.data_ptr())

    def call(self, graph: str, feeds: dict, arrays: dict, outputs: dict, persistent: bool = False) -> dict:
        """Run ``graph``: host ``feeds``, input ``arrays`` (buffers, by name) and output buffers ``outputs`` (by name;
        outputs not given are allocated by onnxruntime and returned in the buffers' kind). ``persistent``: the arrays
        and outputs are the same on every call (the decode step), so they are bound once and the host inputs are
        copied into preallocated arrays."""
        sess = self.sessions[graph]
        names = self.settings["graphs"][graph]["outputs"]
        if persistent and self.device == "cpu":
            bound = self._persistent.get(graph)
            if bound is None:
                io = sess.io_binding()
                host = {n: np.ascontiguousarray(x).copy() for n, x in feeds.items()}
                for name, x in host.items():
                    self._bind(io, name, x, output=False)
                for name, arr in arrays.items():
                    self._bind(io, name, arr, output=False)
                for name in names:
                    self._bind(io, name, outputs[name], output=True)
                bound = self._persistent[graph] = (io, host)
            io, host = bound
            for name, x in feeds.items():
                host[name][...] = x
            sess.run_with_iobinding(io)
            return outputs
        io = sess.io_binding()
        for name, x in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(x))
        for name, arr in arrays.items():
            self._bind(io, name, arr, output=False)
        loose = []
        for name in names:
            if name in outputs:
                self._bind(io, name, outputs[name], output=True)
            else:
                io.bind_output(name, self.device)
                loose.append(name)
        sess.run_with_iobinding(io)
        got = dict(outputs)
        if loose:
            values = dict(zip(names, io.get_outputs(), strict=True))
            got.update({n: self.to_device(values[n].numpy()) for n in loose})
        return got


__all__ = ["LazySessions", "OrtSessions", "import_onnxruntime", "NP_OF_TORCH"]
