# SPDX-License-Identifier: Apache-2.0
"""The PyTorch static cache: fixed buffers per layer, driven by the rules of :mod:`kvexport.cache.plan`.

Buffers of one layer (``Hc`` cache heads: the KV heads, or 1 for an MLA latent)::

    k (B, Hc, cap, Dk)   v (B, Hc, cap, Dv)   pos (B, Hc, cap) int64, -1 = empty / padding
    qbuf (B, Hq, W, Dq)                       the query ring (evicting caches only)

and one ``qpos (B, W)`` for the whole cache: the ring's positions (the same in every layer), as in the graphs.

Where a token goes and when the cache is compacted is decided by the cache's :class:`~kvexport.cache.plan.CacheState`;
what is kept by :func:`kvexport.cache.candidates.keep_best` (the same function the exported graphs trace).
Memory is fixed when the cache is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvexport.cache.candidates import gather_slots, keep_best, select_kept, topk_gather_reference
from kvexport.cache.plan import CachePlan, CacheState, ring_order
from kvexport.errors import BadUsage


@dataclass
class ScoreContext:
    """What a press needs from the layer besides the cache: query rotation, softmax scale, sliding window."""

    rotary: object  # kvexport.models.rope.Rotary (or MLA's partial rotary)
    scaling: float
    layer_idx: int
    num_layers: int
    sliding_window: int | None = None

    def inputs(self, n_keep: int):
        """-> make_inputs(k, v, pos, queries, q_positions) for :func:`~kvexport.cache.candidates.keep_best`."""
        from kvexport.presses.base import ScoreInputs

        def make(k, v, pos, queries, q_positions):
            return ScoreInputs(keys=k, values=v, positions=pos, queries=queries, query_positions=q_positions,
                               rotary=self.rotary, scaling=self.scaling, layer_idx=self.layer_idx,
                               num_layers=self.num_layers, n_keep=n_keep, sliding_window=self.sliding_window)

        return make


class LayerCache:
    """Fixed buffers of one layer; its fill count lives in the owning cache's :class:`CacheState`."""

    def __init__(self, batch, heads, key_dim, value_dim, q_heads, q_dim, budget, window, dtype, device, ctx,
                 evicting: bool = True):
        self.budget, self.window = int(budget), int(window)
        self.capacity = self.budget + (self.window if evicting else 0)
        cap = self.capacity
        self.k = torch.zeros(batch, heads, cap, key_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, heads, cap, value_dim, dtype=dtype, device=device)
        self.pos = torch.full((batch, heads, cap), -1, dtype=torch.long, device=device)
        W = self.window if evicting else 0
        self.qbuf = torch.zeros(batch, q_heads, W, q_dim, dtype=dtype, device=device)
        self.ctx = ctx
        self.owner: StaticCache | None = None  # set by StaticCache
        self.index = 0

    @property
    def state(self) -> CacheState:
        return self.owner.state

    @property
    def fill(self) -> int:
        return self.state.fills[self.index]

    def view(self, fill: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``fill`` slots (what a step attends over, besides its own tokens)."""
        return self.k[:, :, :fill], self.v[:, :, :fill], self.pos[:, :, :fill]

    def occupied(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.view(self.fill)

    def _store(self, k, v, pos, upto: int) -> None:
        """Write k/v/pos (B, Hc, n, .) at slots [0, n); slots [n, upto) become empty."""
        n = k.shape[2]
        self.k[:, :, :n] = k
        self.v[:, :, :n] = v
        self.pos[:, :, :n] = pos
        if upto > n:
            self.pos[:, :, n:upto] = -1

    def _keep(self, press, k, v, pos, queries, q_positions) -> None:
        """Candidates [occupied ; new] -> the best budget in slots [0, budget) (rules 3 and 5)."""
        n = k.shape[2]
        kk, kv, kp = keep_best(press, self.ctx.inputs(self.budget), k, v, pos, queries, q_positions, n, 0, n,
                               self.budget, self.budget, topk=self._topk())
        self._store(kk, kv, kp, upto=n)

    def _topk(self):
        """TopKGather's reference, or the owner's ``tie_break`` choice where it makes one."""
        owner = self.owner
        if owner is None or owner.tie_break is None:
            return topk_gather_reference

        def topk(scores, k, v, pos, n):
            idx = owner.tie_break(owner.where, self.index, scores, pos, n)
            if idx is None:
                idx = select_kept(scores, pos, n)
            else:
                owner.ties_resolved += 1
            return gather_slots(k, idx), gather_slots(v, idx), gather_slots(pos, idx), idx

        return topk

    def prefill(self, press, fill: int, compacts: bool, k_new, v_new, new_pos, q_score, q_positions) -> None:
        """Rule 3. A chunk: k_new, v_new (B, Hc, T, D), new_pos (B, Hc, T), q_score (B, Hq, T, Dq), q_positions (B, T);
        ``fill`` / ``compacts``: this layer's entry of the plan's prefill step."""
        T = k_new.shape[2]
        if not compacts:
            self.k[:, :, fill : fill + T] = k_new
            self.v[:, :, fill : fill + T] = v_new
            self.pos[:, :, fill : fill + T] = new_pos
            return
        k = torch.cat([self.k[:, :, :fill], k_new], dim=2)
        v = torch.cat([self.v[:, :, :fill], v_new], dim=2)
        pos = torch.cat([self.pos[:, :, :fill], new_pos], dim=2)
        self._keep(press, k, v, pos, q_score, q_positions)

    def append(self, slot: int, query_slot: int | None, k_new, v_new, new_pos, q_score, q_positions) -> None:
        """Rule 4: one decode token at ``slot``, its query at ring slot ``query_slot`` (None: no ring)."""
        self.k[:, :, slot : slot + 1] = k_new
        self.v[:, :, slot : slot + 1] = v_new
        self.pos[:, :, slot : slot + 1] = new_pos
        if query_slot is not None:
            self.qbuf[:, :, query_slot : query_slot + 1] = q_score
            self.owner.qpos[:, query_slot : query_slot + 1] = q_positions

    def compact(self, press, fill: int, query_start: int) -> None:
        """Rule 5: all ``fill`` occupied slots, observed by the ring read oldest first."""
        if fill <= self.budget:
            return
        order = torch.tensor(ring_order(query_start, self.window), device=self.qbuf.device)
        self._keep(press, *self.view(fill), self.qbuf[:, :, order], self.owner.qpos[:, order])


class StaticCache:
    """One :class:`LayerCache` per layer, all made at once; capacity never changes.

    Build it with :meth:`kvexport.models.decoder.Decoder.new_cache`. ``state`` (a
    :class:`~kvexport.cache.plan.CacheState`) decides every slot; ``on_compaction(where)`` is called after each
    compaction with ``"prefill:<chunk>"`` or ``"decode:<step>"``.
    """

    def __init__(self, layers: list[LayerCache], press, plan: CachePlan):
        self.layers = layers
        self.press = press
        self.plan = plan
        self.state = CacheState(plan)
        for i, layer in enumerate(layers):
            layer.owner, layer.index = self, i
        B, dev = layers[0].k.shape[0], layers[0].k.device
        self.qpos = torch.full((B, plan.window), -1, dtype=torch.long, device=dev)
        self.chunks_fed = 0
        self.on_compaction = None
        self.tie_break = None  # callable(where, layer, scores, positions, n_keep) -> indices or None
        self.ties_resolved = 0
        self.where = ""  # the step being run: "prefill:<chunk>" or "decode:<step>"

    @property
    def compactions(self) -> int:
        return self.state.compactions

    @property
    def budgets(self) -> list[int]:
        return list(self.plan.budgets)

    @property
    def window(self) -> int:
        return self.plan.window

    # ------------------------------------------------------------------ driven by the decoder's forward
    def begin_prefill(self, n_columns: int):
        step = self.state.prefill(n_columns)
        self.where = f"prefill:{self.chunks_fed}"
        self.chunks_fed += 1
        return step

    def end_prefill(self, step) -> None:
        if step.any_compaction and self.on_compaction is not None:
            self.on_compaction(f"prefill:{self.chunks_fed - 1}")

    def begin_decode(self):
        if self.chunks_fed == 0:
            raise BadUsage("decode before any prefill; feed the prompt first")
        return self.state.decode()

    def end_decode(self, step) -> None:
        if step.compact:
            self.where = f"decode:{self.state.steps - 1}"
            start = self.state.query_start
            fills = self.state.compact()
            for layer, f in zip(self.layers, fills, strict=True):
                layer.compact(self.press, f, start)
            if self.on_compaction is not None:
                self.on_compaction(f"decode:{self.state.steps - 1}")

    # ------------------------------------------------------------------ accounting
    def resident_bytes(self) -> dict[str, int]:
        """Bytes every buffer of this cache holds, by kind (``total`` included)."""
        out = {"kv": 0, "positions": 0, "queries": 0, "query_positions": self.qpos.numel() * self.qpos.element_size()}
        for ly in self.layers:
            out["kv"] += ly.k.numel() * ly.k.element_size() + ly.v.numel() * ly.v.element_size()
            out["positions"] += ly.pos.numel() * ly.pos.element_size()
            out["queries"] += ly.qbuf.numel() * ly.qbuf.element_size()
        out["total"] = sum(out.values())
        return out

    def nbytes(self) -> int:
        """Bytes of the K/V buffers alone."""
        return self.resident_bytes()["kv"]

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer: positions (B, Hc, cap) of every slot, -1 = empty (copies)."""
        return [layer.pos.clone() for layer in self.layers]
