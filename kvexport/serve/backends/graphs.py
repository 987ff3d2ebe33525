# SPDX-License-Identifier: Apache-2.0
"""Cache slots over an export's graphs (onnxruntime, or TensorRT engines): in-flight batching on static caches.

The export is made with ``batch=1, decode_batch=N`` (``kvexport export --batch 1 --decode-batch N``). The one host
over a bank of slots (:class:`~kvexport.runtime.slots.SlotBank`) allocates every cache buffer once for all N slots
as one (N, ...) bank; slot r is the contiguous row view ``arr[r:r+1]`` with its own plan state, a batch-1 step
driver (:meth:`~kvexport.runtime.slots.SlotBank.slot`). A slot's prefill chunks and compactions run the batch-1 graphs
(``prefill``, ``compact_prefill``, ``compact``) on its row views; all decoding slots step together through
``decode_batch.onnx`` (each row at its own position; the graph only reads the caches, and the host writes each
row's new keys/values/queries where that row's plan says). Rows not decoding get token 0 at position 0 and their
outputs are ignored, so nothing is written into them. An export without ``decode_batch`` decodes slot by slot
with the batch-1 ``decode`` graph on the row views.

The batched call costs about the same however many of its N rows are in use, so with few active sequences one
batch-1 call per sequence is faster. ``decode="auto"`` times both once at start (:meth:`GraphSlots.calibrate`)
and uses the batched graph from the number of active sequences where it wins; ``"batched"`` / ``"rows"`` force
one way. Both ways compute each row independently (their logits agree to float rounding, ~1e-5).
"""

from __future__ import annotations

from kvexport.errors import BadArtifact, BadUsage
from kvexport.runtime.slots import SlotBank
from kvexport.serve.backends.base import DECODE_MODES, SlotBackend


class GraphSlots(SlotBackend):
    """:class:`SlotBackend` over an export directory.

    ``backend``: onnxruntime or tensorrt (``engines``: the TensorRT engine folder); ``max_sequences``: slots to
    admit (default: the export's ``decode_batch``, else 4; at most ``decode_batch`` when batching);
    ``decode``: "auto" (see the module docstring), "batched" (always the decode_batch graph) or "rows" (slot by slot
    even when the export has the batched graph); ``runtime_kw``: more arguments of the host (e.g.
    TrtGenerator's ``runner_factory``)."""

    def __init__(self, export_dir, backend: str = "onnxruntime", max_sequences: int | None = None,
                 threads: int | None = None, engines=None, decode: str = "auto", runtime_kw: dict | None = None):
        from kvexport.manifest import ONNX_EXPORT, verify_manifest

        if decode not in DECODE_MODES:
            raise BadUsage(f"decode {decode!r} is not one of: {', '.join(DECODE_MODES)}")
        if max_sequences is not None and int(max_sequences) < 1:
            raise BadUsage(f"--max-sequences {max_sequences} must be >= 1")
        s = verify_manifest(export_dir, ONNX_EXPORT)["settings"]
        if s["mode"] != "static":
            raise BadArtifact(f"{export_dir} is a growing-past (--dynamic-cache) export: its memory grows with "
                              "each sequence; serve a static-cache export (--press P --budget B, or --press none)")
        slots = max_sequences or s.get("decode_batch") or 4
        if backend == "tensorrt":
            from kvexport.tensorrt.generator import TrtEngines

            graphs = TrtEngines(export_dir, engines=engines, **(runtime_kw or {}))
        else:
            from kvexport.runtime.sessions import OrtSessions

            # the slots decode through decode.onnx / decode_batch.onnx (an in-place graph, if the export has one,
            # is batch 1 over a generator's own buffers: not opened)
            graphs = OrtSessions(export_dir, threads=threads, **{"inplace": False, **(runtime_kw or {})})
        host = SlotBank(graphs, slots, batched=decode != "rows")
        if decode == "batched" and not host.batched:
            raise BadUsage(f"--decode batched needs a decode_batch graph; {export_dir} has none (export it with "
                           "--batch 1 --decode-batch N), or serve it with --decode rows")
        self.host, self.name, self.settings = host, backend, host.settings
        if host.batched and max_sequences is not None and int(max_sequences) > host.n_rows:
            raise BadUsage(f"--max-sequences {max_sequences} exceeds the export's decode batch ({host.n_rows}); "
                           f"re-export with --decode-batch {max_sequences} or serve at most {host.n_rows}")
        self.n_slots = int(max_sequences or host.n_rows)
        self.vocab_size = int(self.settings["vocab_size"])
        self.evicting = host.press is not None
        self.limit = int(self.settings["max_positions"]) if self.evicting else min(host.plan.capacities)
        #: decode through the batched graph when at least this many slots decode (rows only: never)
        self.batch_from = (1 if decode == "batched" else self.calibrate()) if host.batched else None
        host.batch_from = self.batch_from

    def calibrate(self, repeats: int = 7) -> int:
        """Time one batched decode call and one batch-1 call (median of ``repeats``, on empty slots: nothing is
        written) -> the number of active slots from which the batched call is the faster."""
        import math

        self.timings = self.host.decode_timings(repeats)
        return max(1, min(self.host.n_rows, math.ceil(self.timings["decode_batch_s"] / self.timings["decode_s"])))

    def describe(self) -> str:
        """How decode steps run, in words (the server's start line)."""
        if not self.host.batched:
            return "decode slot by slot"
        t = getattr(self, "timings", None)
        times = (f" (decode_batch {t['decode_batch_s'] * 1e3:.2f} ms for {self.host.n_rows} rows, decode "
                 f"{t['decode_s'] * 1e3:.2f} ms per slot)") if t else ""
        return f"decode_batch for >= {self.batch_from} decoding sequences, else slot by slot{times}"

    def driver(self, slot: int):
        return self.host.slot(slot)

    def resident_bytes(self) -> dict:
        """Per slot (one row of every cache buffer) and shared (the decode step's rows and logits for all rows,
        one prefill chunk's rows), read from the allocated buffers."""
        return self.host.bank_bytes()

    def close(self) -> None:
        self.host.close()


__all__ = ["GraphSlots"]
