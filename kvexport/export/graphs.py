# SPDX-License-Identifier: Apache-2.0
"""The exportable graphs: a prefill chunk, a one-token decode step, the two compactions, and the growing past.

Each wraps a :class:`~kvexport.models.decoder.Decoder` with fixed shapes (batch B, chunk C, per-layer capacity
cap_i = budget_i + window W) and follows :mod:`kvexport.cache.plan`: the host keeps the plan's
:class:`~kvexport.cache.plan.CacheState` and the cache buffers, and writes each step's new rows into them in
place; the graphs read the cache and output only what is new, so a decode step writes O(1) bytes whatever the
capacity. What a compaction keeps is :func:`kvexport.cache.candidates.keep_best`, the function the PyTorch
cache runs. Cache tensors (inputs, per layer i): ``k_i (B, Hc, cap_i, Dk)``, ``v_i (B, Hc, cap_i, Dv)``,
``pos_i (B, Hc, cap_i)`` int64 (-1 = empty); with a press the query ring ``qbuf_i (B, Hq, W, Dq)`` and one shared
``qpos (B, W)``:

- prefill: C columns (a short last chunk front-padded, plan rule 2) attend to the cache and each other; outputs
  the logits of the last column and the chunk's rows ``k_new_i``, ``v_new_i`` (and with a press the queries
  ``q_new_i`` that observe at a compaction). The host writes the real columns at ``fill`` or, when a layer
  overflows, runs ``compact_prefill``.
- compact_prefill (``fill (L,)``, ``n_pad (1,)``, the cache, the chunk's rows, positions and queries): every
  layer's [occupied ; real columns] scored by the press, the best budget_i -> ``kept_k_i``, ``kept_v_i``,
  ``kept_pos_i`` (B, Hc, budget_i, .), which the host copies to slots [0, budget_i).
- decode: one token per row attends to the cache and itself; outputs logits and its ``k_new_i``, ``v_new_i``
  (B, Hc, 1, .) (and ``q_new_i`` (B, Hq, 1, Dq)), which the host writes at ``slot_i`` (and ring slot).
- compact (``fill (L,)``, ``query_start (1,)``, the cache and the ring): every layer's occupied slots scored with
  the ring read oldest first -> ``kept_*`` as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvexport import ops
from kvexport.cache.candidates import keep_best
from kvexport.cache.formats import kv_format, layer_fields
from kvexport.cache.plan import capacities
from kvexport.cache.quant import decode, encode, read_rows, storage_dtype
from kvexport.cache.static_cache import dtype_name
from kvexport.errors import BadUsage
from kvexport.presses.context import ScoreContext


@dataclass(frozen=True)
class LayerShape:
    """Cache shape of one layer; ``kv_dtype``: how its K/V are stored (:mod:`kvexport.cache.formats`)."""

    heads: int  # Hc
    key_dim: int
    value_dim: int
    q_heads: int
    q_dim: int
    budget: int
    capacity: int
    kv_dtype: str = "fp32"

    @property
    def fields(self) -> tuple[str, ...]:
        """The layer's cache tensors in graph order: k, v, pos (and the scales ks, vs of a quantized format)."""
        return layer_fields(self.value_dim, kv_format(self.kv_dtype))


def check_kv_dtype(kv_dtype: str | None, dtype: str, dynamic_cache: bool = False) -> str:
    """An export's ``--kv-dtype`` (None: the export's ``--dtype``) -> its name; one line where it cannot be used."""
    fmt = kv_format(kv_dtype, dtype)
    if dynamic_cache and fmt.name != dtype:
        raise BadUsage(f"--kv-dtype {fmt.name} needs a static cache; --dynamic-cache is the growing-past baseline "
                       f"in the export's --dtype ({dtype})")
    return fmt.name


def layer_shapes(decoder, budgets: list[int], window: int, kv_dtype: str | None = None) -> list[LayerShape]:
    out = []
    kv = kv_format(kv_dtype, dtype_name(next(decoder.parameters()).dtype)).name
    for b, cap, layer in zip(budgets, capacities(budgets, window), decoder.layers, strict=True):
        a = layer.self_attn
        out.append(LayerShape(a.cache_heads, a.key_dim, a.value_dim, a.num_heads,
                              getattr(a, "score_dim", a.head_dim), b, cap, kv))
    return out


def _layer_fields(layers) -> list[tuple[str, ...]]:
    """Per layer: its cache fields (``layers``: a count = unquantized k, v, pos; or the LayerShapes)."""
    if isinstance(layers, int):
        return [("k", "v", "pos")] * layers
    return [s.fields for s in layers]


