# SPDX-License-Identifier: Apache-2.0
"""Run an export directory with onnxruntime: chunked prefill, greedy decode, host-driven compaction.

Static exports use IO binding with every cache tensor allocated once as an ``OrtValue`` (on the
session's device). A graph's cache outputs have the same shapes as its inputs; the runner keeps two
buffers per cache tensor and swaps them after each call (ping-pong), because onnxruntime does not
promise that a general graph may read and write the same buffer. Memory therefore stays fixed at
2 x the cache, whatever the number of steps (:meth:`OrtGenerator.resident_bytes` counts every buffer).
Where each token goes is decided by :class:`kvexport.cache.plan.CacheState`; this module only feeds the
graphs what the plan says. A full-cache export with a dynamic capacity axis (``dynamic_capacity``) is held in
a bucket of :meth:`~kvexport.cache.plan.CachePlan.slots_for` slots (plan rule 7): a prompt gets the bucket of
its columns, a token that does not fit doubles it (the filled slots copied once, the graphs bound again), so a
step reads O(filled) bytes, not the export's capacity.

The ``--dynamic-cache`` baseline's graph copies the whole past into its ``present_*`` outputs every step (that
copy is the point of the comparison). On CPU those outputs are written into the runner's own double buffer: two
flat arrays per cache tensor, sized for the sequence's known length (``prefill``'s ``reserve``) or grown by
doubling, the past read from one while the present is written into the other, then swapped. Left to
onnxruntime, each step's outputs came from its arena, which kept growing around tensors one row longer every step
(on a 385M model at 2048 tokens the process held 1.7 GB anonymous for 0.47 GB of K/V, against 1.0 GB so), and
fresh NumPy arrays instead paid a page fault per page each step (decode 2 x slower).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvexport.cache.formats import kv_format, layer_fields
from kvexport.cache.plan import CachePlan, CacheState, next_positions, positions_from_mask
from kvexport.errors import BadArtifact, BadUsage, MissingBackend
from kvexport.export.manifest import ONNX_EXPORT as KIND
from kvexport.export.manifest import verify_manifest

NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}


@dataclass
class OrtGenerationResult:
    tokens: np.ndarray  # (B, n_new) int64
    prompt_logits: np.ndarray  # (B, V) at the last prompt token
    step_logits: list[np.ndarray] = field(default_factory=list)  # per decode step (B, V)
    kept_positions: list[list[np.ndarray]] = field(default_factory=list)  # per compaction, per layer (B, Hc, cap)
    compaction_steps: list[str] = field(default_factory=list)  # "prefill:<chunk>" / "decode:<step>"
    compactions: int = 0
    cache_bytes: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: list[float] = field(default_factory=list)  # wall time of each decode step (incl. compaction)
    resident_bytes: dict[str, int] = field(default_factory=dict)  # every buffer the runtime holds, by kind


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def check_prompt(input_ids, attention_mask, max_new_tokens: int):
    ids = _np(input_ids).astype(np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.size == 0 or ids.shape[1] == 0:
        raise BadUsage("the prompt is empty; give at least one token")
    mask = np.ones_like(ids) if attention_mask is None else _np(attention_mask).astype(np.int64).reshape(ids.shape)
    if (mask.sum(-1) == 0).any():
        raise BadUsage("a prompt row is all padding; give at least one token per row")
    if int(max_new_tokens) < 1:
        raise BadUsage(f"max_new_tokens {max_new_tokens} must be >= 1")
    return ids, mask


class OrtGenerator:
    """Greedy generation from an export directory (verified against its manifest first).

    ``OrtGenerator(dir, providers=None)``: providers default to CUDA when onnxruntime offers it, else CPU.
    :meth:`generate` takes input_ids / attention_mask (B, N) with B = the export's batch.

    Step API (what :meth:`generate`, the profiler and long-run drivers use): :meth:`prefill` (resets, feeds the
    prompt, returns the last logits (B, V)), :meth:`decode` (one token per sequence -> logits (B, V)),
    :meth:`kept_positions`, the ``compactions`` counter and the ``on_compaction`` callback. Nothing is kept
    per step, so memory stays flat however long the run.
    """

    inplace = False  # whether decode runs the in-place graph (set per export on the CPU; other backends: never)

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None,
                 share_weights: bool = True, inplace: bool | None = None):
        try:
            import onnxruntime as ort
        except ImportError:  # pragma: no cover - onnxruntime is a dependency
            raise MissingBackend("onnxruntime is not installed; pip install onnxruntime") from None
        self.path = Path(path)
        self.manifest = verify_manifest(self.path, KIND)
        self.settings = s = self.manifest["settings"]
        if providers is None:
            avail = ort.get_available_providers()
            providers = ["CUDAExecutionProvider"] if "CUDAExecutionProvider" in avail else []
            providers.append("CPUExecutionProvider")
        self.providers = providers
        self.device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = int(threads)
        self._ort = ort
        graphs = {name: g for name, g in s["graphs"].items() if isinstance(g, dict) and "file" in g}
        # the in-place decode graph (onnxruntime's GroupQueryAttention on the CPU), when the export has one: used
        # by default on the CPU; ``inplace=False`` runs decode.onnx instead (the standard graph TensorRT runs too)
        has = "decode_inplace" in graphs
        if inplace and (not has or self.device != "cpu"):
            raise BadUsage(f"{self.path} has no in-place decode graph for this device (export it with "
                           "--inplace-decode; it runs on onnxruntime's CPU provider)")
        self.inplace = has and self.device == "cpu" and inplace is not False
        if has and not self.inplace:
            del graphs["decode_inplace"]
        opts = {name: so for name in graphs}
        self._shared: dict = {}  # (file, offset, length, type, dims) -> (memory-mapped array, OrtValue over it)
        self._maps: dict = {}  # weights file -> its read-only np.memmap; alive as long as the sessions
        if share_weights and self.device == "cpu" and graphs:  # one graph too: file pages, not a copy
            opts = self._share_initializers(graphs, threads)
        self.sessions = {name: ort.InferenceSession(str(self.path / g["file"]), opts[name], providers=providers)
                         for name, g in graphs.items()}
        self.batch = int(s["batch"])
        self.dtype = NP_DTYPES[s["dtype"]]
        self.dynamic = s["mode"] == "dynamic"
        self.press = s["press"]
        self.on_compaction = None  # callable(where: "prefill:<chunk>" | "decode:<step>", generator) per compaction
        self.last_logits = None
        if (s.get("kv_dtype") or s["dtype"]) == "bf16":
            raise MissingBackend(f"{self.path} stores its cache in bf16, which onnxruntime's Python API cannot bind "
                                 "(NumPy has no bfloat16); run it with --backend tensorrt, or export with --kv-dtype "
                                 "fp16 / int8")
        if not self.dynamic:
            self._alloc()
        else:
            # growing past: (present output, past input) per cache tensor, and on CPU per past name
            # [flat buffer the past is a view of, spare flat buffer the next present is written to]
            self._cache_io = [(n, n.replace("present_", "past_")) for n in s["graphs"]["model"]["outputs"]
                              if n.startswith("present_k") or n.startswith("present_v")]
            self._pair: dict[str, list[np.ndarray]] = {}
        self.reset()

    @property
    def decode_graph(self) -> str:
        """The graph one decode step runs: ``decode_inplace`` (in place) or ``decode``."""
        return "decode_inplace" if self.inplace else "decode"

    def close(self) -> None:
        """Drop the sessions, then the shared initializers and the weights file's maps (in that order: the
        sessions read the maps' pages). The generator is not usable afterwards; without a call, garbage
        collection does the same."""
        self.sessions = {}
        self._shared.clear()
        for m in self._maps.values():
            m._mmap.close()  # type: ignore[attr-defined]
        self._maps.clear()

    def _share_initializers(self, graphs: dict, threads: int | None) -> dict:
        """One copy in memory of every weight for all graphs of the export (CPU), and that copy the file's.

        The graphs share one weights file on disk (each tensor once, by offset; kvexport.export.exporter);
        loaded as they are, onnxruntime would still keep one copy per session. The weights file is memory-mapped
        read-only once (``np.memmap``); each stored tensor is a view of that map, wrapped in an OrtValue without a
        copy, and handed to every session that uses it with ``SessionOptions.add_initializer`` (onnxruntime uses a
        user initializer's buffer as it is), so the weights are file-backed pages the kernel can drop, not
        anonymous memory. Weight prepacking is disabled for those sessions, since it would make a packed copy per
        session again. The maps and OrtValues live in ``self._maps`` / ``self._shared`` as long as the generator.
        """
        import onnx

        np_types = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
                    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32,
                    onnx.TensorProto.BOOL: np.bool_, onnx.TensorProto.DOUBLE: np.float64}
        opts = {}
        for name, g in graphs.items():
            so = self._ort.SessionOptions()
            so.log_severity_level = 3
            if threads:
                so.intra_op_num_threads = int(threads)
            if g.get("external_data"):
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
    def _init_cache_layout(self) -> None:
        """Host-side layout shared by every backend (this runner and the TensorRT one).

        Sets ``plan`` (:class:`~kvexport.cache.plan.CachePlan`), ``state``, ``layers`` and ``shapes``: name ->
        (shape, dtype) of every cache buffer (``k_i`` (B, Hc, cap, Dk), ``v_i`` (B, Hc, cap, Dv), ``pos_i`` (B, Hc,
        cap) int64, with a press the ring ``qbuf_i`` (B, Hq, W, Dq) and ``qpos`` (B, W) int64) and of the decode
        step's new rows (``k_new_i`` (B, Hc, 1, Dk), ``v_new_i``, ``q_new_i`` (B, Hq, 1, Dq))."""
        s = self.settings
        B, W = self.batch, int(s["window"])
        self.layers = s["graphs"]["layers"]
        self.plan = CachePlan.from_settings(s)
        self.state = CacheState(self.plan)
        self.kv_format = kv_format(s.get("kv_dtype"), s["dtype"])
        store = storage_numpy(self.kv_format)
        self.shapes: dict[str, tuple[tuple[int, ...], type]] = {}
        self.step_shapes: dict[str, tuple[tuple[int, ...], type]] = {}
        self.full_shapes: dict[str, tuple[tuple[int, ...], type]] = {}  # prefill's rows before storage (lossy kv)
        self.fields: list[tuple[str, ...]] = []  # per layer: its cache tensors (k, v, pos, and ks / vs)
        for i, ly in enumerate(self.layers):
            H, cap = ly["heads"], ly["capacity"]
            fields = layer_fields(ly["value_dim"], self.kv_format)
            self.fields.append(fields)
            dims = {"k": (ly["key_dim"],), "v": (ly["value_dim"],), "pos": (), "ks": (), "vs": ()}
            types = {"k": store, "v": store, "pos": np.int64, "ks": np.float16, "vs": np.float16}
            for f in fields:
                self.shapes[f"{f}_{i}"] = ((B, H, cap, *dims[f]), types[f])
                if f != "pos":
                    self.step_shapes[f"{f}_new_{i}"] = ((B, H, 1, *dims[f]), types[f])
            self.full_shapes[f"kf_new_{i}"] = ((B, H, 1, ly["key_dim"]), self.dtype)
            self.full_shapes[f"vf_new_{i}"] = ((B, H, 1, ly["value_dim"]), self.dtype)
            if self.press is not None:
                self.shapes[f"qbuf_{i}"] = ((B, ly["q_heads"], W, ly["q_dim"]), self.dtype)
                self.step_shapes[f"q_new_{i}"] = ((B, ly["q_heads"], 1, ly["q_dim"]), self.dtype)
        if self.press is not None:
            self.shapes["qpos"] = ((B, W), np.int64)
        self._io_plans: dict[str, tuple] = {}
        self._ring_names = [(f"qbuf_{i}", f"q_new_{i}") for i in range(len(self.layers))]  # query ring, step rows

    def _io_plan(self, graph: str) -> tuple[list[str], list[str], frozenset[str]]:
        """What a call of ``graph`` binds, worked out once per graph: its array inputs (cache buffers or new rows),
        its outputs, and its host inputs."""
        plan = self._io_plans.get(graph)
        if plan is None:
            g = self.settings["graphs"][graph]
            arrays = [n for n in g["inputs"] if n in self.shapes or _kind(n) == "new"]
            host = frozenset(n for n in g["inputs"] if n not in arrays)
            plan = self._io_plans[graph] = (arrays, list(g["outputs"]), host)
        return plan

    # backend hooks: where arrays live and how a graph is called (the TensorRT generator overrides these)
    def _array(self, shape, dtype, fill=0):
        """A buffer the host writes with NumPy-style slicing: a NumPy array on the CPU (shared with onnxruntime
        without a copy), a torch tensor on a GPU."""
        if self.device == "cpu":
            return np.full(shape, fill, dtype)
        import torch

        t = torch.from_numpy(np.full(shape, fill, dtype)).to(self.device)
        return t

    def _host(self, x):
        """A host value in the arrays' kind (for writes into buffers)."""
        if self.device == "cpu" or not isinstance(x, np.ndarray):
            return x
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def _bind(self, io, name: str, arr, output: bool) -> None:
        if isinstance(arr, np.ndarray):
            if arr.base is not None:  # a view (e.g. one row of a batch of slots): wrapped for this call only
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
            bind(name, arr.device.type, arr.device.index or 0, _NP_OF_TORCH[str(arr.dtype)], tuple(arr.shape),
                 arr.data_ptr())

    def _call(self, graph: str, feeds: dict, arrays: dict, outputs: dict, persistent: bool = False) -> dict:
        """Run ``graph``: host ``feeds``, input ``arrays`` (buffers, by name) and output buffers ``outputs`` (by name;
        outputs not given are allocated by onnxruntime and returned as NumPy arrays). ``persistent``: the arrays and
        outputs are the same on every call (the decode step), so they are bound once and the host inputs are copied
        into preallocated arrays: a call then costs the run, not the binding."""
        sess = self.sessions[graph]
        if persistent and self.device == "cpu":
            bound = self._persistent.get(graph)
            if bound is None:
                io = sess.io_binding()
                host = {n: np.ascontiguousarray(x).copy() for n, x in feeds.items()}
                for name, x in host.items():
                    self._bind(io, name, x, output=False)
                for name, arr in arrays.items():
                    self._bind(io, name, arr, output=False)
                for name in self._io_plan(graph)[1]:
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
        for name in self._io_plan(graph)[1]:
            if name in outputs:
                self._bind(io, name, outputs[name], output=True)
            else:
                io.bind_output(name, self.device)
                loose.append(name)
        sess.run_with_iobinding(io)
        got = dict(outputs)
        if loose:
            values = dict(zip(self._io_plan(graph)[1], io.get_outputs(), strict=True))
            got.update({n: self._host(values[n].numpy()) for n in loose})
        return got

    def _alloc(self) -> None:
        """Every cache buffer once (a bucketed full cache: its smallest bucket), the decode step's output rows and the
        logits once: nothing per step."""
        self._init_cache_layout()
        self._ovs: dict = {}
        self._persistent: dict = {}
        self.cache = self._cache_buffers(self.plan.slots_for(0) if self.plan.bucketed else None)
        # the in-place decode graph writes the token's k / v into the cache itself: only its query is a step output
        self.step_out = {n: self._array(shape, dt) for n, (shape, dt) in self.step_shapes.items()
                         if not (self.inplace and _kind(n) == "new" and not n.startswith("q_"))}
        self.logits = self._array((self.batch, int(self.settings["vocab_size"])), self.dtype)
        self.step_out["logits"] = self.logits
        self.staging: dict = {}  # the prefill chunk's rows, held only while a prompt is fed

    def _cache_buffers(self, slots: int | None) -> dict:
        """Fresh cache buffers (empty: positions -1) of ``slots`` slots per layer (a bucket), or None: the export's
        capacities (``self.shapes``, also the most a bucket grows to)."""
        out = {}
        for n, (shape, dt) in self.shapes.items():
            if slots is not None and _kind(n) in ("kv", "scales", "positions"):
                shape = (*shape[:2], slots, *shape[3:])
            out[n] = self._array(shape, dt, -1 if _kind(n) in ("positions", "query_positions") else 0)
        return out

    def _fit(self, rows: int, shrink: bool = False) -> None:
        """Plan rule 7: hold the bucket of ``rows`` tokens. A larger bucket gets the filled slots copied once and the
        graphs are bound to it again; ``shrink`` (a new prompt, nothing filled) also takes a smaller one. A no-op for
        static caches and for buffers already larger (a server's slots hold the whole capacity)."""
        if not self.plan.bucketed:
            return
        want, have = self.plan.slots_for(rows), int(self.cache["pos_0"].shape[2])
        if want == have or (want < have and not shrink):
            return
        fill = min(max(self.state.fills), have, want)  # the slots written so far
        grown = self._cache_buffers(want)
        if fill:
            for n, arr in grown.items():
                arr[:, :, :fill] = self.cache[n][:, :, :fill]
        self.cache = grown
        self._ovs.clear()  # the OrtValues and the decode graph's binding wrap the old buffers
        self._persistent.clear()

    def _reset_buffers(self) -> None:
        """A new sequence only needs every position -1 (k/v of an empty slot are never read)."""
        for n, arr in self.cache.items():
            if _kind(n) in ("positions", "query_positions"):
                arr[...] = -1

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this runtime holds for its batch of sequences, read from its own buffers, by kind: ``kv`` (K/V or
        latents; codes for int8 / fp8), ``scales`` (their float16 scales), ``positions``, ``queries`` and
        ``query_positions`` (the ring), ``step_outputs`` (the decode step's
        new rows; for the growing past, the spare buffer its next present is written to), ``logits``, ``staging`` (a
        prefill chunk's rows, only while a prompt is fed) and ``total``. The formula:
        :meth:`kvexport.profile.kv_bytes.CacheShape.resident_bytes_at` (``double_buffer=True`` for the growing past
        on CPU, ``in_place=True`` when decode runs the in-place graph)."""
        out = dict.fromkeys(("kv", "scales", "positions", "queries", "query_positions", "step_outputs", "logits",
                             "staging"), 0)
        if self.dynamic:
            out["kv"] = self.current_cache_bytes()
            out["positions"] = int(self._past_pos.nbytes)
            out["step_outputs"] = sum(int(p[1].nbytes) for p in self._pair.values())  # the next present's buffer
        else:
            for n, arr in self.cache.items():
                out[_kind(n)] += _nbytes(arr)
            out["step_outputs"] = sum(_nbytes(a) for n, a in self.step_out.items() if n != "logits")
            out["logits"] = _nbytes(self.logits)
            out["staging"] = sum(_nbytes(a) for a in self.staging.values())
        out["total"] = sum(out.values())
        return out

    def _positions_now(self) -> list[np.ndarray]:
        return [_to_numpy(self.cache[f"pos_{i}"]).copy() for i in range(len(self.layers))]

    # ------------------------------------------------------------------ writes the plan asks for
    def _write_rows(self, rows: dict, i: int, slot: int, positions, first: int = 0) -> None:
        """Layer i: new rows [first, T) of ``rows`` (k_new_i, v_new_i (B, Hc, T, .), and the scales ks_new_i,
        vs_new_i (B, Hc, T) of a quantized cache) into slots [slot, ...), their positions (B, T) alike."""
        n = rows[f"k_new_{i}"].shape[2] - first
        for f in self.fields[i]:
            if f != "pos":
                self.cache[f"{f}_{i}"][:, :, slot : slot + n] = rows[f"{f}_new_{i}"][:, :, first:]
        self.cache[f"pos_{i}"][:, :, slot : slot + n] = self._host(np.asarray(positions)[:, None, first:])

    def _write_kept(self, kept: dict) -> None:
        """A compaction's output: the best budget_i rows (and their scales) into slots [0, budget_i), the rest of
        the layer emptied."""
        for i, b in enumerate(self.plan.budgets):
            for f in self.fields[i]:
                self.cache[f"{f}_{i}"][:, :, :b] = kept[f"kept_{f}_{i}"]
            self.cache[f"pos_{i}"][:, :, b:] = -1

    def _cache_inputs(self, graph: str, extra: dict | None = None) -> dict:
        names = self._io_plan(graph)[0]
        pool = {**self.cache, **(extra or {})}
        return {n: pool[n] for n in names}

    # ------------------------------------------------------------------ step API
    def reset(self) -> None:
        """Start a new sequence: empty every cache buffer and the plan's bookkeeping."""
        B = self.batch
        self.compactions = 0
        self.next_pos = np.zeros(B, np.int64)  # (B,) position of the next token
        self.last_logits: np.ndarray | None = None  # (B, V)
        self.step = 0  # decode steps since the prefill
        if self.dynamic:
            self._past: dict = {}
            for inp in self.sessions["model"].get_inputs():
                if inp.name.startswith("past_") and inp.name != "past_positions":
                    shp = list(inp.shape)
                    shp[0], shp[2] = B, 0
                    self._past[inp.name] = np.zeros(shp, self.dtype)
            self._past_pos = np.zeros((B, 0), np.int64)
        else:
            self._reset_buffers()
            self.state.reset()

    @property
    def fill(self) -> list[int]:
        """Occupied slots per layer (the plan's count)."""
        return list(self.state.fills)

    @property
    def budgets(self) -> list[int]:
        return list(self.plan.budgets)

    @property
    def caps(self) -> list[int]:
        return list(self.plan.capacities)

    def kept_positions(self) -> list[np.ndarray]:
        """Positions held in each layer's cache now: per layer (B, Hc, slots held) int64, -1 = empty slot (copies).

        For the growing-past baseline: one (B, 1, n) array of the positions fed so far."""
        if self.dynamic:
            return [self._past_pos[:, None].copy()]
        return self._positions_now()

    def _compacted(self, where: str) -> None:
        self.compactions += 1
        if self.on_compaction is not None:
            self.on_compaction(where, self)

    def _check_length(self, ids: np.ndarray, mask: np.ndarray) -> None:
        n = int(mask.sum(-1).max())
        limit = int(self.settings.get("max_positions") or 0)
        if limit and n > limit:
            raise BadUsage(f"prompt of {n} tokens exceeds the export's maximum {limit} (max_positions)")

    def prefill(self, input_ids, attention_mask=None, reserve: int | None = None) -> np.ndarray:
        """Reset, then feed the prompt ``input_ids`` (B, N) (``attention_mask`` (B, N) 0/1, left padded).

        ``reserve``: the tokens the sequence will reach (prompt + new ones), when known. A bucketed full cache then
        takes that length's bucket now if it is at most twice the prompt's length (a step still reads at most twice
        the filled slots), so decoding does not grow it (a grown bucket is a copy, held beside the old one while
        it is made).

        Static exports run the prefill graph on the plan's chunks (a short last chunk padded at its front) and write
        each chunk's real columns at ``fill``, or run ``compact_prefill`` when a layer overflows its budget. Returns
        the logits of the last prompt token, (B, V) (a copy)."""
        ids, mask = check_prompt(input_ids, attention_mask, 1)
        if ids.shape[0] != self.batch:
            raise BadUsage(f"this export takes batches of {self.batch} prompt(s), got {ids.shape[0]}")
        self._check_length(ids, mask)
        pos = positions_from_mask(mask)
        N, B = ids.shape[1], self.batch
        C = int(self.settings["chunk"])
        self.reset()
        self.next_pos = next_positions(pos)
        if self.dynamic:
            self._hold_past(max(N, int(reserve or 0)), exact=bool(reserve))
            for c in range(0, N, C):
                last = self._run_dynamic(ids[:, c:c + C], pos[:, c:c + C])
            self.last_logits = last
            return last.copy()
        self.plan.check_fits(N)
        self._fit(self._reserved_rows(N, reserve), shrink=True)
        prefill_rows = set(self.settings["graphs"]["prefill"]["outputs"])
        chunk_shapes = {n: ((*shape[:2], C, *shape[3:]), dt) for n, (shape, dt) in
                        {**self.step_shapes, **self.full_shapes}.items() if n in prefill_rows}
        self.staging = {n: self._array(shape, dt) for n, (shape, dt) in chunk_shapes.items()}
        try:
            out = {**self.staging, "logits": self.logits}
            for index, chunk in enumerate(self.plan.chunks(N)):
                step = self.state.prefill(chunk.n_real)
                pad = chunk.pad
                c_ids = np.concatenate([np.zeros((B, pad), np.int64), ids[:, chunk.start:chunk.stop]], axis=1)
                c_pos = np.concatenate([np.full((B, pad), -1, np.int64), pos[:, chunk.start:chunk.stop]], axis=1)
                rows = self._call("prefill", self._feeds("prefill", input_ids=c_ids, positions=c_pos),
                                  self._cache_inputs("prefill"), out)
                if step.any_compaction:
                    kept = self._call("compact_prefill",
                                      self._feeds("compact_prefill", fill=np.array(step.fills, np.int64),
                                                  n_pad=np.array([pad], np.int64), positions=c_pos),
                                      self._cache_inputs("compact_prefill", rows), {})
                    self._write_kept(kept)
                    self._compacted(f"prefill:{index}")
                else:
                    for i, f in enumerate(step.fills):
                        self._write_rows(rows, i, f, c_pos, first=pad)
        finally:
            for arr in self.staging.values():  # their OrtValues too: the buffers were this prompt's only
                self._ovs.pop(id(arr), None)
            self.staging = {}
        self.last_logits = self._logits_now()
        return self.last_logits.copy()

    def _reserved_rows(self, n: int, reserve: int | None) -> int:
        """The rows a new prompt of ``n`` tokens holds a bucket for (see :meth:`prefill`'s ``reserve``)."""
        if not self.plan.bucketed or not reserve or reserve <= n:
            return n
        total = min(int(reserve), max(self.plan.capacities))
        return total if self.plan.slots_for(total) <= 2 * n else n

    def _logits_now(self) -> np.ndarray:
        return _to_numpy(self.logits).copy()

    def decode(self, token) -> np.ndarray:
        """Feed one token per sequence, ``token`` (B,) int (or an int for batch 1), at the next position; returns
        its logits (B, V). The graph returns the token's rows and the host writes them where the plan says; a press
        export compacts when the plan says so; a full-cache export refuses a token that does not fit
        (:class:`~kvexport.cache.plan.CacheFull`)."""
        if getattr(self, "last_logits", None) is None:
            raise BadUsage("decode() before prefill(); call prefill(input_ids) first")
        tok = np.asarray(token, dtype=np.int64).reshape(self.batch)
        pos = self.next_pos[:, None].astype(np.int64)
        if self.dynamic:
            last = self._run_dynamic(tok[:, None], pos)
        else:
            step = self.state.decode()
            self._fit(max(step.slots) + 1)
            if self.inplace:
                rows = self._decode_in_place(step, tok, pos)
            else:
                rows = self._call("decode", self._feeds("decode", input_ids=tok[:, None], positions=pos),
                                  self._cache_inputs("decode"), self.step_out, persistent=True)
            last = self._logits_now()
            if self.apply_decode(step, rows, pos, written=self.inplace):
                self._compacted(f"decode:{self.step}")
        self.step += 1
        self.next_pos = self.next_pos + 1
        self.last_logits = last
        return last.copy()

    def _decode_in_place(self, step, tok: np.ndarray, pos: np.ndarray) -> dict:
        """The in-place decode graph: the token's positions into their slots first (its attention reads them), then
        one call whose ``k_present_i`` / ``v_present_i`` outputs are bound to the cache buffers its ``k_i`` / ``v_i``
        inputs read, so onnxruntime's GroupQueryAttention writes only the token's slot (``slots`` = the plan's).
        -> the step's outputs (logits, queries)."""
        cache = self.cache
        for i, slot in enumerate(step.slots):
            cache[f"pos_{i}"][:, :, slot] = pos
        slots = np.repeat(np.asarray(step.slots, np.int32)[:, None], self.batch, axis=1)
        feeds = {"input_ids": tok[:, None], "positions": pos, "slots": slots}
        if "decode_inplace" in self._persistent:  # bound already: only the host inputs change
            return self._call("decode_inplace", feeds, {}, self.step_out, persistent=True)
        outputs = {**self.step_out, **{o: cache[c] for o, c in
                                       self.settings["graphs"]["decode_inplace"]["in_place"].items()}}
        self._call("decode_inplace", self._feeds("decode_inplace", **feeds), self._cache_inputs("decode_inplace"),
                   outputs, persistent=True)
        return self.step_out

    def apply_decode(self, step, rows: dict, pos, written: bool = False) -> bool:
        """What the plan's DecodeStep ``step`` asks of the host once the decode graph has run: the token's new
        ``rows`` into their slots (unless ``written``: the in-place graph wrote them, and its positions, already),
        its query into the ring (a press), then the compaction if due (the ``compact`` graph, kept rows into slots
        [0, budget)); ``pos`` (B, 1) the token's positions. -> whether it compacted. One statement for every driver
        of these buffers (this generator, the server's slots)."""
        for i, slot in enumerate(step.slots if not written else ()):
            self._write_rows(rows, i, slot, pos)
        if self.press is not None:
            q, cache = step.query_slot, self.cache
            for ring, new in self._ring_names:
                cache[ring][:, :, q] = rows[new][:, :, 0]
            cache["qpos"][:, q] = self._host(pos)[:, 0]
        if not step.compact:
            return False
        start = self.state.query_start
        fills = self.state.compact()
        kept = self._call("compact", self._feeds("compact", fill=np.array(fills, np.int64),
                                                 query_start=np.array([start], np.int64)),
                          self._cache_inputs("compact"), {})
        self._write_kept(kept)
        return True

    def _feeds(self, graph: str, **candidates: np.ndarray) -> dict[str, np.ndarray]:
        """The host inputs ``graph`` declares, out of ``candidates`` (buffers are bound separately)."""
        names = self._io_plan(graph)[2]
        missing = sorted(n for n in names if n not in candidates)
        if missing:
            raise BadArtifact(f"{self.path}/{graph}.onnx wants inputs {missing} this runtime does not know; "
                              "re-export it with this kvexport version")
        return {k: v for k, v in candidates.items() if k in names}

    def _hold_past(self, rows: int, exact: bool) -> None:
        """Growing past on CPU: both flat buffers of every cache tensor hold at least ``rows`` rows (exactly
        ``rows`` when ``exact``: the sequence's known length, so a longer earlier sequence's buffers are not kept)."""
        if self.device != "cpu":
            return
        for name, past in self._past.items():
            B, H, _, D = past.shape
            want = B * H * rows * D
            pair = self._pair.get(name)
            if pair is None or (pair[0].size != want if exact else pair[0].size < want):
                self._pair[name] = [np.empty(want, self.dtype), np.empty(want, self.dtype)]

    def _present_view(self, past_name: str, rows: int) -> np.ndarray:
        """The spare buffer of ``past_name`` as a (B, H, rows, D) array (grown by doubling when too small)."""
        B, H, _, D = self._past[past_name].shape
        pair = self._pair[past_name]  # made by prefill (_hold_past)
        n = B * H * rows * D
        if pair[1].size < n:
            pair[1] = np.empty(max(n, 2 * pair[1].size), self.dtype)
        return pair[1][:n].reshape(B, H, rows, D)

    def _run_dynamic(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """One call of the growing-past graph; returns the last token's logits (B, V). On CPU the present of every
        cache tensor is written into its spare buffer, which then holds the past (see the module docstring)."""
        sess = self.sessions["model"]
        names = self.settings["graphs"]["model"]["outputs"]
        io = sess.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        io.bind_cpu_input("positions", np.ascontiguousarray(pos))
        io.bind_cpu_input("past_positions", np.ascontiguousarray(self._past_pos))
        for name, v in self._past.items():
            if isinstance(v, np.ndarray):
                io.bind_cpu_input(name, v)
            else:
                io.bind_ortvalue_input(name, v)
        own = {}
        if self.device == "cpu":
            rows = int(self._past_pos.shape[1]) + int(ids.shape[1])
            own = {out: (past, self._present_view(past, rows)) for out, past in self._cache_io}
        for name in names:
            if name in own:
                v = own[name][1]
                io.bind_output(name, "cpu", 0, v.dtype, list(v.shape), v.ctypes.data)
            else:
                io.bind_output(name, self.device)
        sess.run_with_iobinding(io)
        outs = dict(zip(names, io.get_outputs(), strict=False))
        for name, (past, v) in own.items():  # the spare now holds the past; the old past's buffer is the next spare
            pair = self._pair[past]
            pair[0], pair[1] = pair[1], pair[0]
            outs[name] = v
        self._past = {past: outs[out] for out, past in self._cache_io}
        self._past_pos = outs["present_positions"].numpy()
        logits = outs["logits"].numpy()
        return logits[:, -1] if logits.ndim == 3 else logits

    def current_cache_bytes(self) -> int:
        """Bytes of K/V cache held now (fixed for static budgets; a bucketed full cache's bucket; for the growing
        past, the buffer its past lives in, as allocated: the sequence's reserved length)."""
        if self.dynamic:
            if self._pair:  # the buffer the past lives in, as allocated
                return sum(int(p[0].nbytes) for p in self._pair.values())
            return sum(v.numpy().nbytes if not isinstance(v, np.ndarray) else v.nbytes for v in self._past.values())
        return self.resident_bytes()["kv"]

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 32, eos_token_id: int | None = None,
                 forced_tokens=None, track_kept: bool = True, keep_logits: bool = False) -> OrtGenerationResult:
        """Greedy decoding on top of :meth:`prefill` / :meth:`decode`.

        ``forced_tokens (B, n)`` feeds those tokens instead of the argmax (teacher forcing, for parity runs).
        ``keep_logits``: keep every decode step's logits (B, V) in ``step_logits`` (memory grows with the
        steps; off by default). ``track_kept``: copy the kept positions after each compaction."""
        ids, mask = check_prompt(input_ids, attention_mask, max_new_tokens)
        if ids.shape[0] != self.batch:
            raise BadUsage(f"this export takes batches of {self.batch} prompt(s), got {ids.shape[0]}")
        if not self.dynamic:
            self.plan.check_fits(ids.shape[1], max_new_tokens - 1)
        B = self.batch
        res = OrtGenerationResult(tokens=np.zeros((B, 0), np.int64), prompt_logits=np.zeros(0))

        previous = self.on_compaction

        def on_compaction(where, gen):
            if track_kept:
                res.kept_positions.append(gen.kept_positions())
                res.compaction_steps.append(where)
            if previous is not None:  # the caller's own callback still sees every compaction
                previous(where, gen)

        self.on_compaction = on_compaction
        try:
            t0 = time.perf_counter()
            last = self.prefill(ids, mask, reserve=ids.shape[1] + max_new_tokens - 1)
            res.prompt_logits = last
            res.prefill_seconds = time.perf_counter() - t0
            done = np.zeros(B, bool)
            out = []
            for step in range(max_new_tokens):
                tok = self._next_token(last, step, forced_tokens, done, eos_token_id)
                out.append(tok)
                if step == max_new_tokens - 1 or (eos_token_id is not None and done.all()):
                    break
                t0 = time.perf_counter()
                last = self.decode(tok)
                res.decode_seconds.append(time.perf_counter() - t0)
                if keep_logits:
                    res.step_logits.append(last)
        finally:
            self.on_compaction = previous
        res.tokens = np.stack(out, axis=1)
        res.compactions = self.compactions
        res.cache_bytes = self.current_cache_bytes()
        res.resident_bytes = self.resident_bytes()
        return res

    def _next_token(self, last, step, forced, done, eos):
        tok = last.argmax(-1).astype(np.int64) if forced is None else _np(forced)[:, step].astype(np.int64)
        if eos is not None:
            tok = np.where(done, eos, tok)
            done |= tok == eos
        return tok


_NP_OF_TORCH = {"torch.float32": np.float32, "torch.float16": np.float16, "torch.int64": np.int64,
                "torch.int32": np.int32, "torch.bool": np.bool_, "torch.uint8": np.uint8}


def storage_numpy(fmt):
    """The NumPy element type of a cache format's K/V tensors (ml_dtypes' bfloat16 for bf16)."""
    if fmt.numpy == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(fmt.numpy).type


def _nbytes(arr) -> int:
    """Bytes of a buffer (NumPy array or torch tensor)."""
    return int(arr.nbytes) if hasattr(arr, "nbytes") else int(arr.numel() * arr.element_size())


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        return x.numpy()
    return np.asarray(x)


def _kind(name: str) -> str:
    """Buffer name -> the kind :meth:`OrtGenerator.resident_bytes` counts it under."""
    if "_new_" in name:  # k_new_ v_new_ ks_new_ vs_new_ q_new_ kf_new_ vf_new_
        return "new"
    if name.startswith(("k_", "v_")):
        return "kv"
    if name.startswith(("ks_", "vs_")):
        return "scales"
    if name.startswith("pos_"):
        return "positions"
    if name.startswith("qbuf_"):
        return "queries"
    return "query_positions"
