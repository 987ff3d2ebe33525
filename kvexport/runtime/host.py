# SPDX-License-Identifier: Apache-2.0
"""The one host of an export's static caches, for every graph runtime (onnxruntime, TensorRT).

The graphs read the cache and return only what is new (kvexport.export.graphs); the host keeps the cache buffers
and writes into them what the plan's :class:`~kvexport.cache.plan.CacheState` says: a chunk's rows at ``fill`` or a
compaction's kept rows into slots [0, budget), a decode step's rows at its slot and its query into the ring, the
decode-time compaction when it is due. Where the buffers live and how a graph is called is the backend's
(``graphs``): :class:`kvexport.runtime.onnxruntime.OrtSessions` or :class:`kvexport.tensorrt.generator.TrtEngines`.

Buffers of one layer i (``Hc`` cache heads; names as the graphs' inputs)::

    k_i (B, Hc, cap_i, Dk)   v_i (B, Hc, cap_i, Dv)   pos_i (B, Hc, cap_i) int64, -1 = empty
    ks_i, vs_i (B, Hc, cap_i) float16                 scales of a quantized format
    qbuf_i (B, Hq, W, Dq)    and one qpos (B, W)      the press's query ring

A host holds its buffers once: memory is fixed whatever the number of steps. A full-cache export with a dynamic
capacity axis (``dynamic_capacity``) is held in a bucket of :meth:`~kvexport.cache.plan.CachePlan.slots_for` slots
(plan rule 7): a prompt gets the bucket of its length, a token that does not fit doubles it (the filled slots copied
once, the graphs bound again), so a step reads O(filled) bytes, not the export's capacity. An evicting cache with
``read_buckets`` (plan rule 7b) is held the same way while its bucket is at most half the capacity, chunk by chunk
and step by step (grown after a call, before the host writes its rows; to the capacity before a compaction), so a
prompt's first chunks and a short sequence's steps read what is filled from buffers bound once (a per-call copy of
the bucket was 2.8 of SmolLM2's 38 ms per step at 512 tokens, 2026-12-07); else it holds its capacity. A bank's
slots (row views, :mod:`kvexport.runtime.slots`) cannot move: a call is handed a copy of the bucket of the fullest
decoding row, for that call only.

Rows: the host is a step driver (:mod:`kvexport.runtime.protocol`) over the export's batch; the server's bank of
batch-1 slots, each with its own plan state, is the same host over rows of one bank (:mod:`kvexport.runtime.slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvexport.cache.formats import kv_format, layer_fields, storage_numpy
from kvexport.cache.memory import kind_of, measure, nbytes
from kvexport.cache.plan import CachePlan, CacheState, Chunk
from kvexport.errors import BadArtifact, BadUsage
from kvexport.runtime.protocol import Driver

#: the model dtypes of an export and their NumPy types
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}
#: the host inputs each graph may declare (a graph wanting another one was made by another kvexport version)
FEEDS = {"prefill": {"input_ids", "positions"}, "prefill_last": {"input_ids", "positions"},
         "decode": {"input_ids", "positions"},
         "decode_batch": {"input_ids", "positions"}, "compact_prefill": {"fill", "n_pad", "positions"},
         "compact_prefill_tail": {"fill", "n_pad", "positions", "tail_positions"},
         "compact": {"fill", "query_start"}, "decode_inplace": {"input_ids", "positions", "slots"}}


#: the kinds of cache buffer with a slot axis (axis 2), which buckets size
SLOTTED = ("kv", "scales", "positions")


@dataclass
class Rows:
    """Rows of the host that share one plan state: the export's whole batch, or one server slot (row views of the
    bank). ``persistent``: its buffers never move, so a decode call binds them once."""

    cache: dict  # name -> buffer (or a row view of the bank)
    step_out: dict  # the decode step's outputs (logits and new rows), by name
    state: CacheState
    staging: dict = field(default_factory=dict)  # a prefill chunk's rows
    persistent: bool = True
    shared_staging: bool = False  # staging belongs to the host (slots), not to one prompt
    movable: bool = True  # its buffers may be replaced by a larger bucket (not a slot's row views)
    columns: int = 0  # the current prompt's columns

    @property
    def logits(self):
        return self.step_out["logits"]


class GraphHost(Driver):
    """The static caches of an export over ``graphs`` (a backend: ``settings``, ``array``, ``to_device``, ``call``,
    ``bound``, ``forget``, ``close``), one batch of the export's size: a step driver itself. The server's bank of
    batch-1 slots is :class:`kvexport.runtime.slots.SlotBank`."""

    def __init__(self, graphs):
        self._setup(graphs)
        s = self.settings
        self.batch = int(s["batch"])
        cache = self._cache_buffers(self.plan.slots_for(0) if self.plan.held_in_buckets else None)
        # the in-place decode graph writes the token's k / v into the cache itself: only its query is an output
        out = {n: self._array(shape, dt) for n, (shape, dt) in self.step_shapes.items()
               if not (self.inplace and not n.startswith("q_"))}
        out["logits"] = self._array((self.batch, int(s["vocab_size"])), self.dtype)
        self.rows = Rows(cache, out, CacheState(self.plan))

    def _setup(self, graphs) -> None:
        """What every host reads from its export: settings, plan, cache format, the buffers' layout."""
        self.graphs = graphs
        self.path, self.manifest, self.settings = graphs.path, graphs.manifest, graphs.settings
        s = self.settings
        self.providers = graphs.providers
        self.device = graphs.device
        self.dtype = NP_DTYPES[s["dtype"]]
        self.press = s["press"]
        self.dynamic = False
        self.layers = s["graphs"]["layers"]
        self.plan = CachePlan.from_settings(s)
        self.kv_format = kv_format(s.get("kv_dtype"), s["dtype"])
        self.inplace = bool(getattr(graphs, "inplace", False))
        self._layout()
        self._io_plans: dict[str, tuple] = {}
        self._check_feeds()

    # ------------------------------------------------------------------ layout
    def _layout(self) -> None:
        """``shapes``: name -> (shape, dtype) of every cache buffer; ``step_shapes``: a decode step's new rows
        (``k_new_i`` (B, Hc, 1, Dk), ``v_new_i``, scales, ``q_new_i`` (B, Hq, 1, Dq)); ``full_shapes``: a lossy
        cache's prefill rows before storage; ``fields``: per layer its cache tensors."""
        s = self.settings
        B, W = int(s["batch"]), int(s["window"])
        store = storage_numpy(self.kv_format)
        self.shapes: dict[str, tuple[tuple[int, ...], type]] = {}
        self.step_shapes: dict[str, tuple[tuple[int, ...], type]] = {}
        self.full_shapes: dict[str, tuple[tuple[int, ...], type]] = {}
        self.fields: list[tuple[str, ...]] = []
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
        self._ring = [(f"qbuf_{i}", f"q_new_{i}") for i in range(len(self.layers))]

    def _chunk_shapes(self) -> dict:
        """The prefill graph's row outputs for one chunk of C columns (a lossy cache's also kf_new_i ...), and with
        a lookahead its tail's queries ``q_tail_i`` (B, Hq, L, Dq)."""
        C, L = int(self.settings["chunk"]), int(self.plan.lookahead)
        wanted = set(self.settings["graphs"]["prefill"]["outputs"])
        out = {n: ((*shape[:2], C, *shape[3:]), dt) for n, (shape, dt) in {**self.step_shapes,
                                                                           **self.full_shapes}.items() if n in wanted}
        for i in range(len(self.layers) if L else 0):
            shape, dt = self.step_shapes[f"q_new_{i}"]
            out[f"q_tail_{i}"] = ((*shape[:2], L, *shape[3:]), dt)
        return out

    def _io_plan(self, graph: str) -> tuple[list[str], list[str], frozenset[str]]:
        """What a call of ``graph`` binds, worked out once per graph: its array inputs (cache buffers or new rows),
        its outputs, and its host inputs."""
        plan = self._io_plans.get(graph)
        if plan is None:
            g = self.settings["graphs"][graph]
            arrays = [n for n in g["inputs"] if n in self.shapes or "_new_" in n or n.startswith("q_tail_")]
            host = frozenset(n for n in g["inputs"] if n not in arrays)
            plan = self._io_plans[graph] = (arrays, list(g["outputs"]), host)
        return plan

    def _check_feeds(self) -> None:
        """Refuse an export whose graphs want host inputs this version does not give (made by another version)."""
        for graph, known in FEEDS.items():
            if isinstance(self.settings["graphs"].get(graph), dict) and "inputs" in self.settings["graphs"][graph]:
                missing = sorted(self._io_plan(graph)[2] - known)
                if missing:
                    raise BadArtifact(f"{self.path}/{graph}.onnx wants inputs {missing} this kvexport version does "
                                      "not give; re-export it (or re-run `kvexport convert`) with this version")

    def _feeds(self, graph: str, **candidates: np.ndarray) -> dict[str, np.ndarray]:
        """The host inputs ``graph`` declares, out of ``candidates`` (buffers are bound separately)."""
        return {k: v for k, v in candidates.items() if k in self._io_plan(graph)[2]}

    def _inputs(self, rows: Rows, graph: str, extra: dict | None = None) -> dict:
        names = self._io_plan(graph)[0]
        pool = {**rows.cache, **(extra or {})}
        return {n: pool[n] for n in names}

    @staticmethod
    def _empty(name: str) -> int:
        """What an empty buffer holds: position -1, zeros elsewhere."""
        return -1 if kind_of(name) in ("positions", "query_positions") else 0

    def _array(self, shape, dtype, fill=0):
        return self.graphs.array(shape, dtype, fill)

    def _row(self, a, r: int):
        """Slot r's view of a (rows, ...) bank buffer; an empty buffer (an MLA cache's ``v_i``, value_dim 0) gets an
        empty buffer of its own, since a view of nothing cannot be bound in place."""
        if nbytes(a):
            return a[r:r + 1]
        dtype = a.dtype.type if isinstance(a, np.ndarray) else a.dtype
        return self._array((1, *a.shape[1:]), dtype)

    def _cache_buffers(self, slots: int | None) -> dict:
        """Fresh cache buffers (empty: positions -1) of ``slots`` slots per layer (a bucket), or None: the export's
        capacities (``self.shapes``, also the most a bucket grows to)."""
        out = {}
        for n, (shape, dt) in self.shapes.items():
            if slots is not None and kind_of(n) in SLOTTED:
                shape = (*shape[:2], slots, *shape[3:])
            out[n] = self._array(shape, dt, self._empty(n))
        return out

    def _fit(self, rows: Rows, n: int, shrink: bool = False) -> None:
        """Plan rules 7 and 7b: hold the bucket of ``n`` tokens. A larger bucket gets the filled slots copied once
        and the graphs are bound to it again; ``shrink`` (a new prompt, nothing filled) also takes a smaller one. A
        no-op for caches held at their capacity, for a bank's slots and for buffers already larger."""
        if not self.plan.held_in_buckets or not rows.movable:
            return
        want, have = self.plan.slots_for(n), int(rows.cache["pos_0"].shape[2])
        if want == have or (want < have and not shrink):
            return
        fill = min(max(rows.state.fills), have, want)  # the slots written so far
        # the slot buffers in the new bucket, their filled slots copied; the press's query ring is kept as it is
        grown = {n: a for n, a in self._cache_buffers(want).items() if kind_of(n) in SLOTTED}
        if fill:
            for name, arr in grown.items():
                arr[:, :, :fill] = rows.cache[name][:, :, :fill]
        self.graphs.forget([rows.cache[n] for n in grown], unbind=True)  # the bindings wrap the old buffers
        rows.cache.update(grown)

    def _reserved(self, n: int, reserve: int | None) -> int:
        """The tokens a new prompt of ``n`` tokens holds a bucket for: the sequence's known length ``reserve`` when
        its bucket is at most twice the prompt's (a step then still reads at most twice the filled slots)."""
        if not self.plan.bucketed or not reserve or reserve <= n:
            return n
        total = min(int(reserve), max(self.plan.capacities))
        return total if self.plan.slots_for(total) <= 2 * n else n

    # ------------------------------------------------------------------ the writes the plan asks for
    def _write_rows(self, rows: Rows, new: dict, i: int, slot: int, positions, first: int = 0) -> None:
        """Layer i: new rows [first, T) of ``new`` (k_new_i, v_new_i (B, Hc, T, .), and the scales ks_new_i,
        vs_new_i (B, Hc, T) of a quantized cache) into slots [slot, ...), their positions (B, T) alike."""
        n = new[f"k_new_{i}"].shape[2] - first
        cache = rows.cache
        for f in self.fields[i]:
            if f != "pos":
                cache[f"{f}_{i}"][:, :, slot : slot + n] = new[f"{f}_new_{i}"][:, :, first:]
        cache[f"pos_{i}"][:, :, slot : slot + n] = self.graphs.to_device(np.asarray(positions)[:, None, first:])

    def _write_kept(self, rows: Rows, kept: dict) -> None:
        """A compaction's output: the best budget_i rows (and their scales) into slots [0, budget_i), the rest of
        the layer emptied."""
        cache = rows.cache
        for i, b in enumerate(self.plan.budgets):
            for f in self.fields[i]:
                cache[f"{f}_{i}"][:, :, :b] = kept[f"kept_{f}_{i}"]
            cache[f"pos_{i}"][:, :, b:] = -1

    def _apply_decode(self, rows: Rows, step, new: dict, pos: np.ndarray, written: bool = False) -> bool:
        """What the plan's DecodeStep ``step`` asks once the decode graph has run (every row of ``rows`` the same
        step): :meth:`_store_decoded`, then :meth:`_compact_if_due`; ``pos`` (B, 1) the token's positions."""
        self._store_decoded(rows.cache, new, slice(None), step.slots, step.query_slot, pos[:, 0], written)
        return self._compact_if_due(rows, step)

    def _store_decoded(self, cache: dict, new: dict, rsel, slots, query, pos, written: bool = False) -> None:
        """Rule 4's writes after a decode graph, for the rows ``rsel`` of ``cache`` and ``new`` (``slice(None)``:
        all of them, or an index array): layer i's new row (``k_new_i``, ``v_new_i`` (B, Hc, 1, .) and a quantized
        cache's scales) into slot ``slots[i]`` and its position beside it (unless ``written``: the in-place graph
        wrote both), and with a press the token's query into ring slot ``query``. ``slots[i]`` and ``query`` are an
        int (every row the same) or an index array (one per row of ``rsel``: a bank's slots, each at its own fill);
        ``pos`` (rows,) the token's positions. One assignment per buffer, whatever the number of rows."""
        p = self.graphs.to_device(np.asarray(pos, np.int64).reshape(-1, 1))
        if not written:
            for i, slot in enumerate(slots):
                for f in self.fields[i]:
                    if f != "pos":
                        cache[f"{f}_{i}"][rsel, :, slot] = new[f"{f}_new_{i}"][rsel, :, 0]
                cache[f"pos_{i}"][rsel, :, slot] = p
        if self.press is not None:
            for ring, name in self._ring:
                cache[ring][rsel, :, query] = new[name][rsel, :, 0]
            cache["qpos"][rsel, query] = p[:, 0]

    def _compact_if_due(self, rows: Rows, step) -> bool:
        """The compaction the plan's DecodeStep ``step`` asks for, if it does (the ``compact`` graph, kept rows into
        slots [0, budget)). -> whether it compacted."""
        if not step.compact:
            return False
        self._fit(rows, min(self.plan.capacities))  # a compaction reads the capacity (a no-op once decoding there)
        start = rows.state.query_start
        fills = rows.state.compact()
        kept = self.graphs.call("compact", self._feeds("compact", fill=np.array(fills, np.int64),
                                                       query_start=np.array([start], np.int64)),
                                self._inputs(rows, "compact"), {})
        self._write_kept(rows, kept)
        return True

    def _logits(self, rows: Rows) -> np.ndarray:
        x = rows.logits
        return (x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)).copy()

    # ------------------------------------------------------------------ steps on rows
    def _start(self, rows: Rows, mask: np.ndarray, new_tokens: int | None) -> None:
        N = mask.shape[1]
        self._reset(rows)
        self.plan.check_fits(N)
        # a full cache holds the prompt's bucket at once; an evicting one read in buckets grows chunk by chunk
        hold = self._reserved(N, None if new_tokens is None else N + int(new_tokens) - 1) if self.plan.bucketed else 0
        self._fit(rows, hold, shrink=True)
        rows.columns = N
        if not rows.shared_staging:
            self._drop_staging(rows)
            rows.staging = {n: self._array(shape, dt) for n, (shape, dt) in self._chunk_shapes().items()}

    def _drop_staging(self, rows: Rows) -> None:
        """A prompt's chunk buffers are its own: freed (with their bindings) once it is fed."""
        if rows.staging and not rows.shared_staging:
            self.graphs.forget(rows.staging.values())
            rows.staging = {}

    def _reset(self, rows: Rows) -> None:
        """A new sequence only needs every position -1 (k/v of an empty slot are never read)."""
        for n, arr in rows.cache.items():
            if kind_of(n) in ("positions", "query_positions"):
                arr[...] = -1
        rows.state.reset()

    def _prefill_chunk(self, rows: Rows, ids: np.ndarray, pos: np.ndarray, chunk: Chunk,
                       tail=None) -> tuple[np.ndarray, bool]:
        """Rule 3 on one chunk: the prefill graph, then its real columns written at ``fill``, or ``compact_prefill``
        where a layer overflows its budget. With a lookahead (rule 3b) the graph takes the chunk and its ``tail``
        (ids, positions (B, L), front-padded; the prompt's last chunk gets a tail of padding), and a compaction the
        tail observes runs ``compact_prefill_tail``. The prompt's last chunk, which has no tail, runs
        ``prefill_last`` (the same chunk without tail columns) where the export has it."""
        L = int(self.plan.lookahead)
        if tail is not None and not L:
            raise BadUsage("this export's graphs take no lookahead tail (kvexport.cache.plan rule 3b): export it "
                           "with --lookahead")
        step = rows.state.prefill(chunk.n_real)
        feed_ids, feed_pos, graph = ids, pos, "prefill"
        if L and tail is None and "prefill_last" in self.settings["graphs"]:
            graph = "prefill_last"  # the prompt's last chunk: no tail to compute
        elif L:
            B = ids.shape[0]
            t_ids, t_pos = tail if tail is not None else (np.zeros((B, L), np.int64), np.full((B, L), -1, np.int64))
            feed_ids, feed_pos = np.concatenate([ids, t_ids], 1), np.concatenate([pos, t_pos], 1)
        outputs, first = {**rows.staging, "logits": rows.logits}, chunk.pad
        if self.plan.ragged(chunk, rows.columns, step) and graph == self.settings.get("ragged_last"):
            # rule 2b: the real columns only, into rows of their width (held for this chunk)
            feed_ids, feed_pos, first = ids[:, chunk.pad:], pos[:, chunk.pad:], 0
            wanted = set(self.settings["graphs"][graph]["outputs"])
            outputs = {n: self._array((*shape[:2], chunk.n_real, *shape[3:]), dt)
                       for n, (shape, dt) in self._chunk_shapes().items() if n in wanted}
            outputs["logits"] = rows.logits
        arrays = self._inputs(rows, graph)
        head = self._read_head(rows, arrays, step.fills)
        new = self.graphs.call(graph, self._feeds(graph, input_ids=feed_ids, positions=feed_pos),
                               {**arrays, **head}, outputs)
        self.graphs.forget(head.values())
        if first != chunk.pad:
            self.graphs.forget(v for n, v in outputs.items() if n != "logits")
        # the buffers hold the chunk's rows (rule 7b), or the capacity a compaction reads
        self._fit(rows, min(self.plan.capacities) if step.any_compaction else max(step.fills) + chunk.n_real)
        if step.any_compaction:
            graph = "compact_prefill_tail" if tail is not None else "compact_prefill"
            kept = self.graphs.call(graph,
                                    self._feeds(graph, fill=np.array(step.fills, np.int64),
                                                n_pad=np.array([chunk.pad], np.int64), positions=pos,
                                                tail_positions=None if tail is None else tail[1]),
                                    self._inputs(rows, graph, new), {})
            self._write_kept(rows, kept)
        else:
            for i, f in enumerate(step.fills):
                self._write_rows(rows, new, i, f, pos if first == chunk.pad else pos[:, chunk.pad:], first=first)
        if chunk.stop >= rows.columns:
            self._drop_staging(rows)
        return self._logits(rows), step.any_compaction

    def _read_head(self, rows: Rows, arrays: dict, fills) -> dict:
        """What a reading call is handed beside ``arrays`` under plan rule 7b when the rows hold ``fills`` before
        it: nothing when their buffers are held in their bucket (:meth:`_fit`: they are read whole), else
        :meth:`_head_slots` of the bucket (a bank's slots)."""
        if rows.movable and self.plan.read_buckets:
            return {}
        return self._head_slots(arrays, self.plan.read_slots(fills))

    def _head_slots(self, arrays: dict, slots: int | None) -> dict:
        """Plan rule 7b: the first ``slots`` slots of every cache buffer in ``arrays`` that holds more, as contiguous
        copies (a graph binds contiguous buffers), held for one call. Empty when ``slots`` is None (the whole
        capacity) or every buffer is that size."""
        out = {}
        for n, a in arrays.items() if slots is not None else ():
            if kind_of(n) not in SLOTTED or a.shape[2] <= slots:
                continue
            part = a[:, :, :slots]
            if not nbytes(a):  # an MLA cache's empty v_i: a buffer of its own (a view of nothing cannot be bound)
                out[n] = self._array(tuple(part.shape), a.dtype.type if isinstance(a, np.ndarray) else a.dtype)
            else:
                out[n] = part.contiguous() if hasattr(part, "contiguous") else np.ascontiguousarray(part)
        return out

    def _decode(self, rows: Rows, tokens: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, bool]:
        """Rule 4: the decode graph, the host writes where the plan says, the compaction if due."""
        step = rows.state.decode()
        tok, pos = tokens[:, None], positions[:, None]
        if self.inplace:  # the graph writes the token's rows: its slot must be held before the call
            self._fit(rows, max(step.slots) + 1)
            new = self._decode_in_place(rows, step, tok, pos)
        else:
            arrays = self._inputs(rows, "decode")
            head = self._read_head(rows, arrays, step.slots)  # rule 7b: a short sequence's step reads its bucket
            new = self.graphs.call("decode", self._feeds("decode", input_ids=tok, positions=pos), {**arrays, **head},
                                   rows.step_out, persistent=rows.persistent and not head)
            self.graphs.forget(head.values())
            self._fit(rows, max(step.slots) + 1)  # the host writes the token's rows: their slots held from now on
        logits = self._logits(rows)
        return logits, self._apply_decode(rows, step, new, pos, written=self.inplace)

    def _decode_in_place(self, rows: Rows, step, tok: np.ndarray, pos: np.ndarray) -> dict:
        """The in-place decode graph (onnxruntime's GroupQueryAttention on the CPU): the token's positions into their
        slots first (its attention reads them), then one call whose ``k_present_i`` / ``v_present_i`` outputs are
        bound to the cache buffers its ``k_i`` / ``v_i`` inputs read, so only the token's slot is written (``slots`` =
        the plan's). -> the step's outputs (logits, queries)."""
        cache = rows.cache
        for i, slot in enumerate(step.slots):
            cache[f"pos_{i}"][:, :, slot] = pos
        slots = np.repeat(np.asarray(step.slots, np.int32)[:, None], self.batch, axis=1)
        feeds = {"input_ids": tok, "positions": pos, "slots": slots}
        if self.graphs.bound("decode_inplace"):  # bound already: only the host inputs change
            return self.graphs.call("decode_inplace", feeds, {}, rows.step_out, persistent=True)
        outputs = {**rows.step_out, **{o: cache[c] for o, c in
                                       self.settings["graphs"]["decode_inplace"]["in_place"].items()}}
        self.graphs.call("decode_inplace", self._feeds("decode_inplace", **feeds), self._inputs(rows, "decode_inplace"),
                         outputs, persistent=True)
        return rows.step_out

    def _kept_positions(self, rows: Rows) -> list[np.ndarray]:
        out = []
        for i in range(len(self.layers)):
            p = rows.cache[f"pos_{i}"]
            out.append((p.detach().cpu().numpy() if hasattr(p, "detach") else np.asarray(p)).copy())
        return out

    # ------------------------------------------------------------------ the step driver of the whole batch
    def start(self, mask: np.ndarray, new_tokens: int | None) -> None:
        self._start(self.rows, mask, new_tokens)

    def prefill_chunk(self, ids, positions, chunk: Chunk, tail=None):
        return self._prefill_chunk(self.rows, ids, positions, chunk, tail)

    def decode(self, tokens, positions):
        return self._decode(self.rows, tokens, positions)

    def kept_positions(self) -> list[np.ndarray]:
        """Per layer: the positions (B, Hc, slots held) every slot holds now, -1 = empty (copies)."""
        return self._kept_positions(self.rows)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this host holds for its batch, read from its own buffers (:func:`kvexport.cache.memory.measure`):
        the cache (``kv``: K/V or latents, codes for int8 / fp8; ``scales``; ``positions``; the ring's ``queries``
        and ``query_positions``), the decode step's outputs (``step_outputs``, ``logits``), a prefill chunk's rows
        (``staging``, only while a prompt is fed) and ``total``. The formula they are held to:
        :meth:`kvexport.cache.memory.CacheShape.resident_bytes_at` (``in_place=True`` when decode runs the in-place
        graph)."""
        return measure({**self.rows.cache, **self.rows.step_out}, self.rows.staging.values())

    def synthesize(self, context: int, rng: np.random.Generator) -> np.ndarray:
        """Put the cache in the state a ``context``-token prompt leaves (a benchmark's decode cost without its
        prefill): each layer holds min(budget, context) random K/V rows at sorted random positions < context
        (positions 0..context-1 for a full cache), the plan's fills set to match. -> the rows' next positions (B,).
        A quantized cache's codes and scales stay as they are (their cost does not depend on their values)."""
        rows = self.rows
        self._reset(rows)
        fills = []
        for i, b in enumerate(self.plan.budgets):
            n = min(int(b), int(context))
            self._fit(rows, n)
            keep = np.sort(rng.choice(context, size=n, replace=False)) if self.press is not None else np.arange(n)
            for name in (f"k_{i}", f"v_{i}"):
                arr = rows.cache[name]
                if np.issubdtype(np.dtype(self.shapes[name][1]), np.floating) and nbytes(arr):
                    arr[:, :, :n] = self.graphs.to_device(rng.standard_normal(tuple(arr[:, :, :n].shape)).astype(
                        self.shapes[name][1]))
            rows.cache[f"pos_{i}"][:, :, :n] = self.graphs.to_device(keep)
            fills.append(n)
        rows.state.load(fills)
        return np.full(self.batch, int(context), np.int64)

    @property
    def state(self) -> CacheState:
        return self.rows.state

    @property
    def cache(self) -> dict:
        return self.rows.cache

    @property
    def step_out(self) -> dict:
        return self.rows.step_out

    @property
    def staging(self) -> dict:
        """A prefill chunk's rows: held only while a prompt is fed."""
        return self.rows.staging

    @property
    def decode_graph(self) -> str:
        """The graph one decode step runs: ``decode_inplace`` (in place) or ``decode``."""
        return "decode_inplace" if self.inplace else "decode"

    def reset(self) -> None:
        """Empty every cache buffer and the plan's bookkeeping."""
        self._reset(self.rows)

    def close(self) -> None:
        self.graphs.close()


__all__ = ["GraphHost", "Rows", "NP_DTYPES", "FEEDS"]
