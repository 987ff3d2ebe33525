# SPDX-License-Identifier: Apache-2.0
"""Lookahead observation (kvexport.cache.plan rule 3b): the prompt's last columns observe every earlier chunk.

- the plan's tails, by hand;
- a chunk observed by its tail keeps what SnapKV keeps when the tail's queries and the chunk's keys come from
  transformers itself (the chunk and the tail run as one sequence with explicit position ids, the tail's
  queries read from q_proj, the keys from transformers' own cache): the tail attends to the chunk, the chunk not
  to the tail, and the tail's rows are never stored;
- nothing of the window is kept for being an observer when the observers are not candidates;
- the one loop (kvexport.runtime.loop.Stream) hands each earlier chunk its tail, front-padded to a static width.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.cache.plan import CachePlan, Chunk
from kvexport.errors import BadUsage
from kvexport.presses import make_press
from kvexport.presses.base import ScoreInputs


def test_tails_by_hand():
    p = CachePlan((100,), 8, True, 64, static_chunk=True, lookahead=16)
    assert p.chunks(150) == [Chunk(0, 64, 0, 134, 150, 0), Chunk(64, 128, 0, 134, 150, 0), Chunk(128, 150, 42)]
    p = CachePlan((100,), 8, True, 64, lookahead=16)  # the PyTorch path: no padding, the tail after the chunk only
    assert p.chunks(130) == [Chunk(0, 64, 0, 114, 130, 0), Chunk(64, 128, 0, 128, 130, 0), Chunk(128, 130)]
    p = CachePlan((100,), 8, True, 64, static_chunk=True, lookahead=16)
    assert p.chunks(130)[1] == Chunk(64, 128, 0, 128, 130, 14)  # a short tail is front-padded in a graph
    assert CachePlan((100,), 8, True, None, lookahead=16).chunks(90) == [Chunk(0, 90)]  # one chunk: itself
    with pytest.raises(BadUsage, match="only an evicting cache observes"):
        CachePlan((100,), 0, False, 64, lookahead=16)


def _hf_tail_observation(hf, ids, chunk_stop: int, tail: slice):
    """transformers on [chunk ; tail] at their true positions: per layer the tail's pre-RoPE queries (B, Hq, L, D)
    and the chunk's post-RoPE keys and values (B, Hkv, C, D)."""
    B = ids.shape[0]
    seq = torch.cat([ids[:, :chunk_stop], ids[:, tail]], 1)
    pos = torch.cat([torch.arange(chunk_stop), torch.arange(tail.start, tail.stop)])[None].expand(B, -1)
    qs = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o, n=n: qs.__setitem__(n, o))
             for n, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            out = hf(seq, position_ids=pos, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    cfg = hf.config
    D = cfg.hidden_size // cfg.num_attention_heads
    res = []
    for n, layer in enumerate(out.past_key_values.layers):
        q = qs[n].view(B, -1, cfg.num_attention_heads, D).transpose(1, 2)[:, :, chunk_stop:]
        res.append((q, layer.keys[:, :, :chunk_stop], layer.values[:, :, :chunk_stop]))
    return res


def test_tail_observes_as_transformers_computes_it(tiny_models):
    from kvexport.generation import generate
    from kvexport.models.decoder import Decoder

    hf = tiny_models("llama")
    dec = Decoder.from_hf(hf)
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(11))
    budget, chunk, look = 20, 32, 8
    press = make_press("snapkv", budget=budget, window_size=8)
    r = generate(dec, ids, press=press, window=4, chunk=chunk, max_new_tokens=1, track_kept=True, lookahead=look)
    assert r.compaction_steps[0] == "prefill:0"
    ours = [kp[0, :, :budget] for kp in r.kept_positions[0]]  # per layer (Hkv, budget) after chunk 0
    for n, (q, k, v) in enumerate(_hf_tail_observation(hf, ids, chunk, slice(48 - look, 48))):
        attn = dec.layers[n].self_attn
        inputs = ScoreInputs(keys=k, values=v, positions=torch.arange(chunk).expand(1, k.shape[1], chunk),
                             queries=q, query_positions=torch.arange(48 - look, 48)[None], rotary=attn.rotary,
                             scaling=attn.scaling, layer_idx=n, num_layers=2, n_keep=budget,
                             observers_are_candidates=False)
        scores = press.keep_scores(inputs)[0]  # (Hkv, C)
        ref = torch.sort(torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :budget], dim=-1).values
        assert torch.equal(ours[n], ref), n
        assert int(ours[n].max()) < chunk  # the tail is never stored
    # observed by the chunk itself, the window (its last 8 tokens) would always be kept; by the tail it is not
    own = generate(dec, ids, press=press, window=4, chunk=chunk, max_new_tokens=1, track_kept=True)
    assert all(set(range(24, 32)) <= set(kp[0, h, :budget].tolist())
               for kp in own.kept_positions[0] for h in range(kp.shape[1]))
    assert any(not set(range(24, 32)) <= set(o[h].tolist()) for o in ours for h in range(o.shape[0]))


def test_lookahead_needs_a_press_and_a_prefill(tiny_models):
    from kvexport.models.decoder import Decoder

    dec = Decoder.from_hf(tiny_models("llama"))
    ids = torch.randint(3, 128, (1, 8))
    cache = dec.new_cache(1, None, 16, 0)
    with pytest.raises(BadUsage, match="lookahead tail observes a prefill chunk of an evicting cache"):
        dec(ids, torch.arange(8)[None], cache, tail_ids=ids[:, -2:], tail_positions=torch.arange(8, 10)[None])


class _Recorder:
    """A step driver that records what the one loop feeds it (kvexport.runtime.protocol)."""

    batch = 2

    def __init__(self, plan):
        self.plan, self.fed = plan, []

    def start(self, mask, new_tokens):
        pass

    def prefill_chunk(self, ids, positions, chunk, tail=None):
        self.fed.append((ids, positions, tail))
        return np.zeros((2, 4)), False


def test_the_loop_feeds_each_earlier_chunk_its_tail():
    """runtime.loop.Stream: chunks and tails at the plan's columns, front-padded (id 0, position -1) to a static
    width; the last chunk has none; a left-padded row's tail holds its true positions."""
    from kvexport.runtime.loop import Stream

    ids = np.arange(100, 130).reshape(1, 30).repeat(2, 0)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    rec = _Recorder(CachePlan((8,), 2, True, 12, static_chunk=True, lookahead=8))
    Stream(rec, ids, mask).prefill()
    (ids0, pos0, tail0), (ids1, pos1, tail1), (ids2, pos2, tail2) = rec.fed
    np.testing.assert_array_equal(tail0[0], ids[:, 22:30])  # chunk [0, 12): the last 8 columns
    np.testing.assert_array_equal(tail0[1], [list(range(22, 30)), list(range(18, 26))])
    np.testing.assert_array_equal(tail1[0][:, :2], 0)  # chunk [12, 24): the columns after it, [24, 30), padded to 8
    np.testing.assert_array_equal(tail1[0][:, 2:], ids[:, 24:30])
    np.testing.assert_array_equal(tail1[1], [[-1, -1, *range(24, 30)], [-1, -1, *range(20, 26)]])
    assert tail2 is None and ids2.shape == (2, 12) and (pos2[:, :6] == -1).all()  # the last chunk observes itself
