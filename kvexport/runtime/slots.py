# SPDX-License-Identifier: Apache-2.0
"""The server's slots: one host (:class:`~kvexport.runtime.host.GraphHost`) over a bank of N batch-1 rows of a
``--batch 1`` export. Every cache buffer is allocated once for all N rows as one (N, ...) array; slot r is the
contiguous row view ``arr[r:r+1]`` with its own plan state, a batch-1 step driver (:meth:`SlotBank.slot`) whose
prefill chunks, decode steps and compactions are the host's own steps on its rows. Decoding slots step together
through ``decode_batch.onnx`` (:meth:`SlotBank.decode_slots`, each row at its own position; rows not decoding get
token 0 at position 0 and their outputs are ignored) or one by one with the batch-1 ``decode`` graph.
"""

from __future__ import annotations

import numpy as np

from kvexport.cache.memory import measure
from kvexport.cache.plan import CachePlan, CacheState
from kvexport.errors import BadArtifact
from kvexport.runtime.host import GraphHost, Rows
from kvexport.runtime.protocol import Driver


class SlotBank(GraphHost):
    """``slots`` batch-1 slots over ``graphs`` (a host backend); ``batched``: decode them together through the
    export's ``decode_batch`` graph when it has one (the bank then has its rows)."""

    def __init__(self, graphs, slots: int, batched: bool = True):
        self._setup(graphs)
        s = self.settings
        if int(s["batch"]) != 1:
            raise BadArtifact(f"{self.path} was exported with --batch {s['batch']}; serving needs --batch 1 "
                              "(and --decode-batch N for batched decoding)")
        self.batch = 1
        n_graph = s.get("decode_batch")
        self.batched = bool(batched and n_graph and "decode_batch" in s["graphs"])
        self.batch_from = 1  # decode through the batched graph from this many decoding slots (the server sets it)
        R = int(n_graph) if self.batched else int(slots)
        V = int(s["vocab_size"])
        self.bank = {n: self._array((R, *shape[1:]), dt, self._empty(n)) for n, (shape, dt) in self.shapes.items()}
        self.bank_out = {n: self._array((R, *shape[1:]), dt) for n, (shape, dt) in self.step_shapes.items()}
        self.bank_out["logits"] = self._array((R, V), self.dtype)
        staging = {n: self._array(shape, dt) for n, (shape, dt) in self._chunk_shapes().items()}
        self._slots = [SlotDriver(self, r, Rows({n: self._row(a, r) for n, a in self.bank.items()},
                                                {n: self._row(a, r) for n, a in self.bank_out.items()},
                                                CacheState(self.plan), staging, persistent=False,
                                                shared_staging=True, movable=False)) for r in range(R)]
        self.rows = self._slots[0].rows

    def reset(self) -> None:
        """Empty every slot."""
        for r in self._slots:
            self._reset(r.rows)

    def slot(self, r: int) -> "SlotDriver":
        """The batch-1 step driver of slot ``r``."""
        return self._slots[r]

    @property
    def n_rows(self) -> int:
        return len(self._slots)

    def batches(self, n: int) -> bool:
        """Whether ``n`` decoding slots go through the batched decode graph (set :attr:`batch_from`)."""
        return self.batched and n >= self.batch_from

    def decode_slots(self, slots: list["SlotDriver"], tokens: np.ndarray, positions: np.ndarray) -> list:
        """One decode step of several slots through ``decode_batch.onnx`` (every row of the bank: rows not decoding
        get token 0 at position 0 and their outputs are ignored) -> per slot (logits (1, V), compacted). The plans
        first: a full press-free slot refuses before any graph runs."""
        # rule 7b: the rows read the bucket of the most any decoding slot holds (the others' outputs are ignored)
        read = self.plan.read_slots([f for s in slots for f in s.rows.state.fills])
        steps = [s.rows.state.decode() for s in slots]
        R = len(self._slots)
        ids, pos = np.zeros((R, 1), np.int64), np.zeros((R, 1), np.int64)
        index = [s.index for s in slots]
        ids[index, 0], pos[index, 0] = tokens, positions
        arrays = {n: self.bank[n] for n in self._io_plan("decode_batch")[0]}
        head = self._head_slots(arrays, read)
        self.graphs.call("decode_batch", self._feeds("decode_batch", input_ids=ids, positions=pos),
                         {**arrays, **head}, self.bank_out, persistent=not head)
        self.graphs.forget(head.values())
        logits = self.bank_out["logits"]
        logits = (logits.detach().cpu().numpy() if hasattr(logits, "detach") else np.asarray(logits))
        # the decoding rows' writes in one assignment per buffer (each row into its own slots), then each slot's
        # compaction where its plan asks for one
        to_dev = self.graphs.to_device
        rsel = to_dev(np.asarray(index, np.int64))
        per_layer = np.asarray([st.slots for st in steps], np.int64).T  # (layers, rows)
        query = to_dev(np.asarray([st.query_slot for st in steps], np.int64)) if self.press is not None else None
        self._store_decoded(self.bank, self.bank_out, rsel, [to_dev(x) for x in per_layer], query, positions)
        return [(logits[s.index:s.index + 1].copy(), self._compact_if_due(s.rows, step))
                for s, step in zip(slots, steps, strict=True)]

    def decode_timings(self, repeats: int = 7) -> dict[str, float]:
        """A bank's two ways to decode, timed on empty slots (nothing is written; they read what empty slots' steps
        read, plan rule 7b): one ``decode_batch`` call for every row and one batch-1 ``decode`` call, the median of
        ``repeats`` each (after two untimed calls)."""
        import time

        zeros = np.zeros((len(self._slots), 1), np.int64)
        read = self.plan.read_slots([0])  # what empty slots' steps read (rule 7b)
        arrays = {n: self.bank[n] for n in self._io_plan("decode_batch")[0]}
        arrays.update(head := self._head_slots(arrays, read))
        one = self._slots[0].rows
        one_arrays = self._inputs(one, "decode")
        one_arrays.update(one_head := self._head_slots(one_arrays, read))

        def batched():
            self.graphs.call("decode_batch", self._feeds("decode_batch", input_ids=zeros, positions=zeros), arrays,
                             self.bank_out, persistent=not head)

        def single():
            self.graphs.call("decode", self._feeds("decode", input_ids=zeros[:1], positions=zeros[:1]), one_arrays,
                             one.step_out)

        def median(fn) -> float:
            times = []
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return sorted(times[2:])[repeats // 2]

        got = {"decode_batch_s": median(batched), "decode_s": median(single)}
        self.graphs.forget([*head.values(), *one_head.values()])
        return got

    def bank_bytes(self) -> dict:
        """A bank's memory, read from its buffers: ``per_slot`` (one row of every cache buffer, by kind), ``shared``
        (the decode step's outputs for every row, one prefill chunk's rows) and ``total``."""
        per = measure(self._slots[0].rows.cache)
        per = {k: v for k, v in per.items() if k in ("kv", "scales", "positions", "queries", "query_positions")}
        per = {k: v for k, v in per.items() if v or k != "scales"}
        per["total"] = sum(per.values())
        shared = measure(self.bank_out, self._slots[0].rows.staging.values())
        shared = {"step_outputs": shared["step_outputs"], "logits": shared["logits"], "staging": shared["staging"],
                  "total": shared["step_outputs"] + shared["logits"] + shared["staging"]}
        total = measure(self.bank)["total"] + shared["total"]
        return {"per_slot": per, "slots": len(self._slots), "shared": shared, "total": total}


class SlotDriver(Driver):
    """One slot of a host's bank as a batch-1 step driver (its own plan state, row views of the bank's buffers)."""

    batch = 1

    def __init__(self, host: GraphHost, index: int, rows: Rows):
        self.host, self.index, self.rows = host, index, rows

    @property
    def plan(self) -> CachePlan:
        return self.host.plan

    @property
    def max_positions(self) -> int | None:
        return self.host.max_positions

    def start(self, mask, new_tokens):
        self.host._start(self.rows, mask, new_tokens)

    def prefill_chunk(self, ids, positions, chunk, tail=None):
        return self.host._prefill_chunk(self.rows, ids, positions, chunk, tail)

    def decode(self, tokens, positions):
        return self.host._decode(self.rows, tokens, positions)

    def kept_positions(self):
        return self.host._kept_positions(self.rows)

    def resident_bytes(self):
        return measure(self.rows.cache)

    def close(self) -> None:
        return None


__all__ = ["SlotBank", "SlotDriver"]
