# SPDX-License-Identifier: Apache-2.0
"""The PyTorch static cache: fixed buffers per layer, driven by the rules of :mod:`kvexport.cache.plan`.

Buffers of one layer (``Hc`` cache heads: the KV heads, or 1 for an MLA latent)::

    k (B, Hc, cap, Dk)   v (B, Hc, cap, Dv)   pos (B, Hc, cap) int64, -1 = empty / padding
    qbuf (B, Hq, W, Dq)                       the query ring (evicting caches only)
    ks, vs (B, Hc, cap) float16               scales of a quantized format (kvexport.cache.quant; no vs when Dv = 0)

and one ``qpos (B, W)`` for the whole cache: the ring's positions (the same in every layer), as in the graphs.

Where a token goes and when the cache is compacted is decided by the cache's :class:`~kvexport.cache.plan.CacheState`;
what is kept by :func:`kvexport.cache.candidates.keep_best` (the same function the exported graphs trace).
Memory is fixed when the cache is made.
"""

from __future__ import annotations

import torch

from kvexport.cache.candidates import gather_slots, keep_best, select_kept, topk_gather_reference
from kvexport.cache.formats import KVFormat, kv_format
from kvexport.cache.memory import measure
from kvexport.cache.plan import CachePlan, CacheState, ring_order
from kvexport.cache.quant import decode, encode, read_rows, storage_dtype
from kvexport.errors import BadUsage


def dtype_name(dtype: torch.dtype) -> str:
    """A model dtype -> its ``--kv-dtype`` name (the default cache format of that model)."""
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