def kv_names(layers, prefix: str = "") -> list[str]:
    """Graph I/O names of the cache tensors (k, v, pos, and scales), in graph order (``prefix``: "" for the cache,
    "kept_" for a compaction's output). ``layers``: the LayerShapes (or a count: k, v, pos only)."""
    return [f"{prefix}{t}_{i}" for i, fields in enumerate(_layer_fields(layers)) for t in fields]


def query_names(n_layers: int) -> list[str]:
    """Graph input names of the query ring, in graph order."""
    return [f"qbuf_{i}" for i in range(n_layers)] + ["qpos"]


def new_fields(fields: tuple[str, ...], with_queries: bool, full_rows: bool = False) -> tuple[str, ...]:
    """A layer's new-row outputs: the stored fields but positions (``k_new`` ``v_new`` ``ks_new`` ``vs_new``), the
    press's queries ``q_new``, and with ``full_rows`` the rows before storage (``kf_new`` ``vf_new``: what a
    prefill compaction scores when the cache format is lossy)."""
    return (*(f for f in fields if f != "pos"), *(("q",) if with_queries else ()), *(("kf", "vf") if full_rows else ()))


def new_names(layers, with_queries: bool, full_rows: bool = False) -> list[str]:
    """Graph names of a step's new rows, in graph order (``layers``: LayerShapes or a count)."""
    return [f"{t}_new_{i}" for i, fields in enumerate(_layer_fields(layers))
            for t in new_fields(fields, with_queries, full_rows)]


def cache_examples(shapes: list[LayerShape], batch: int, dtype) -> list:
    """Example cache tensors of every layer, in graph order (empty slots: position -1)."""
    out = []
    for s in shapes:
        store = storage_dtype(kv_format(s.kv_dtype))
        t = {"k": torch.zeros(batch, s.heads, s.capacity, s.key_dim, dtype=store),
             "v": torch.zeros(batch, s.heads, s.capacity, s.value_dim, dtype=store),
             "pos": torch.full((batch, s.heads, s.capacity), -1, dtype=torch.long),
             "ks": torch.zeros(batch, s.heads, s.capacity, dtype=torch.float16),
             "vs": torch.zeros(batch, s.heads, s.capacity, dtype=torch.float16)}
        out += [t[f] for f in s.fields]
    return out


