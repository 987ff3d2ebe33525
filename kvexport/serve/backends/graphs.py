# SPDX-License-Identifier: Apache-2.0
"""Cache slots over an export's graphs (onnxruntime, or TensorRT engines): in-flight batching on static caches.

The export is made with ``batch=1, decode_batch=N`` (``kvexport export --batch 1 --decode-batch N``). Every cache
buffer is allocated once for all N slots as one (N, ...) array; slot r is the contiguous row view ``arr[r:r+1]``
and has its own :class:`~kvexport.cache.plan.CacheState`. A slot's prefill chunks and compactions run the batch-1
graphs (``prefill``, ``compact_prefill``, ``compact``) on its row views; all decoding slots step together through
``decode_batch.onnx`` (each row at its own position; the graph only reads the caches, and the host writes each
row's new keys/values/queries where that row's plan says). Rows not decoding get token 0 at position 0 and their
outputs are ignored, so nothing is written into them. An export without ``decode_batch`` decodes slot by slot
with the batch-1 ``decode`` graph on the row views.

The batched call costs about the same however many of its N rows are in use, so with few active sequences one
batch-1 call per sequence is faster. ``decode="auto"`` times both once at start (:meth:`GraphSlots.calibrate`)
and uses the batched graph from the number of active sequences where it wins; ``"batched"`` / ``"rows"`` force
one way. Both ways compute each row independently (their logits agree to float rounding, ~1e-5).

The host steps are :meth:`OrtGenerator.prefill` / :meth:`OrtGenerator.decode`'s, per slot, through the
generator's own hooks (``_call``, ``_write_rows``, ``_write_kept``, ``_cache_inputs``), which write through
``self.cache``: :meth:`_Slots.select` points it at one slot's row views.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvexport.cache.plan import positions_from_mask
from kvexport.errors import BadArtifact, BadUsage
from kvexport.export.runtime import _NP_OF_TORCH, OrtGenerator, _kind, _nbytes, _to_numpy
from kvexport.serve.backends.base import DECODE_MODES, SlotBackend


def _dtype(a):
    """The NumPy element type of a buffer (a NumPy array, or a torch tensor on a GPU)."""
    return a.dtype.type if isinstance(a, np.ndarray) else _NP_OF_TORCH[str(a.dtype)]


PER_SLOT = ("kv", "positions", "queries", "query_positions")
#: the host inputs each graph call below can give (checked at start: a stale export is refused before serving)
FEEDS = {"prefill": {"input_ids", "positions"}, "decode": {"input_ids", "positions"},
         "decode_batch": {"input_ids", "positions"}, "compact_prefill": {"fill", "n_pad", "positions"},
         "compact": {"fill", "query_start"}}


def check_feeds(rt) -> None:
    """Refuse an export whose graphs want host inputs the calls here do not give (made by another version)."""
    for graph, known in FEEDS.items():
        if graph in rt.settings["graphs"]:
            missing = sorted(rt._io_plan(graph)[2] - known)
            if missing:
                raise BadArtifact(f"{rt.path}/{graph}.onnx wants inputs {missing} this kvexport version does not "
                                  "give; re-export it (or re-run `kvexport convert`) with this version")


class _Slots:
    """Mixed into a step runner (OrtGenerator, TrtGenerator): its buffers become ``rows`` slots of batch 1.

    ``bank``: name -> (rows, ...) cache buffer; ``views[r]``: name -> the row view of slot r; ``states[r]``: its
    plan; ``rows_out``: the decode step's outputs for all rows (``logits`` (rows, V), ``k_new_i`` ...);
    ``chunk_rows``: one prefill chunk's new rows (batch 1; one chunk runs at a time)."""

    def __init__(self, *args, slots: int, decode: str = "auto", **kw):
        self._want_slots = int(slots)
        self._decode = decode
        super().__init__(*args, **kw)

    def _alloc(self) -> None:  # called by the runner's __init__ instead of its batch-B allocation
        from kvexport.cache.plan import CacheState

        s = self.settings
        if int(s["batch"]) != 1:
            raise BadArtifact(f"{self.path} was exported with --batch {s['batch']}; serving needs --batch 1 "
                              "(and --decode-batch N for batched decoding)")
        self._init_cache_layout()
        n_graph = s.get("decode_batch")
        self.batched = bool(self._decode != "rows" and n_graph and "decode_batch" in s["graphs"])
        self.rows = int(n_graph) if self.batched else self._want_slots
        self._ovs, self._persistent = {}, {}
        self.bank = {n: self._array((self.rows, *shape[1:]), dt, -1 if _kind(n) in ("positions", "query_positions")
                                    else 0) for n, (shape, dt) in self.shapes.items()}
        self.rows_out = {n: self._array((self.rows, *shape[1:]), dt) for n, (shape, dt) in self.step_shapes.items()}
        self.rows_out["logits"] = self._array((self.rows, int(s["vocab_size"])), self.dtype)
        C = int(s["chunk"])
        prefill_rows = set(s["graphs"]["prefill"]["outputs"])  # a lossy cache's prefill also returns kf_new_i ...
        shapes = {**self.step_shapes, **getattr(self, "full_shapes", {})}
        self.chunk_rows = {n: self._array((*shape[:2], C, *shape[3:]), dt) for n, (shape, dt) in shapes.items()
                           if n in prefill_rows}
        self.views = [{n: self._row(a, r) for n, a in self.bank.items()} for r in range(self.rows)]
        self.row_out = [{n: self._row(a, r) for n, a in self.rows_out.items()} for r in range(self.rows)]
        self.states = [CacheState(self.plan) for _ in range(self.rows)]
        self.staging = {}
        self.select(0)

    def _row(self, a, r: int):
        """Slot r's view of a (rows, ...) buffer; an empty buffer (an MLA cache's ``v_i``, value_dim 0) gets an empty
        buffer of its own, since a view of nothing cannot be bound in place."""
        return a[r:r + 1] if _nbytes(a) else self._array((1, *a.shape[1:]), _dtype(a))

    def select(self, r: int) -> None:
        """Point the runner's host writes (``self.cache``, ``self.state``) at slot ``r``."""
        self.cache, self.state = self.views[r], self.states[r]
        self.logits = self.rows_out["logits"][r:r + 1]

    def reset(self) -> None:
        for r in range(self.rows):
            self.select(r)
            self._reset_buffers()
            self.state.reset()
        self.select(0)
        self.compactions, self.step, self.last_logits = 0, 0, None