class LayerCache:
    """Fixed buffers of one layer; its fill count lives in the owning cache's :class:`CacheState`.

    ``kv_dtype`` (:mod:`kvexport.cache.formats`; default: the model's ``dtype``): ``k`` / ``v`` hold that format's
    storage (codes for int8 / fp8, with float16 scales ``ks`` / ``vs`` (B, Hc, cap)); what attention reads is
    :meth:`view`, always in the model's ``dtype``."""

    def __init__(self, batch, heads, key_dim, value_dim, q_heads, q_dim, budget, window, dtype, device, ctx,
                 evicting: bool = True, kv_dtype: str | None = None, capacity: int | None = None):
        self.budget, self.window = int(budget), int(window)
        self.capacity = int(capacity)  # the plan's (kvexport.cache.plan.CachePlan.capacities)
        self.dtype = dtype
        # the attention module takes QuantizedRows for its keys / values (set by StaticCache.set_kv_dtype)
        self.reads_quantized = self.reads_quantized_values = False
        self._alloc(batch, heads, key_dim, value_dim, device, kv_format(kv_dtype, dtype_name(dtype)))
        W = self.window if evicting else 0
        self.qbuf = torch.zeros(batch, q_heads, W, q_dim, dtype=dtype, device=device)
        self.ctx = ctx
        self.owner: StaticCache | None = None  # set by StaticCache
        self.index = 0

    def _alloc(self, batch, heads, key_dim, value_dim, device, fmt: KVFormat) -> None:
        cap, store = self.capacity, storage_dtype(fmt)
        self.fmt = fmt
        self.k = torch.zeros(batch, heads, cap, key_dim, dtype=store, device=device)
        self.v = torch.zeros(batch, heads, cap, value_dim, dtype=store, device=device)
        if not hasattr(self, "pos"):
            self.pos = torch.full((batch, heads, cap), -1, dtype=torch.long, device=device)
        scales = fmt.scale_fields(value_dim)
        self.ks = torch.zeros(batch, heads, cap, dtype=torch.float16, device=device) if "ks" in scales else None
        self.vs = torch.zeros(batch, heads, cap, dtype=torch.float16, device=device) if "vs" in scales else None

    @property
    def lossy(self) -> bool:
        """Whether storing a row changes it (another dtype than the model's, or codes)."""
        return self.fmt.quantized or storage_dtype(self.fmt) != self.dtype

    @property
    def state(self) -> CacheState:
        return self.owner.state

    @property
    def fill(self) -> int:
        return self.state.fills[self.index]

    def stored(self, fill: int) -> tuple:
        """The first ``fill`` slots as stored: (k, v, k_scale or None, v_scale or None)."""
        return (self.k[:, :, :fill], self.v[:, :, :fill], None if self.ks is None else self.ks[:, :, :fill],
                None if self.vs is None else self.vs[:, :, :fill])

    def view(self, fill: int) -> tuple:
        """The first ``fill`` slots as attention reads them (besides its own tokens): k, v in the model's dtype
        (dequantized / converted copies for a lossy format; the buffers themselves otherwise), pos. An attention
        module with ``reads_quantized`` (``reads_quantized_values``) gets the keys (values) as
        :class:`~kvexport.cache.quant.QuantizedRows` instead (:func:`~kvexport.cache.quant.read_rows`)."""
        return self.read(*self.stored(fill), self.pos[:, :, :fill])

    def read(self, k, v, ks, vs, pos) -> tuple:
        """Stored rows (as :meth:`stored` gives them, of this cache or several stacked) and their positions -> what
        attention reads (:meth:`view`)."""
        return (*read_rows(k, v, ks, vs, self.fmt, self.dtype, self.reads_quantized, self.reads_quantized_values),
                pos)

    def _scored(self, fill: int) -> tuple:
        """The first ``fill`` slots as a press scores them (what is stored, read back in the model's dtype)."""
        k, v, ks, vs = self.stored(fill)
        if self.lossy:
            k, v = decode(k, ks, self.fmt, self.dtype), decode(v, vs, self.fmt, self.dtype)
        return k, v, self.pos[:, :, :fill]

    def occupied(self) -> tuple:
        return self.view(self.fill)

    def _write(self, start: int, k, v, ks, vs, pos) -> None:
        """Stored rows k, v (B, Hc, n, .) (and scales (B, Hc, n)) and their positions at slots [start, start + n)."""
        n = k.shape[2]
        self.k[:, :, start : start + n] = k
        self.v[:, :, start : start + n] = v
        if self.ks is not None:
            self.ks[:, :, start : start + n] = ks
        if self.vs is not None:
            self.vs[:, :, start : start + n] = vs
        self.pos[:, :, start : start + n] = pos

    def _encode(self, k_new, v_new) -> tuple:
        """New rows in full precision -> as stored: (k, v, k_scale or None, v_scale or None)."""
        k, ks = encode(k_new, self.fmt)
        v, vs = encode(v_new, self.fmt)
        return k, v, ks, vs

    def _keep(self, press, k, v, pos, queries, q_positions, stored, own_observers: bool = True) -> None:
        """Candidates [occupied ; new] -> the best budget in slots [0, budget) (rules 3 and 5). k, v: what the press
        scores; ``stored``: the same candidates as stored, or None when that is k, v themselves."""
        n = k.shape[2]
        got = keep_best(press, self.ctx.inputs(self.budget, own_observers), k, v, pos, queries, q_positions, n, 0, n,
                        self.budget, self.budget, topk=self._topk(), stored=stored)
        kk, kv, kp = got[:3]
        ks, vs = got[3:] if stored is not None else (None, None)
        self._write(0, kk, kv, ks, vs, kp)
        if n > kk.shape[2]:
            self.pos[:, :, kk.shape[2] : n] = -1

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

    def prefill(self, press, fill: int, compacts: bool, k_new, v_new, new_pos, q_score, q_positions,
                own_observers: bool = True) -> None:
        """Rule 3. A chunk: k_new, v_new (B, Hc, T, D), new_pos (B, Hc, T), q_score (B, Hq, Q, Dq), q_positions (B, Q):
        the observation, the chunk's own queries or (``own_observers=False``) its lookahead tail's (rule 3b);
        ``fill`` / ``compacts``: this layer's entry of the plan's prefill step. With a lossy format the press scores
        the chunk's rows before they are stored (in full precision) and the occupied slots as stored."""
        rows = self._encode(k_new, v_new)
        if not compacts:
            self._write(fill, *rows, new_pos)
            return
        k0, v0, pos0 = self._scored(fill)
        k = torch.cat([k0, k_new], dim=2)
        v = torch.cat([v0, v_new], dim=2)
        pos = torch.cat([pos0, new_pos], dim=2)
        stored = None
        if self.lossy:
            stored = tuple(None if a is None else torch.cat([a, b], dim=2)
                           for a, b in zip(self.stored(fill), rows, strict=True))
        self._keep(press, k, v, pos, q_score, q_positions, stored, own_observers)

    def append(self, slot: int, query_slot: int | None, k_new, v_new, new_pos, q_score, q_positions) -> None:
        """Rule 4: one decode token at ``slot``, its query at ring slot ``query_slot`` (None: no ring)."""
        self._write(slot, *self._encode(k_new, v_new), new_pos)
        if query_slot is not None:
            self.qbuf[:, :, query_slot : query_slot + 1] = q_score
            self.owner.qpos[:, query_slot : query_slot + 1] = q_positions

    def compact(self, press, fill: int, query_start: int) -> None:
        """Rule 5: all ``fill`` occupied slots, observed by the ring read oldest first."""
        if fill <= self.budget:
            return
        order = torch.tensor(ring_order(query_start, self.window), device=self.qbuf.device)
        self._keep(press, *self._scored(fill), self.qbuf[:, :, order], self.owner.qpos[:, order],
                   self.stored(fill) if self.lossy else None)


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

    def set_kv_dtype(self, kv_dtype: str | None, decoder=None) -> "StaticCache":
        """Store K/V (or latents) as ``kv_dtype`` (:mod:`kvexport.cache.formats`; None: the model's dtype) from now
        on: every layer's K/V buffers are made again in that format (call it on a fresh cache, before any token).
        ``decoder``: its attention modules that read quantized rows themselves (``reads_quantized``) are handed
        :class:`~kvexport.cache.quant.QuantizedRows`. Returns the cache."""
        if self.chunks_fed:
            raise BadUsage("set_kv_dtype on a cache that holds tokens; make a new cache")
        for i, ly in enumerate(self.layers):
            B, H, _, Dk = ly.k.shape
            ly._alloc(B, H, Dk, ly.v.shape[-1], ly.k.device, kv_format(kv_dtype, dtype_name(ly.dtype)))
            attn = decoder.layers[i].self_attn if decoder is not None else None
            ly.reads_quantized = bool(getattr(attn, "reads_quantized", False))
            ly.reads_quantized_values = bool(getattr(attn, "reads_quantized_values", False))
        return self

    @property
    def kv_dtype(self) -> str:
        return self.layers[0].fmt.name

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
    def buffers(self):
        """Every buffer of this cache as (graph name, tensor): ``k_i``, ``v_i``, ``pos_i``, ``qbuf_i``, the scales
        ``ks_i`` / ``vs_i`` of a quantized format, and the ring's ``qpos``."""
        for i, ly in enumerate(self.layers):
            yield from ((f"{name}_{i}", t) for name, t in (("k", ly.k), ("v", ly.v), ("ks", ly.ks), ("vs", ly.vs),
                                                            ("pos", ly.pos), ("qbuf", ly.qbuf)) if t is not None)
        yield "qpos", self.qpos

    def resident_bytes(self) -> dict[str, int]:
        """Bytes every buffer of this cache holds, by kind (:func:`kvexport.cache.memory.measure`: ``kv``: K/V or
        latent storage, ``scales``: their float16 scales (quantized formats), ``positions``, ``queries`` /
        ``query_positions``: the ring; ``total``)."""
        return measure(self.buffers())

    def nbytes(self) -> int:
        """Bytes of the K/V buffers alone."""
        return self.resident_bytes()["kv"]

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer: positions (B, Hc, cap) of every slot, -1 = empty (copies)."""
        return [layer.pos.clone() for layer in self.layers]