class _CacheGraph(nn.Module):
    def __init__(self, decoder, press, budgets: list[int], window: int, kv_dtype: str | None = None):
        super().__init__()
        self.decoder = decoder
        self.press = press
        self.budgets = list(budgets)
        self.window = int(window)
        self.shapes = layer_shapes(decoder, self.budgets, self.window, kv_dtype)
        self.fmt = kv_format(self.shapes[0].kv_dtype)
        self.dtype = next(decoder.parameters()).dtype
        self.lossy = self.fmt.quantized or storage_dtype(self.fmt) != self.dtype

    def split_kv(self, cache) -> list[dict]:
        """Flat cache tensors -> per layer {field: tensor} (k, v, pos, and ks / vs)."""
        out, at = [], 0
        for s in self.shapes:
            out.append(dict(zip(s.fields, cache[at : at + len(s.fields)], strict=True)))
            at += len(s.fields)
        return out

    def n_cache(self) -> int:
        return sum(len(s.fields) for s in self.shapes)

    def stored(self, t: dict) -> tuple:
        """A layer's tensors as stored: (k, v, k_scale or None, v_scale or None)."""
        return t["k"], t["v"], t.get("ks"), t.get("vs")

    def scored(self, t: dict) -> tuple:
        """A layer's cache as the PyTorch cache's presses score it and attention reads it: model dtype."""
        if not self.lossy:
            return t["k"], t["v"], t["pos"]
        return (decode(t["k"], t.get("ks"), self.fmt, self.dtype), decode(t["v"], t.get("vs"), self.fmt, self.dtype),
                t["pos"])

    def read(self, i: int, t: dict) -> tuple:
        """What layer i's attention is handed (as :meth:`kvexport.cache.static_cache.LayerCache.view` does)."""
        attn = self.decoder.layers[i].self_attn
        return (*read_rows(t["k"], t["v"], t.get("ks"), t.get("vs"), self.fmt, self.dtype,
                           getattr(attn, "reads_quantized", False), getattr(attn, "reads_quantized_values", False)),
                t["pos"])

    #: whether a compaction's observation queries are the last candidates' own (plan rule 3b: not a lookahead tail's)
    own_observers = True

    def make_inputs(self, i: int):
        attn = self.decoder.layers[i].self_attn
        ctx = ScoreContext(rotary=getattr(attn, "score_rotary", attn.rotary), scaling=attn.scaling, layer_idx=i,
                           num_layers=len(self.shapes), sliding_window=getattr(attn, "sliding_window", None))
        return ctx.inputs(self.shapes[i].budget, self.own_observers)

    def keep(self, i: int, k, v, pos, queries, q_positions, fill, n_pad, stored=None) -> list:
        """Raw layout [cache (cap_i) ; columns] -> the best budget_i (B, Hc, budget_i, .) (plan rules 3 and 5), as
        the layer's cache fields (kept codes and scales gathered from ``stored`` for a lossy format)."""
        s = self.shapes[i]
        got = keep_best(self.press, self.make_inputs(i), k, v, pos, queries, q_positions, fill, n_pad, s.capacity,
                        s.budget, s.budget, topk=ops.topk_gather.topk_gather, stored=stored)
        named = dict(zip(("k", "v", "pos", "ks", "vs"), got, strict=False))
        return [named[f] for f in s.fields]

    def encode_rows(self, rows: list) -> list[tuple]:
        """:func:`~kvexport.cache.quant.encode` of each layer's new rows (B, Hc_i, T, D_i) -> [(stored, scale)]. A
        quantized format encodes the layers' rows of one width together, concatenated along the heads, and splits the
        codes back: a row's scale is its own, so the codes equal the layer-by-layer ones bit for bit, and a step's
        graph quantizes in one chain of nodes instead of one per layer and tensor (690 fewer nodes in SmolLM2's
        decode step)."""
        if not self.fmt.quantized:
            return [encode(r, self.fmt) for r in rows]
        out: list = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(int(r.shape[-1]), []).append(i)
        for width, idx in groups.items():
            if width == 0 or len(idx) == 1:
                for i in idx:
                    out[i] = encode(rows[i], self.fmt)
                continue
            sizes = [int(rows[i].shape[1]) for i in idx]
            codes, scales = encode(torch.cat([rows[i] for i in idx], dim=1), self.fmt)
            for i, c, sc in zip(idx, codes.split(sizes, dim=1), scales.split(sizes, dim=1), strict=True):
                out[i] = (c, sc)
        return out

    def step(self, input_ids, positions, cache, full_rows: bool = False):
        """Run the tokens through every layer over the cache -> final hidden (B, T, H) and the new rows as the host
        writes them (per layer: stored k / v and their scales, the press's queries, and with ``full_rows`` the rows
        before storage)."""
        h = self.decoder.embed_tokens(input_ids)
        ks, vs, qs = [], [], []
        for i, (layer, t) in enumerate(zip(self.decoder.layers, self.split_kv(cache), strict=True)):
            h, k_new, v_new, q_pre = layer(h, positions, *self.read(i, t))
            ks.append(k_new)
            vs.append(v_new)
            qs.append(layer.self_attn.score_queries(q_pre) if self.press is not None else None)
        new = []
        for k_new, v_new, q, (k, k_s), (v, v_s) in zip(ks, vs, qs, self.encode_rows(ks), self.encode_rows(vs),
                                                       strict=True):
            named = {"k": k, "v": v, "ks": k_s, "vs": v_s, "q": q, "kf": k_new, "vf": v_new}
            new += [named[f] for f in new_fields(self.shapes[0].fields, q is not None, full_rows)]
        return h, new

    def split_new(self, new, full_rows: bool) -> list[dict]:
        """Flat new rows (as :meth:`step` returns them) -> per layer {field: tensor}."""
        out, at = [], 0
        for s in self.shapes:
            names = new_fields(s.fields, self.press is not None, full_rows)
            out.append(dict(zip(names, new[at : at + len(names)], strict=True)))
            at += len(names)
        return out

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder.lm_head(self.decoder.norm(h))


