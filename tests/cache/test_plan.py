# SPDX-License-Identifier: Apache-2.0
"""The cache rules (kvexport.cache.plan) against hand-worked examples, and the shared compaction orders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.cache.candidates import keep_best, orders, select_kept
from kvexport.cache.plan import CacheFull, CachePlan, CacheState, Chunk, next_positions, positions_from_mask, ring_order
from kvexport.errors import BadUsage


def test_positions_and_next_positions():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = positions_from_mask(mask)
    assert pos.tolist() == [[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert next_positions(pos).tolist() == [3, 5]


@pytest.mark.parametrize("n,chunk,static,want", [
    (10, 4, True, [Chunk(0, 4), Chunk(4, 8), Chunk(8, 10, 2)]),  # the last chunk padded at its front
    (10, 4, False, [Chunk(0, 4), Chunk(4, 8), Chunk(8, 10)]),
    (8, 4, True, [Chunk(0, 4), Chunk(4, 8)]),
    (3, 8, True, [Chunk(0, 3, 5)]),
    (5, None, False, [Chunk(0, 5)]),
    (1, 1, True, [Chunk(0, 1)]),
])
def test_chunks(n, chunk, static, want):
    got = CachePlan((4,), 2, True, chunk, static_chunk=static).chunks(n)
    assert got == want
    assert all(c.width == (chunk if static else c.n_real) for c in got)


def test_prefill_fills_and_compactions():
    """budget 5, window 2: 3 + 3 real columns -> compacts on the second chunk; padding never counts."""
    st = CacheState(CachePlan((5, 3), 2, True, 3, static_chunk=True))
    a = st.prefill(3)
    assert a.fills == (0, 0) and a.compacts == (False, False) and st.fills == [3, 3]
    b = st.prefill(2)  # a padded last chunk: 2 real columns of 3
    assert b.fills == (3, 3) and b.compacts == (False, True) and st.fills == [5, 3]
    assert st.compactions == 1
    st.decode()
    with pytest.raises(BadUsage):
        st.prefill(1)  # a prefill after decode steps is refused


def test_decode_ring_and_compaction():
    """budgets (3, 2) + window 2: layer 1 fills first and every layer compacts together."""
    st = CacheState(CachePlan((3, 2), 2, True))
    st.prefill(2)  # fills (2, 2)
    d0 = st.decode()
    assert d0.slots == (2, 2) and d0.query_slot == 0 and not d0.compact
    d1 = st.decode()
    assert d1.slots == (3, 3) and d1.query_slot == 1 and d1.compact and d1.fills_after == (4, 4)
    assert st.query_start == 0 and st.query_order() == [0, 1]
    assert st.compact() == (4, 4) and st.fills == [3, 2]
    d2 = st.decode()
    assert d2.slots == (3, 2) and d2.query_slot == 0 and not d2.compact
    d3 = st.decode()
    assert d3.compact and st.query_start == 0
    st.compact()
    d4 = st.decode()
    assert d4.query_slot == 0 and st.query_start == 1 and ring_order(1, 2) == [1, 0]
    assert st.compactions == 2


def test_full_cache_refuses_what_does_not_fit():
    plan = CachePlan((6,), 0, False, 4, static_chunk=True)
    st = CacheState(plan)
    plan.check_fits(5, 1)
    with pytest.raises(CacheFull):
        plan.check_fits(5, 2)
    st.prefill(4)
    st.prefill(2)
    with pytest.raises(CacheFull):
        st.decode()
    st.reset()
    with pytest.raises(CacheFull):
        st.prefill(7)


@pytest.mark.parametrize("fills,want", [([0, 0], 256), ([255, 256], 256), ([257, 100], None), ([600, 600], None)])
def test_read_slots_are_the_bucket_of_the_most_filled_layer(fills, want):
    """Rule 7b: budget 600 + window 16 = 616 slots; a call reads the power of two >= max(fills, 256) while it is at
    most half of 616, else all 616 (None: every layer's whole capacity)."""
    plan = CachePlan((600, 600), 16, True, 96, static_chunk=True, read_buckets=True)
    assert plan.read_slots(fills) == want
    assert CachePlan((600, 600), 16, True, 96, static_chunk=True).read_slots(fills) is None  # not bucketed
    assert CachePlan((600, 900), 16, True, 96).read_slots([0, 0]) is None  # per-layer budgets: never
    assert CachePlan((1100,) * 2, 16, True, 96, read_buckets=True).read_slots([257]) == 512  # 512 <= 1116 / 2


def test_ragged_last_chunk_only_when_it_does_not_compact():
    """Rule 2b: chunk 96, budget 600: the last chunk of 100 columns (4 real) runs at its width; of 97 (1 real), of
    900 (it compacts) and without ragged_last, at the chunk's."""
    plan = CachePlan((600,), 16, True, 96, static_chunk=True, ragged_last=True)

    def last_ragged(p, n):
        state, chunks = CacheState(p), p.chunks(n)
        for c in chunks[:-1]:
            state.prefill(c.n_real)
        return p.ragged(chunks[-1], n, state.prefill(chunks[-1].n_real))

    assert last_ragged(plan, 100) and last_ragged(plan, 50)
    assert not last_ragged(plan, 97) and not last_ragged(plan, 900) and not last_ragged(plan, 192)
    assert not last_ragged(CachePlan((600,), 16, True, 96, static_chunk=True), 100)


def test_read_buckets_need_an_evicting_cache_with_one_budget():
    with pytest.raises(BadUsage, match="one budget"):
        CachePlan((400, 300), 16, True, 96, read_buckets=True)
    with pytest.raises(BadUsage, match="one budget"):
        CachePlan((400, 400), 0, False, 96, read_buckets=True)


def test_orders_put_invalid_entries_first_for_the_press_and_last_for_the_keep():
    """cache of 5 slots, 2 occupied; 4 columns, the first one padding."""
    o = orders(2, 1, 5, 4)
    # raw: slots 0..4 (0-1 occupied, 2-4 empty), columns 5..8 (5 padding, 6-8 real)
    assert o.press.tolist() == [2, 3, 4, 5, 0, 1, 6, 7, 8]
    assert o.kept.tolist() == [0, 1, 6, 7, 8, 2, 3, 4, 5]
    assert orders(3, 0, 3, 2) is None  # the PyTorch cache: nothing empty, nothing padded


class _Keep:
    """A press scoring by a fixed per-position table, blind to the layout (ties: equal entries)."""

    name = "table"

    def __init__(self, table):
        self.table = table

    def score(self, inputs):
        return torch.tensor([[[self.table.get(int(p), 0.0) for p in inputs.positions[0, 0]]]])


def _make(k, v, pos, q, qp):
    from kvexport.presses.base import ScoreInputs

    return ScoreInputs(keys=k, values=v, positions=pos, queries=q, query_positions=qp, rotary=None, scaling=1.0,
                       layer_idx=0, num_layers=1, n_keep=3)


def test_keep_best_same_kept_set_padded_or_not():
    """The graph layout (empty slots, front padding) and the PyTorch layout keep the same tokens in the same order."""
    table = {0: 5.0, 1: 1.0, 2: 4.0, 3: 3.0, 4: 2.0}
    press = _Keep(table)
    # PyTorch: 2 occupied (positions 0, 1) + 3 new (2, 3, 4)
    pos_t = torch.tensor([[[0, 1, 2, 3, 4]]])
    k_t = pos_t[..., None].float()
    a = keep_best(press, _make, k_t, k_t, pos_t, None, None, 5, 0, 5, 3, 3)
    # graph: 4 slots (2 occupied, 2 empty) + 5 columns (2 padding, 3 real)
    pos_g = torch.tensor([[[0, 1, -1, -1, -1, -1, 2, 3, 4]]])
    k_g = pos_g[..., None].float()
    b = keep_best(press, _make, k_g, k_g, pos_g, None, None, torch.tensor(2), torch.tensor(2), 4, 3, 5)
    assert a[2][0, 0].tolist() == [0, 2, 3]
    assert b[2][0, 0].tolist() == [0, 2, 3, -1, -1]
    torch.testing.assert_close(b[0][0, 0, :3], a[0][0, 0])


def test_select_kept_ties_go_to_the_lower_index():
    scores = torch.tensor([[[1.0, 2.0, 2.0, 2.0, 0.0]]])
    pos = torch.tensor([[[0, 1, 2, -1, 3]]])
    assert select_kept(scores, pos, 2).tolist() == [[[1, 2]]]
    assert select_kept(scores, pos, 4).tolist() == [[[0, 1, 2, 4]]]  # an invalid entry only after every valid one
