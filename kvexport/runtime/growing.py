# SPDX-License-Identifier: Apache-2.0
"""The ``--dynamic-cache`` baseline on onnxruntime as a step driver: a full cache whose past grows by one row per
token (the Optimum way), for comparisons.

Its graph copies the whole past into its ``present_*`` outputs every step (that copy is the point of the
comparison). On CPU those outputs are written into the driver's own double buffer: two flat arrays per cache
tensor, sized for the sequence's known length (the stream's ``new_tokens``) or grown by doubling, the past read from
one while the present is written into the other, then swapped. Left to onnxruntime, each step's outputs came from
its arena, which kept growing around tensors one row longer every step (on a 385M model at 2048 tokens the process
held 1.7 GB anonymous for 0.47 GB of K/V, against 1.0 GB so), and fresh NumPy arrays instead paid a page fault per
page each step (decode 2 x slower).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvexport.cache.memory import measure, nbytes
from kvexport.cache.plan import CachePlan, Chunk
from kvexport.errors import BadArtifact, BadUsage
from kvexport.manifest import ONNX_EXPORT, verify_manifest
from kvexport.runtime.host import NP_DTYPES
from kvexport.runtime.protocol import Driver
from kvexport.runtime.sessions import OrtSessions

#: a growing past holds as many tokens as it is given: its plan's capacity is no limit
UNBOUNDED = 1 << 62


class GrowingPast(Driver):
    """A ``--dynamic-cache`` export (verified against its manifest) on onnxruntime; arguments as
    :class:`~kvexport.runtime.onnxruntime.OrtSessions`."""

    backend = "onnxruntime"
    dynamic = True
    inplace = False
    decode_graph = "model"
    press = None

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None,
                 share_weights: bool = True):
        man = verify_manifest(Path(path), ONNX_EXPORT)
        if man["settings"]["mode"] != "dynamic":
            raise BadArtifact(f"{path} is a static-cache export; open it with kvexport.runtime.OrtGenerator")
        self.graphs = OrtSessions(path, providers, threads, share_weights, manifest=man)
        self.path, self.manifest, self.settings = self.graphs.path, man, man["settings"]
        self.providers, self.device = self.graphs.providers, self.graphs.device
        s = self.settings
        self.batch = int(s["batch"])
        self.dtype = NP_DTYPES[s["dtype"]]
        self.plan = CachePlan((UNBOUNDED,), 0, False, int(s["chunk"]))  # chunks of C columns, never padded
        # (present output, past input) per cache tensor, and on CPU per past name
        # [flat buffer the past is a view of, spare flat buffer the next present is written to]
        self._cache_io = [(n, n.replace("present_", "past_")) for n in s["graphs"]["model"]["outputs"]
                          if n.startswith("present_k") or n.startswith("present_v")]
        self._pair: dict[str, list[np.ndarray]] = {}
        self._empty()

    def _empty(self) -> None:
        B = self.batch
        self._past: dict = {}
        for inp in self.sessions["model"].get_inputs():
            if inp.name.startswith("past_") and inp.name != "past_positions":
                shp = list(inp.shape)
                shp[0], shp[2] = B, 0
                self._past[inp.name] = np.zeros(shp, self.dtype)
        self._past_pos = np.zeros((B, 0), np.int64)

    @property
    def sessions(self) -> dict:
        return self.graphs.sessions

    def close(self) -> None:
        self._past, self._pair = {}, {}
        self.graphs.close()

    # ------------------------------------------------------------------ the step protocol
    def start(self, mask: np.ndarray, new_tokens: int | None) -> None:
        self._empty()
        N = mask.shape[1]
        reserve = None if new_tokens is None else N + int(new_tokens) - 1
        self._hold_past(max(N, int(reserve or 0)), exact=bool(reserve))

    def prefill_chunk(self, ids: np.ndarray, positions: np.ndarray, chunk: Chunk, tail=None):
        if tail is not None:
            raise BadUsage("a growing past never evicts, so no lookahead tail observes it (kvexport.cache.plan rule 3b)")
        return self._run(ids, positions), False

    def decode(self, tokens: np.ndarray, positions: np.ndarray):
        return self._run(tokens[:, None], positions[:, None]), False

    def kept_positions(self) -> list[np.ndarray]:
        """One (B, 1, n) array of the positions fed so far."""
        return [self._past_pos[:, None].copy()]

    def current_cache_bytes(self) -> int:
        """Bytes of K/V held now: the buffer the past lives in, as allocated (the sequence's reserved length)."""
        if self._pair:
            return sum(int(p[0].nbytes) for p in self._pair.values())
        return sum(nbytes(v) for v in self._past.values())

    def resident_bytes(self) -> dict[str, int]:
        """``kv``: the past's buffer as allocated; ``positions``: its positions; ``step_outputs``: the spare buffer
        the next present is written to (CPU), by :func:`kvexport.cache.memory.measure`'s kinds."""
        out = measure({})
        out["kv"] = self.current_cache_bytes()
        out["positions"] = int(self._past_pos.nbytes)
        out["step_outputs"] = sum(int(p[1].nbytes) for p in self._pair.values())
        out["total"] = sum(v for k, v in out.items() if k != "total")
        return out

    def synthesize(self, context: int, rng: np.random.Generator) -> np.ndarray:
        """A past of ``context`` random rows at positions 0..context-1, as a prompt leaves it (a benchmark's decode
        cost without its prefill). -> the rows' next positions (B,)."""
        self._empty()
        self._hold_past(int(context), exact=False)
        for name, past in list(self._past.items()):
            B, H, _, D = past.shape
            rows = rng.standard_normal((B, H, int(context), D)).astype(self.dtype)
            if self.device == "cpu":
                pair = self._pair[name]
                view = pair[0][: rows.size].reshape(rows.shape)
                view[...] = rows
                rows = view
            self._past[name] = rows
        self._past_pos = np.broadcast_to(np.arange(int(context)), (self.batch, int(context))).copy()
        return np.full(self.batch, int(context), np.int64)

    # ------------------------------------------------------------------ the double buffer
    def _hold_past(self, rows: int, exact: bool) -> None:
        """On CPU both flat buffers of every cache tensor hold at least ``rows`` rows (exactly ``rows`` when
        ``exact``: the sequence's known length, so a longer earlier sequence's buffers are not kept)."""
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
        pair = self._pair[past_name]
        n = B * H * rows * D
        if pair[1].size < n:
            pair[1] = np.empty(max(n, 2 * pair[1].size), self.dtype)
        return pair[1][:n].reshape(B, H, rows, D)

    def _run(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """One call of the growing-past graph -> the last token's logits (B, V). On CPU the present of every cache
        tensor is written into its spare buffer, which then holds the past."""
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
        return (logits[:, -1] if logits.ndim == 3 else logits).copy()



__all__ = ["GrowingPast", "UNBOUNDED"]
