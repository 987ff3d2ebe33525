# SPDX-License-Identifier: Apache-2.0
"""The rules of a static KV cache, stated once: where a token goes, when the cache is compacted, which
slots are padding, which queries observe, how positions advance.

Every runtime is a thin driver of this module: the PyTorch cache (:mod:`kvexport.cache.static_cache`), the
exported graphs (:mod:`kvexport.export.graphs`, through :mod:`kvexport.cache.candidates`) and the host loops
of onnxruntime and TensorRT (:class:`kvexport.runtime.host.GraphHost`). None of them computes a slot, a
fill count, a chunk boundary or a ring index itself; they ask a :class:`CacheState`.

Layout of layer i, capacity ``cap_i = budget_i + window``::

    slots [0, fill_i)        occupied: kept and decoded tokens, in position order
    slots [fill_i, cap_i)    empty, position -1
    query ring (window)      queries of the last ``window`` decoded tokens (what a press observes with)

Rules
1. Positions: a row's real tokens are numbered from 0; left padding has position -1; the next token of a row
   takes the row's largest position + 1 (:func:`positions_from_mask`, :func:`next_positions`).
2. Prefill: the prompt's columns are fed in chunks of ``chunk`` columns (all of them at once when None). A
   runtime whose chunk width is static pads a short last chunk at its *front* (id 0, position -1), so the real
   columns end the chunk and its last column is the prompt's last token (:meth:`CachePlan.chunks`).
2b. Ragged last chunk: with ``ragged_last`` (a graph runtime whose last-chunk graph takes its column axis as a
   dynamic dimension) the prompt's last chunk is fed at its real width, without the padding columns, when it has at
   least 2 real columns and does not compact (:meth:`CachePlan.ragged`): the same real columns at the same
   positions, so the same rows and logits, without computing the padding. A last chunk that compacts keeps the
   static width (the compaction graphs take C columns).
3. A chunk's candidates are the occupied slots followed by the chunk's real columns; padding columns are never
   candidates (never kept, never attended, never observing). When ``fill_i + n_real > budget_i`` the press
   scores the candidates and the best ``budget_i`` are kept, in candidate order, in slots [0, budget_i);
   otherwise all of them are. Then ``fill_i = min(fill_i + n_real, budget_i)``. The chunk's queries observe
   (the prefill never writes the query ring). Without a press there is no budget: a chunk that does not fit the
   capacity is refused (:class:`CacheFull`).
4. Decode: the token goes to slot ``fill_i`` of every layer and its query to ring slot ``step % window``
   (``step`` = decode steps since the prefill); then ``fill_i += 1``.
5. Compaction: when a decode step leaves any layer full (``fill_i == cap_i``), every layer is compacted: the
   candidates are its occupied slots, the observation is the query ring read oldest first. At least ``window``
   decode steps separate a compaction from the prefill and from the previous one (``fill_i <= budget_i``
   after either), so the ring then holds exactly the last ``window`` decoded queries. ``fill_i = min(fill_i,
   budget_i)``. Without a press a full cache refuses the next token (:class:`CacheFull`).
6. What a press sees: the candidates in *press order*: invalid entries (empty slots, padding columns) first,
   then the valid ones in candidate order. So the last candidates are always the newest real tokens, and the
   observation queries' real entries are their last ones and belong to the last candidates. Scores are rotated
   back to candidate order, where entries of position -1 score -inf and ties go to the lower index (ONNX
   ``TopK``'s rule; :func:`kvexport.cache.candidates.select_kept`). Presses must score a valid candidate the same
   whatever invalid entries precede it (tests/presses check every registered press for that).
3b. Lookahead observation (``lookahead`` L > 0, evicting caches): a chunk that is not the prompt's last is fed with
   the prompt's last columns after it (at most L: ``[max(stop, N - L), N)``, its *tail*; a static width front-pads
   the tail to L), placed at their true positions. The tail attends to the occupied slots, the chunk and itself
   (causal by position); its rows are never stored; when the chunk compacts, the tail's queries observe it instead
   of the chunk's own (the question at the end of a prompt says what to keep long before its chunk arrives). The
   last chunk observes itself. Observers that are not candidates force nothing to be kept (rule 6 below applies to
   a chunk's own queries).
7. Buckets: a full cache whose graphs take the capacity axis as a dynamic dimension (``bucketed``) is held in
   :func:`bucket_slots` slots for the rows it must hold: the smallest power of two >= the rows, at least
   :data:`MIN_BUCKET`, at most the capacity. A prompt is fed into the bucket of its columns; a token that does
   not fit doubles the bucket (the filled slots are copied once). Empty slots have position -1, so a step
   attends over at most twice the filled slots, not the capacity. Static-budget caches keep their capacity (7b).
7b. Read buckets: an evicting cache whose reading graphs (prefill chunks and decode steps, not the compactions)
   take the capacity axis as a dynamic dimension (``read_buckets``; one budget for every layer) hands each call only
   the first :meth:`CachePlan.read_slots` slots of every layer: the bucket (rule 7's sizes) of the most slots any
   layer (any decoding row) has occupied before the call, when that bucket is at most half the capacity; else the
   whole capacity (a copy would save too little). The slots after it are empty (rules 3-5 keep the occupied ones
   in [0, fill)), so the call's real queries see what they would over the whole capacity, while it reads O(filled)
   slots, not O(capacity). A host whose buffers may move (one batch of sequences) holds them in that bucket
   (:meth:`CachePlan.slots_for`; grown as in rule 7, the filled slots copied once, to the capacity before a
   compaction), so a call reads its buffers whole and a decode step binds them once; a server's bank of slots
   (row views of one buffer) keeps the capacity and hands each call a copy of the bucket. Compactions read the
   whole capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from kvexport.errors import BadUsage

#: rule 7: the fewest slots a bucketed full cache holds
MIN_BUCKET = 256
#: rules 4 and 5: decode slots (and observation queries) an evicting cache keeps beside its budget, unless told
DEFAULT_WINDOW = 32


def capacities(budgets, window: int) -> tuple[int, ...]:
    """Slots per layer of an evicting cache: its budget plus ``window`` decode slots (rules 4 and 5)."""
    return tuple(int(b) + int(window) for b in budgets)


def bucket_slots(rows: int, capacity: int, floor: int = MIN_BUCKET) -> int:
    """Rule 7. Slots a bucketed full cache of ``capacity`` slots holds for ``rows`` tokens: the smallest power of
    two >= max(rows, floor), at most ``capacity``."""
    need = max(int(rows), int(floor), 1)
    return min(int(capacity), 1 << (need - 1).bit_length())


class CacheFull(BadUsage):
    """A full-cache (press-free) static cache cannot take the next token."""


def positions_from_mask(attention_mask) -> np.ndarray:
    """Rule 1. attention_mask (B, N) 0/1, left padded -> positions (B, N) int64, -1 on padding."""
    m = np.asarray(attention_mask).astype(np.int64)
    return np.where(m.astype(bool), np.cumsum(m, axis=-1) - 1, -1)


def next_positions(positions) -> np.ndarray:
    """Rule 1. positions (B, N) -> (B,) position of each row's next token."""
    return np.asarray(positions).max(axis=1).astype(np.int64) + 1