class PrefillChunk(_CacheGraph):
    """One chunk of exactly C columns (padding: position -1). Inputs: input_ids (B, C) int64, positions (B, C)
    int64, then the cache tensors of every layer. Outputs: logits (B, V) of the last column, then the chunk's new
    rows (with a press and a lossy format also the rows before storage, which ``compact_prefill`` scores).

    With ``lookahead`` L > 0 (plan rule 3b) the inputs hold C + L columns: the chunk, then its lookahead tail (the
    prompt's last columns at their true positions, front-padded to L; all padding for the prompt's last chunk). The
    tail runs through every layer with the chunk (it attends to the cache, the chunk and itself, causal by
    position; the chunk cannot see it); its rows are not output, its queries are (``q_tail_i`` (B, Hq, L, Dq), after
    every layer's new rows), for ``compact_prefill_tail``. The logits are the chunk's last column's."""

    def __init__(self, decoder, press, budgets, window, kv_dtype=None, lookahead: int = 0):
        super().__init__(decoder, press, budgets, window, kv_dtype)
        self.lookahead = int(lookahead)

    @property
    def full_rows(self) -> bool:
        return self.press is not None and self.lossy

    def forward(self, input_ids, positions, *cache):
        h, new = self.step(input_ids, positions, cache, self.full_rows)
        L = self.lookahead
        if not L:
            return (self.head(h[:, -1]), *new)
        C = input_ids.shape[1] - L
        chunk, tails = [], []
        for r in self.split_new(new, self.full_rows):
            for f, x in r.items():
                if f == "q":
                    tails.append(x[:, :, C:])
                chunk.append(x[:, :, :C])
        return (self.head(h[:, C - 1]), *chunk, *tails)


class DecodeStep(_CacheGraph):
    """One token per row. Inputs: input_ids (B, 1), positions (B, 1), then the cache tensors of every layer. Outputs:
    logits (B, V), then the token's new rows (B, Hc, 1, .) (and its query (B, Hq, 1, Dq) with a press)."""

    def forward(self, input_ids, positions, *cache):
        h, new = self.step(input_ids, positions, cache)
        return (self.head(h[:, -1]), *new)


class InPlaceDecodeStep(_CacheGraph):
    """The decode step for onnxruntime on the CPU, writing the cache in place (``decode_inplace.ort.onnx``).

    Inputs: input_ids (B, 1), positions (B, 1), slots (L, B) int32 (layer i's token goes to slot ``slots[i]``, its
    fill: plan rule 4), then the cache tensors of every layer, whose positions already hold this token's at its slot
    (the host writes them first). Outputs: logits (B, V), then per layer the cache's k and v as updated
    (``k_present_i`` / ``v_present_i``: the runtime binds them to the same buffers as ``k_i`` / ``v_i``, and
    onnxruntime's GroupQueryAttention then writes only the token's slot) and, with a press, the token's query
    ``q_new_i``. GQA attention (not MLA) over a cache stored in the model's dtype only (:func:`check_inplace`)."""

    def forward(self, input_ids, positions, slots, *cache):
        attns = [layer.self_attn for layer in self.decoder.layers]
        for i, a in enumerate(attns):
            a.step_slots = slots[i]
        try:
            h, new = self.step(input_ids, positions, cache)
        finally:
            for a in attns:
                a.step_slots = None
        return (self.head(h[:, -1]), *new)


def in_place_map(n_layers: int) -> dict[str, str]:
    """The in-place decode graph's aliased outputs -> the cache inputs they are bound to (k_present_i -> k_i, ...)."""
    return {f"{f}_present_{i}": f"{f}_{i}" for i in range(n_layers) for f in ("k", "v")}


def inplace_names(layers, with_queries: bool) -> list[str]:
    """The in-place decode graph's outputs after the logits: per layer k_present_i, v_present_i (and q_new_i)."""
    aliased = list(in_place_map(len(layers)))
    out = []
    for i in range(len(layers)):
        out += aliased[2 * i : 2 * i + 2] + ([f"q_new_{i}"] if with_queries else [])
    return out


def check_inplace(decoder, kv_dtype: str | None, dtype: str) -> None:
    """Faithful or refused: the in-place decode graph exists for GQA attention over a cache in the model's dtype."""
    from kvexport.errors import BadUsage
    from kvexport.models.attention import GQAAttention

    if any(type(layer.self_attn) is not GQAAttention for layer in decoder.layers):
        raise BadUsage("--inplace-decode needs grouped-query attention (onnxruntime's GroupQueryAttention); an MLA "
                       "model decodes through LatentAttention: export it without --inplace-decode")
    rot = decoder.layers[0].self_attn.rotary
    if rot.offset != 0 or rot.dim != decoder.layers[0].self_attn.head_dim:
        raise BadUsage(f"--inplace-decode rotates whole heads (onnxruntime's GroupQueryAttention); this model rotates "
                       f"{rot.dim} of {decoder.layers[0].self_attn.head_dim} channels: export it without it")
    if kv_dtype not in (None, dtype):
        raise BadUsage(f"--inplace-decode stores the cache in the model's dtype ({dtype}); --kv-dtype {kv_dtype} is "
                       "not supported by it: drop one of the two")


