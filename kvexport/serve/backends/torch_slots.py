# SPDX-License-Identifier: Apache-2.0
"""Cache slots on the PyTorch path: kvexport's Decoder with one :class:`StaticCache` per slot.

The model is the export's source (``kvexport.export.validation.load_reference_model``: the manifest's model,
checked against its hash), with the export's press, budgets, window and chunk. Each admitted sequence gets a fresh
batch-1 cache of the same fixed size whose buffers (K/V, positions, query ring) are one row of a :class:`Bank`
made at start (every slot's buffers, ``(slots, Hc, cap, D)`` per layer, as
:class:`~kvexport.serve.backends.graphs.GraphSlots` banks the graphs' buffers). Prefill chunks go through
``decoder(ids, positions, cache, mode="prefill")`` one slot at a time; a decode step runs every decoding slot in one
batched forward (:func:`decode_rows`: each row attends over its own row of the bank, each cache's plan decides its
slot and its compactions), or slot by slot with ``decode="rows"``.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np

from kvexport.errors import BadArtifact, BadUsage
from kvexport.serve.backends.base import DECODE_MODES, SlotBackend


class TorchSlots(SlotBackend):
    """:class:`SlotBackend` on PyTorch for an export directory (``max_sequences`` slots, default 4)."""

    name = "pytorch"

    def __init__(self, export_dir, max_sequences: int | None = None, threads: int | None = None,
                 decode: str = "auto"):
        import torch

        from kvexport.export.exporter import press_from_dict
        from kvexport.export.manifest import ONNX_EXPORT, verify_manifest
        from kvexport.export.validation import load_reference_model

        manifest = verify_manifest(export_dir, ONNX_EXPORT)
        s = self.settings = manifest["settings"]
        if s["mode"] != "static":
            raise BadArtifact(f"{export_dir} is a growing-past (--dynamic-cache) export: serve a static-cache export")
        if max_sequences is not None and int(max_sequences) < 1:
            raise BadUsage(f"--max-sequences {max_sequences} must be >= 1")
        if decode not in DECODE_MODES:
            raise BadUsage(f"--decode {decode!r} is not one of: {', '.join(DECODE_MODES)}")
        self.batched = decode != "rows"  # "auto" and "batched": one forward for all decoding slots
        if threads:
            torch.set_num_threads(int(threads))
        self._torch = torch
        self.decoder = load_reference_model(manifest, root=Path(export_dir))
        self.press = press_from_dict(s["press"])
        self.evicting = self.press is not None
        self._shape = ([int(b) for b in (s["budgets"] if self.evicting else s["capacities"])],
                       int(s["window"]) if self.evicting else 0, int(s["chunk"]))
        self.n_slots = int(max_sequences or 4)
        self.vocab_size = int(s["vocab_size"])
        proto = self._new_cache()
        self._per_slot = proto.resident_bytes()
        self.limit = int(s["max_positions"]) if self.evicting else min(self._shape[0])
        self._bank = Bank(proto, self.n_slots)
        self._caches: list = [None] * self.n_slots
        self._pending: list[deque] = [deque() for _ in range(self.n_slots)]
        self._prompt: list = [None] * self.n_slots
        self._next = [0] * self.n_slots

    def _new_cache(self):
        budgets, window, chunk = self._shape
        return self.decoder.new_cache(1, self.press, budgets, window, chunk)

    def start(self, slot: int, prompt: list[int]) -> int:
        torch = self._torch
        cache = self._new_cache()
        cache.plan.check_fits(len(prompt))
        self._bank.lend(cache, slot)
        cache.on_compaction = lambda where, slot=slot: self._compacted(slot, where)
        ids = torch.tensor([prompt], dtype=torch.long)
        self._caches[slot] = cache
        self._prompt[slot] = (ids, torch.arange(ids.shape[1])[None])
        self._pending[slot] = deque(cache.plan.chunks(ids.shape[1]))
        self._next[slot] = ids.shape[1]
        return len(self._pending[slot])

    def prefill_step(self, slot: int) -> np.ndarray | None:
        ids, pos = self._prompt[slot]
        c = self._pending[slot].popleft()
        with self._torch.inference_mode():
            logits = self.decoder(ids[:, c.start:c.stop], pos[:, c.start:c.stop], self._caches[slot], mode="prefill")
        if self._pending[slot]:
            return None
        self._prompt[slot] = None
        return logits[0, -1].float().numpy().copy()

    def decode(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        torch = self._torch
        out = np.empty((len(slots), self.vocab_size), np.float32)
        with torch.inference_mode():
            if self.batched and len(slots) > 1:
                order = sorted(range(len(slots)), key=lambda j: slots[j])  # ascending rows: often one slice
                rows = [slots[j] for j in order]
                ids = torch.tensor([[tokens[j]] for j in order], dtype=torch.long)  # (n, 1)
                pos = torch.tensor([[self._next[r]] for r in rows], dtype=torch.long)  # (n, 1)
                logits = decode_rows(self.decoder, [self._caches[r] for r in rows], ids, pos, self._bank, rows)
                out[order] = logits[:, -1].float().numpy()
            else:
                for j, (r, tok) in enumerate(zip(slots, tokens, strict=True)):
                    pos = torch.tensor([[self._next[r]]], dtype=torch.long)
                    logits = self.decoder(torch.tensor([[tok]], dtype=torch.long), pos, self._caches[r],
                                          mode="decode")
                    out[j] = logits[0, -1].float().numpy()
        for r in slots:
            self._next[r] += 1
        return out

    def describe(self) -> str:
        return "decode the decoding slots in one batched forward" if self.batched else "decode slot by slot"

    def _compacted(self, slot: int, where: str) -> None:
        if self.on_compaction is not None:
            self.on_compaction(slot, where)

    def release(self, slot: int) -> None:
        self._caches[slot] = None  # the next sequence gets a fresh cache over the same row of the bank
        self._prompt[slot] = None
        self._pending[slot].clear()

    def kept_positions(self, slot: int) -> list[np.ndarray]:
        return [p.numpy().copy() for p in self._caches[slot].kept_positions()]

    def resident_bytes(self) -> dict:
        """Per slot: one batch-1 StaticCache (its buffers a row of the bank made at start; always this size)."""
        per = dict(self._per_slot)
        return {"per_slot": per, "slots": self.n_slots, "shared": {"total": 0}, "total": per["total"] * self.n_slots}


class Bank:
    """Every slot's cache buffers in one tensor per kind and layer, so that a decode step reads and writes all rows
    at once: per layer ``k`` (slots, Hc, cap, Dk), ``v`` (slots, Hc, cap, Dv), ``pos`` (slots, Hc, cap) (-1 =
    empty), ``qbuf`` (slots, Hq, W, Dq) (the query ring), and ``qpos`` (slots, W) for the cache. Shaped after
    ``proto``, a batch-1 :class:`~kvexport.cache.static_cache.StaticCache` in the model's dtype."""

    def __init__(self, proto, n_slots: int):
        n = n_slots
        self.layers = [{"k": ly.k.new_zeros((n, *ly.k.shape[1:])), "v": ly.v.new_zeros((n, *ly.v.shape[1:])),
                        "pos": ly.pos.new_full((n, *ly.pos.shape[1:]), -1),
                        "qbuf": ly.qbuf.new_zeros((n, *ly.qbuf.shape[1:]))} for ly in proto.layers]
        self.qpos = proto.qpos.new_full((n, *proto.qpos.shape[1:]), -1)

    def lend(self, cache, slot: int) -> None:
        """Make row ``slot`` ``cache``'s buffers (a fresh cache: emptied as a new one is)."""
        for ly, b in zip(cache.layers, self.layers, strict=True):
            assert ly.ks is None and ly.vs is None and not ly.lossy, "the bank holds the model's dtype only"
            ly.k, ly.v, ly.pos, ly.qbuf = (b[n][slot : slot + 1] for n in ("k", "v", "pos", "qbuf"))
            ly.pos.fill_(-1)
            ly.qbuf.zero_()
        cache.qpos = self.qpos[slot : slot + 1]
        cache.qpos.fill_(-1)