def ring_order(start: int, window: int) -> list[int]:
    """Rule 5. Ring slots oldest first when the oldest entry sits at ``start``."""
    return [(start + i) % window for i in range(window)]


@dataclass(frozen=True)
class Chunk:
    """Prompt columns [start, stop) fed as one chunk, preceded by ``pad`` padding columns (static width only); its
    lookahead tail (rule 3b) is columns [tail_start, tail_stop) after ``tail_pad`` padding columns (none: empty)."""

    start: int
    stop: int
    pad: int = 0
    tail_start: int = 0
    tail_stop: int = 0
    tail_pad: int = 0

    @property
    def has_tail(self) -> bool:
        return self.tail_stop > self.tail_start

    @property
    def n_real(self) -> int:
        return self.stop - self.start

    @property
    def width(self) -> int:
        return self.pad + self.n_real


@dataclass(frozen=True)
class CachePlan:
    """The static shape of a cache: per-layer ``budgets``, the decode ``window``, whether a press compacts.

    ``evicting=False``: a full cache, ``budgets`` are then the capacities and ``window`` is 0.
    ``chunk``: the prefill chunk width (None = the caller feeds the prompt at once); ``static_chunk``: the
    width is fixed (graphs), so a short last chunk is front-padded to it (rule 2). ``bucketed``: a full cache
    held in buckets of :meth:`slots_for` slots (rule 7). ``lookahead``: tail columns observing each earlier chunk
    (rule 3b; 0 = a chunk observes itself). ``read_buckets``: an evicting cache's prefill chunks and decode steps
    read only the bucket of the occupied slots (rule 7b). ``ragged_last``: a prompt's last chunk may be fed at its
    real width (rule 2b).
    """

    budgets: tuple[int, ...]
    window: int
    evicting: bool
    chunk: int | None = None
    static_chunk: bool = False
    bucketed: bool = False
    lookahead: int = 0
    read_buckets: bool = False
    ragged_last: bool = False

    def __post_init__(self):
        if not self.budgets or min(self.budgets) < 1:
            raise BadUsage(f"budgets {list(self.budgets)} must be >= 1 per layer")
        if self.evicting and self.window < 1:
            raise BadUsage(f"window {self.window} must be >= 1 when a press evicts")
        if self.chunk is not None and self.chunk < 1:
            raise BadUsage(f"chunk {self.chunk} must be >= 1")
        if self.lookahead < 0 or (self.lookahead and not self.evicting):
            raise BadUsage(f"lookahead {self.lookahead} must be >= 0, and only an evicting cache observes")
        if self.bucketed and (self.evicting or len(set(self.budgets)) > 1):
            raise BadUsage("only a full cache with one capacity for every layer is held in buckets")
        if self.read_buckets and (not self.evicting or len(set(self.budgets)) > 1):
            raise BadUsage("only an evicting cache with one budget for every layer reads in buckets")

    @classmethod
    def for_press(cls, evicting: bool, budgets, window: int, chunk: int | None = None,
                  lookahead: int = 0) -> "CachePlan":
        """The plan of a cache made with or without a press: ``budgets`` kept and ``window`` decode slots (evicting),
        or a full cache of ``budgets + window`` slots that never evicts (its window then 0). ``lookahead``: the
        prompt's last columns that observe each earlier chunk (rule 3b; evicting only, ignored without a press)."""
        budgets = tuple(int(b) for b in budgets)
        if evicting:
            return cls(budgets, int(window), True, chunk, lookahead=int(lookahead))
        return cls(capacities(budgets, window), 0, False, chunk)

    @classmethod
    def from_settings(cls, settings: dict) -> "CachePlan":
        """The plan of a static export (manifest ``settings``)."""
        evicting = settings.get("press") is not None
        budgets = settings["budgets"] if evicting else settings["capacities"]
        return cls(tuple(int(b) for b in budgets), int(settings["window"]) if evicting else 0, evicting,
                   int(settings["chunk"]), static_chunk=True, bucketed=bool(settings.get("dynamic_capacity")),
                   lookahead=int(settings.get("lookahead") or 0),
                   read_buckets=bool(settings.get("read_buckets")), ragged_last=bool(settings.get("ragged_last")))

    @property
    def num_layers(self) -> int:
        return len(self.budgets)

    @property
    def capacities(self) -> tuple[int, ...]:
        return capacities(self.budgets, self.window)

    @property
    def held_in_buckets(self) -> bool:
        """Whether a host whose buffers may move holds them in :meth:`slots_for` slots (rules 7 and 7b)."""
        return self.bucketed or self.read_buckets

    def slots_for(self, rows: int) -> int:
        """Rules 7 and 7b. Slots per layer held for ``rows`` tokens: the bucket (a bucketed full cache; an evicting
        cache read in buckets while that bucket is at most half its capacity), else the capacity."""
        cap = min(self.capacities)
        if self.bucketed:
            return bucket_slots(rows, cap)
        if self.read_buckets:
            n = bucket_slots(rows, cap)
            return n if 2 * n <= cap else cap
        return cap

    def read_slots(self, fills) -> int | None:
        """Rule 7b. Slots per layer a prefill chunk or decode step reads when the layers (rows) hold ``fills`` tokens
        before it: the bucket of the most of them when it is at most half the capacity, else None (every layer's
        whole capacity)."""
        if not self.read_buckets:
            return None
        cap = min(self.capacities)
        n = bucket_slots(max(fills, default=0), cap)
        return n if 2 * n <= cap else None

    def ragged(self, chunk: Chunk, n_columns: int, step: "PrefillStep") -> bool:
        """Rule 2b. Whether ``chunk`` of a prompt of ``n_columns`` columns is fed at its real width: the last chunk,
        padded, with at least 2 real columns, when ``step`` (its :meth:`CacheState.prefill`) does not compact."""
        return (self.ragged_last and chunk.stop >= n_columns and chunk.pad > 0 and chunk.n_real >= 2
                and not step.any_compaction)

    def chunks(self, n_columns: int) -> list[Chunk]:
        """Rule 2. How a prompt of ``n_columns`` columns is fed."""
        if n_columns < 1:
            raise BadUsage("the prompt is empty; give at least one token")
        C = int(self.chunk or n_columns)
        out = [Chunk(s, min(s + C, n_columns)) for s in range(0, n_columns, C)]
        if self.static_chunk and out[-1].n_real < C:
            out[-1] = Chunk(out[-1].start, out[-1].stop, C - out[-1].n_real)
        L = int(self.lookahead)
        if L:  # rule 3b: every chunk but the last is observed by the prompt's last columns after it
            out = [replace(c, tail_start=max(c.stop, n_columns - L), tail_stop=n_columns,
                           tail_pad=L - (n_columns - max(c.stop, n_columns - L)) if self.static_chunk else 0)
                   if c.stop < n_columns else c for c in out]
        return out

    def check_fits(self, n_columns: int, new_tokens: int = 0) -> None:
        """A full cache (no press) holds at most its capacity: the prompt plus ``new_tokens`` must fit."""
        if not self.evicting and n_columns + new_tokens > min(self.capacities):
            raise CacheFull(f"prompt ({n_columns} tokens) + {new_tokens} new tokens do not fit this full cache's "
                            f"capacity {min(self.capacities)}; export with a larger --max-positions or a press")