class CompactPrefill(_CacheGraph):
    """A prefill chunk's compaction. Inputs: fill (L,), n_pad (1,), positions (B, C), then the cache tensors of
    every layer, then the chunk's new rows (as PrefillChunk returns them). Outputs: the kept cache tensors
    (B, Hc, budget_i, .). With a lossy format the press scores the cache as stored and the chunk's rows before
    storage; the kept codes are gathered, not quantized again."""

    def forward(self, fill, n_pad, positions, *rest):
        return self._compact(fill, n_pad, positions, rest, None, positions)

    def _compact(self, fill, n_pad, positions, rest, observers, q_positions):
        n = self.n_cache()
        full = self.lossy
        B, C = positions.shape
        out = []
        for i, (t, r) in enumerate(zip(self.split_kv(rest[:n]), self.split_new(rest[n:], full), strict=True)):
            new_pos = positions[:, None, :].expand(B, t["k"].shape[1], C)
            k0, v0, _ = self.scored(t)
            kf, vf = (r["kf"], r["vf"]) if full else (r["k"], r["v"])
            stored = None
            if self.lossy:
                new_stored = (r["k"], r["v"], r.get("ks"), r.get("vs"))
                stored = tuple(None if a is None else torch.cat([_carried(a), _carried(b)], dim=2)
                               for a, b in zip(self.stored(t), new_stored, strict=True))
            queries = r["q"] if observers is None else observers[i]
            kept = self.keep(i, torch.cat([k0, kf], dim=2), torch.cat([v0, vf], dim=2),
                             torch.cat([t["pos"], new_pos], dim=2), queries, q_positions, fill[i], n_pad[0], stored)
            out += [x.to(torch.uint8) if self.fmt.quantized and f in ("k", "v") else x
                    for f, x in zip(self.shapes[i].fields, kept, strict=True)]
        return tuple(out)


class CompactPrefillTail(CompactPrefill):
    """A prefill chunk's compaction observed by its lookahead tail (plan rule 3b). Inputs: fill (L,), n_pad (1,),
    positions (B, C), tail_positions (B, Lt) (padding: -1, in front), then the cache tensors of every layer, the
    chunk's new rows (as PrefillChunk returns them) and every layer's ``q_tail_i``. The tail's queries observe
    instead of the chunk's own; observers that are not candidates force nothing to be kept."""

    own_observers = False

    def forward(self, fill, n_pad, positions, tail_positions, *rest):
        n_layers = len(self.shapes)
        tails = rest[len(rest) - n_layers:]
        return self._compact(fill, n_pad, positions, rest[: len(rest) - n_layers], list(tails), tail_positions)


def _carried(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes as float16 (every code 0..255 exactly) for a prefill compaction's Concat and gathers, which
    TensorRT does not run on UINT8; cast back after TopKGather. Other tensors as they are."""
    return x.to(torch.float16) if x.dtype == torch.uint8 else x


class Compact(_CacheGraph):
    """Decode-time compaction of every layer: all slots scored with the ring read oldest first.
    Inputs: fill (L,), query_start (1,), then the cache tensors of every layer and the ring. Outputs: the kept
    cache tensors."""

    def forward(self, fill, query_start, *cache):
        L, n = len(self.shapes), self.n_cache()
        order = torch.remainder(query_start[0] + torch.arange(self.window, device=fill.device), self.window)
        qpos = cache[n + L].index_select(1, order)
        out = []
        for i, t in enumerate(self.split_kv(cache[:n])):
            queries = cache[n + i].index_select(2, order)
            out += self.keep(i, *self.scored(t), queries, qpos, fill[i], 0, self.stored(t) if self.lossy else None)
        return tuple(out)


class GrowingPast(nn.Module):
    """The full-cache baseline with a growing past (the way Optimum exports decoders).

    Inputs: input_ids (B, T), positions (B, T), past_positions (B, P), then past k_i, v_i (B, Hkv, P, D).
    Outputs: logits (B, V) of the last column, present_positions (B, P+T), present k_i, v_i (B, Hkv, P+T, D).
    """

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, positions, past_positions, *past):
        B, T = input_ids.shape
        h = self.decoder.embed_tokens(input_ids)
        present = []
        for i, layer in enumerate(self.decoder.layers):
            k, v = past[2 * i], past[2 * i + 1]
            pp = past_positions[:, None, :].expand(B, k.shape[1], past_positions.shape[1])
            h, k_new, v_new, _ = layer(h, positions, k, v, pp)
            present += [torch.cat([k, k_new], dim=2), torch.cat([v, v_new], dim=2)]
        logits = self.decoder.lm_head(self.decoder.norm(h[:, -1]))
        return (logits, torch.cat([past_positions, positions], dim=1), *present)