class _OrtSlots(_Slots, OrtGenerator):
    backend = "onnxruntime"


def _trt_slots():
    from kvexport.tensorrt.generator import TrtGenerator

    class _TrtSlots(_Slots, TrtGenerator):
        backend = "tensorrt"

    return _TrtSlots


class GraphSlots(SlotBackend):
    """:class:`SlotBackend` over an export directory.

    ``backend``: onnxruntime or tensorrt (``engines``: the TensorRT engine folder); ``max_sequences``: slots to
    admit (default: the export's ``decode_batch``, else 4; at most ``decode_batch`` when batching);
    ``decode``: "auto" (see the module docstring), "batched" (always the decode_batch graph) or "rows" (slot by slot
    even when the export has the batched graph); ``runtime_kw``: more arguments of the step runner (e.g.
    TrtGenerator's ``runner_factory``)."""

    def __init__(self, export_dir, backend: str = "onnxruntime", max_sequences: int | None = None,
                 threads: int | None = None, engines=None, decode: str = "auto", runtime_kw: dict | None = None):
        from kvexport.export.manifest import ONNX_EXPORT, verify_manifest

        if decode not in DECODE_MODES:
            raise BadUsage(f"decode {decode!r} is not one of: {', '.join(DECODE_MODES)}")
        if backend == "tensorrt":
            rt = _trt_slots()(export_dir, engines=engines, slots=max_sequences or 4, decode=decode,
                              **(runtime_kw or {}))
        else:
            s = verify_manifest(export_dir, ONNX_EXPORT)["settings"]
            if s["mode"] != "static":
                raise BadArtifact(f"{export_dir} is a growing-past (--dynamic-cache) export: its memory grows with "
                                  "each sequence; serve a static-cache export (--press P --budget B, or --press none)")
            # the slots decode through decode.onnx / decode_batch.onnx (an in-place graph, if the export has one,
            # is batch 1 over OrtGenerator's own buffers: not opened)
            rt = _OrtSlots(export_dir, threads=threads, slots=max_sequences or s.get("decode_batch") or 4,
                           decode=decode, **{"inplace": False, **(runtime_kw or {})})
        check_feeds(rt)
        if decode == "batched" and not rt.batched:
            raise BadUsage(f"--decode batched needs a decode_batch graph; {export_dir} has none (export it with "
                           "--batch 1 --decode-batch N), or serve it with --decode rows")
        self.rt, self.name, self.settings = rt, backend, rt.settings
        if rt.batched and max_sequences is not None and int(max_sequences) > rt.rows:
            raise BadUsage(f"--max-sequences {max_sequences} exceeds the export's decode batch ({rt.rows}); "
                           f"re-export with --decode-batch {max_sequences} or serve at most {rt.rows}")
        if max_sequences is not None and int(max_sequences) < 1:
            raise BadUsage(f"--max-sequences {max_sequences} must be >= 1")
        self.n_slots = int(max_sequences or rt.rows)
        self.vocab_size = int(self.settings["vocab_size"])
        self.evicting = rt.press is not None
        self.limit = int(self.settings["max_positions"]) if self.evicting else min(rt.plan.capacities)
        self._chunks: list[deque] = [deque() for _ in range(rt.rows)]
        self._prompt: list[tuple[np.ndarray, np.ndarray] | None] = [None] * rt.rows
        self._next = np.zeros(rt.rows, np.int64)  # position of each slot's next token (plan rule 1)
        self._steps = [0] * rt.rows
        #: decode through the batched graph when at least this many slots decode (rows only: never)
        self.batch_from = (1 if decode == "batched" else self.calibrate()) if rt.batched else None

    def calibrate(self, repeats: int = 7) -> int:
        """Time one batched decode call and one batch-1 call (median of ``repeats``, on empty slots: nothing is
        written) -> the number of active slots from which the batched call is the faster."""
        import math
        import time

        rt = self.rt
        zeros = np.zeros((rt.rows, 1), np.int64)
        arrays = {n: rt.bank[n] for n in rt._io_plan("decode_batch")[0]}

        def batched():
            rt._call("decode_batch", rt._feeds("decode_batch", input_ids=zeros, positions=zeros), arrays, rt.rows_out,
                     persistent=True)

        def one():
            rt.select(0)
            rt._call("decode", rt._feeds("decode", input_ids=zeros[:1], positions=zeros[:1]), rt._cache_inputs("decode"),
                     rt.row_out[0])

        def median(fn) -> float:
            times = []
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return sorted(times[2:])[repeats // 2]

        self.timings = {"decode_batch_s": median(batched), "decode_s": median(one)}
        return max(1, min(rt.rows, math.ceil(self.timings["decode_batch_s"] / self.timings["decode_s"])))

    def describe(self) -> str:
        """How decode steps run, in words (the server's start line)."""
        if not self.rt.batched:
            return "decode slot by slot"
        t = getattr(self, "timings", None)
        times = (f" (decode_batch {t['decode_batch_s'] * 1e3:.2f} ms for {self.rt.rows} rows, decode "
                 f"{t['decode_s'] * 1e3:.2f} ms per slot)") if t else ""
        return f"decode_batch for >= {self.batch_from} decoding sequences, else slot by slot{times}"

    # ------------------------------------------------------------------ prefill
    def start(self, slot: int, prompt: list[int]) -> int:
        rt = self.rt
        rt.select(slot)
        rt._reset_buffers()
        rt.state.reset()
        ids = np.asarray(prompt, np.int64)[None]  # (1, n)
        rt.plan.check_fits(ids.shape[1])
        pos = positions_from_mask(np.ones_like(ids))
        self._prompt[slot] = (ids, pos)
        self._chunks[slot] = deque(enumerate(rt.plan.chunks(ids.shape[1])))
        self._next[slot] = int(pos.max()) + 1
        self._steps[slot] = 0
        return len(self._chunks[slot])

    def prefill_step(self, slot: int) -> np.ndarray | None:
        rt = self.rt
        rt.select(slot)
        ids, pos = self._prompt[slot]
        index, chunk = self._chunks[slot].popleft()
        step = rt.state.prefill(chunk.n_real)
        pad = chunk.pad
        c_ids = np.concatenate([np.zeros((1, pad), np.int64), ids[:, chunk.start:chunk.stop]], axis=1)
        c_pos = np.concatenate([np.full((1, pad), -1, np.int64), pos[:, chunk.start:chunk.stop]], axis=1)
        rows = rt._call("prefill", rt._feeds("prefill", input_ids=c_ids, positions=c_pos),
                        rt._cache_inputs("prefill"), {**rt.chunk_rows, "logits": rt.logits})
        if step.any_compaction:
            kept = rt._call("compact_prefill", rt._feeds("compact_prefill", fill=np.array(step.fills, np.int64),
                                                         n_pad=np.array([pad], np.int64), positions=c_pos),
                            rt._cache_inputs("compact_prefill", rows), {})
            rt._write_kept(kept)
            self._compacted(slot, f"prefill:{index}")
        else:
            for i, f in enumerate(step.fills):
                rt._write_rows(rows, i, f, c_pos, first=pad)
        if self._chunks[slot]:
            return None
        self._prompt[slot] = None
        return _to_numpy(rt.logits)[0].copy()

    # ------------------------------------------------------------------ decode
    def decode(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        rt = self.rt
        steps = {}
        for r in slots:  # the plan first: a full press-free cache refuses before any graph runs
            rt.select(r)
            steps[r] = rt.state.decode()
        if rt.batched and len(slots) >= self.batch_from:
            ids = np.zeros((rt.rows, 1), np.int64)  # rows not decoding: token 0 at position 0, outputs ignored
            pos = np.zeros((rt.rows, 1), np.int64)
            ids[slots, 0] = tokens
            pos[slots, 0] = self._next[slots]
            arrays = {n: rt.bank[n] for n in rt._io_plan("decode_batch")[0]}
            rt._call("decode_batch", rt._feeds("decode_batch", input_ids=ids, positions=pos), arrays, rt.rows_out,
                     persistent=True)
            logits = _to_numpy(rt.rows_out["logits"])[slots].copy()
            for r in slots:
                self._write_step(r, steps[r], rt.row_out[r])
            return logits
        out = np.empty((len(slots), self.vocab_size), np.float32)
        for j, (r, tok) in enumerate(zip(slots, tokens, strict=True)):
            rt.select(r)
            rows = rt.row_out[r]
            rt._call("decode", rt._feeds("decode", input_ids=np.array([[tok]], np.int64),
                                         positions=self._next[r:r + 1, None].copy()), rt._cache_inputs("decode"), rows)
            out[j] = _to_numpy(rows["logits"])[0]
            self._write_step(r, steps[r], rows)
        return out

    def _write_step(self, r: int, step, rows: dict) -> None:
        """Slot r's new rows where its DecodeStep says, its query into the ring, then its compaction if due."""
        rt = self.rt
        rt.select(r)
        pos = self._next[r:r + 1, None].copy()  # (1, 1)
        if rt.apply_decode(step, rows, pos):  # the runtime's own host step, on slot r's row views
            self._compacted(r, f"decode:{self._steps[r]}")
        self._steps[r] += 1
        self._next[r] += 1

    def _compacted(self, slot: int, where: str) -> None:
        if self.on_compaction is not None:
            self.on_compaction(slot, where)

    # ------------------------------------------------------------------ accounting
    def release(self, slot: int) -> None:
        self._prompt[slot] = None
        self._chunks[slot].clear()

    def kept_positions(self, slot: int) -> list[np.ndarray]:
        return [_to_numpy(self.rt.views[slot][f"pos_{i}"]).copy() for i in range(len(self.rt.layers))]

    def resident_bytes(self) -> dict:
        """Per slot (one row of every cache buffer) and shared (the decode step's rows and logits for all rows,
        one prefill chunk's rows), read from the allocated buffers."""
        rt = self.rt
        per = dict.fromkeys(PER_SLOT, 0)
        for n, a in rt.views[0].items():  # (and "scales" of an int8 / fp8 cache)
            per[_kind(n)] = per.get(_kind(n), 0) + _nbytes(a)
        per["total"] = sum(per.values())
        shared = {"step_outputs": sum(_nbytes(a) for n, a in rt.rows_out.items() if n != "logits"),
                  "logits": _nbytes(rt.rows_out["logits"]), "staging": sum(_nbytes(a) for a in rt.chunk_rows.values())}
        shared["total"] = sum(shared.values())
        total = sum(_nbytes(a) for a in rt.bank.values()) + shared["total"]
        return {"per_slot": per, "slots": rt.rows, "shared": shared, "total": total}

    def close(self) -> None:
        close = getattr(self.rt, "close", None)
        if close is not None:
            close()


__all__ = ["GraphSlots"]