def decode_rows(decoder, caches: list, ids, positions, bank: Bank, rows: list[int]):
    """One decode step of ``n`` batch-1 caches in one batched forward: ``ids``, ``positions`` (n, 1) -> logits
    (n, 1, V), the same as ``decoder(ids[j:j+1], positions[j:j+1], caches[j], mode="decode")`` for each j (to float
    rounding).

    ``caches[j]``'s buffers are row ``rows[j]`` (ascending) of ``bank``. Each cache's plan decides where its token
    goes and when it compacts (``begin_decode`` / ``end_decode``, as in :meth:`Decoder.forward`); the layers run
    once over the n rows, each attending over the first ``m`` slots of its own row, ``m`` the most any of the caches
    has filled in that layer, the slots its own cache has not filled masked (position -1); the new rows are written
    into the bank at each cache's slot all at once (what ``LayerCache.append`` writes, for n rows)."""
    import torch

    steps = [c.begin_decode() for c in caches]
    n, evicting = len(caches), caches[0].press is not None
    a = rows[0]
    idx = torch.tensor(rows)
    part = slice(a, a + n) if rows == list(range(a, a + n)) else idx  # a view, else a copy
    if evicting:  # the query ring: each row's query slot, its position (the same in every layer)
        qslot = torch.tensor([s.query_slot for s in steps])
        bank.qpos[idx, qslot] = positions[:, 0]
    h = decoder.embed_tokens(ids)  # (n, 1, H)
    for i, layer in enumerate(decoder.layers):
        fills = torch.tensor([s.slots[i] for s in steps])  # (n,) the slot each row's token takes
        m = int(fills.max())
        b = bank.layers[i]
        k, v = b["k"][part, :, :m], b["v"][part, :, :m]  # (n, Hc, m, Dk), (n, Hc, m, Dv)
        unfilled = torch.arange(m)[None, :] >= fills[:, None]  # (n, m)
        pos = b["pos"][part, :, :m].masked_fill(unfilled[:, None, :], -1)  # (n, Hc, m)
        h, k_new, v_new, q_pre = layer(h, positions, k, v, pos)  # k_new (n, Hc, 1, Dk)
        b["k"][idx, :, fills] = k_new[:, :, 0]
        b["v"][idx, :, fills] = v_new[:, :, 0]
        b["pos"][idx, :, fills] = positions  # (n, 1) over the cache heads
        if evicting:
            b["qbuf"][idx, :, qslot] = layer.self_attn.score_queries(q_pre)[:, :, 0]  # (n, Hq, Dq)
    for c, s in zip(caches, steps, strict=True):
        c.end_decode(s)
    return decoder.lm_head(decoder.norm(h))


__all__ = ["TorchSlots", "Bank", "decode_rows"]