@dataclass(frozen=True)
class PrefillStep:
    """One chunk: ``fills`` before it (what a graph takes), whether each layer compacts, ``n_real`` columns."""

    fills: tuple[int, ...]
    compacts: tuple[bool, ...]
    n_real: int

    @property
    def any_compaction(self) -> bool:
        return any(self.compacts)


@dataclass(frozen=True)
class DecodeStep:
    """One decode step: ``slots`` per layer (= fills before it), the query ring slot, whether a compaction follows
    (and the fills it sees)."""

    slots: tuple[int, ...]
    query_slot: int
    compact: bool
    fills_after: tuple[int, ...]


@dataclass
class CacheState:
    """The bookkeeping of one batch of sequences under a :class:`CachePlan`; changed only by these methods."""

    plan: CachePlan
    fills: list[int] = field(default_factory=list)
    steps: int = 0  # decode steps since the prefill
    compactions: int = 0

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.fills = [0] * self.plan.num_layers
        self.steps = 0
        self.compactions = 0

    def load(self, fills) -> None:
        """A cache already holding ``fills`` tokens per layer, as a prefill leaves it (at most each budget): a
        benchmark's synthesised cache starts decoding from here."""
        fills = [int(f) for f in fills]
        if len(fills) != self.plan.num_layers or any(f < 0 or f > b for f, b in zip(fills, self.plan.budgets,
                                                                                  strict=True)):
            raise BadUsage(f"fills {fills} do not fit the budgets {list(self.plan.budgets)}")
        self.reset()
        self.fills = fills

    def prefill(self, n_real: int) -> PrefillStep:
        """Rule 3, for a chunk of ``n_real`` real columns."""
        if self.steps:
            raise BadUsage("a prefill chunk after decode steps; reset the cache for a new prompt")
        p = self.plan
        if not p.evicting:
            if any(f + n_real > c for f, c in zip(self.fills, p.capacities, strict=True)):
                raise CacheFull(f"a chunk of {n_real} tokens does not fit: {max(self.fills)} of "
                                f"{min(p.capacities)} slots used; export with a larger --max-positions or a press")
            step = PrefillStep(tuple(self.fills), (False,) * p.num_layers, n_real)
            self.fills = [f + n_real for f in self.fills]
            return step
        compacts = tuple(f + n_real > b for f, b in zip(self.fills, p.budgets, strict=True))
        step = PrefillStep(tuple(self.fills), compacts, n_real)
        self.fills = [min(f + n_real, b) for f, b in zip(self.fills, p.budgets, strict=True)]
        if step.any_compaction:
            self.compactions += 1
        return step

    def decode(self) -> DecodeStep:
        """Rule 4 (and whether rule 5 follows)."""
        p = self.plan
        caps = p.capacities
        if any(f >= c for f, c in zip(self.fills, caps, strict=True)):  # only a press-free cache gets here
            raise CacheFull(f"the cache is full ({min(caps)} slots): a full-cache export holds at most its "
                            "capacity; export with a larger --max-positions or a press")
        slots = tuple(self.fills)
        q = self.steps % p.window if p.window else 0
        self.fills = [f + 1 for f in self.fills]
        self.steps += 1
        compact = p.evicting and any(f >= c for f, c in zip(self.fills, caps, strict=True))
        return DecodeStep(slots, q, compact, tuple(self.fills))

    def compact(self) -> tuple[int, ...]:
        """Rule 5: the fills the compaction sees; afterwards every layer holds at most its budget."""
        seen = tuple(self.fills)
        self.fills = [min(f, b) for f, b in zip(self.fills, self.plan.budgets, strict=True)]
        self.compactions += 1
        return seen

    @property
    def query_start(self) -> int:
        """Rule 5: the ring slot of the oldest observation query."""
        return self.steps % self.plan.window if self.plan.window else 0

    def query_order(self) -> list[int]:
        return ring_order(self.query_start, self.plan.window)


__all__ = ["CachePlan", "CacheState", "CacheFull", "Chunk", "PrefillStep", "DecodeStep", "positions_from_mask",
           "next_positions", "ring_order", "bucket_slots", "capacities", "MIN_BUCKET", "DEFAULT_WINDOW"]
