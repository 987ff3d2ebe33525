# SPDX-License-Identifier: Apache-2.0
"""The static-budget cache driven by every press (one parametrized list, the same checks for all).

References: the HF model / our decoder with a cache that never evicts (before any eviction the logits
must match it), the same row run alone (left padding must change nothing), layer-0 keys recomputed from
the tokens (kept keys keep the RoPE of their true position), and set arithmetic on positions.
"""

from __future__ import annotations

import pytest
import torch

from kvexport.generation import generate
from kvexport.models.decoder import Decoder
from tests.cache._drive import positions_from_mask, prefill
from tests.cache._presses import ALL_PRESSES, BUDGET, PER_ROW, WINDOW, build_press


@pytest.fixture(scope="module")
def model(tiny_models):
    hf = tiny_models("llama")
    return hf, Decoder.from_hf(hf)


def prompt(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def layer0_keys(dec: Decoder, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, N, D) post-RoPE layer-0 keys: they depend only on the token and its position."""
    layer = dec.layers[0]
    _, k, _ = layer.self_attn.project(layer.input_layernorm(dec.embed_tokens(ids)), positions)
    return k


def check_kept(snapshot: list[torch.Tensor], budgets: list[int], n_tokens) -> None:
    """Right after a compaction (snapshot: per layer positions (B, Hkv, fill)): exactly
    min(budget, tokens so far) valid slots per (batch, head), positions strictly increasing."""
    n_tokens = torch.as_tensor(n_tokens).reshape(-1)
    for pos, budget in zip(snapshot, budgets, strict=True):
        for b in range(pos.shape[0]):
            want = min(budget, int(n_tokens[b if n_tokens.numel() > 1 else 0]))
            for h in range(pos.shape[1]):
                p = pos[b, h][pos[b, h] >= 0]
                assert p.numel() == want
                assert (p[1:] > p[:-1]).all()


@pytest.mark.parametrize("name", ALL_PRESSES)
@torch.no_grad()
def test_shape_and_memory_constant_over_500_steps(model, name):
    """500 decode steps after a 40-token prompt: buffers never move or grow; every compaction keeps
    exactly ``budget`` valid slots per head in strictly increasing position order."""
    _, dec = model
    ids = prompt(40)
    press = build_press(name, dec, ids)
    budgets = press.layer_budgets(dec.spec.num_layers, 40)
    cache = dec.new_cache(1, press, budgets, WINDOW)
    buffers = [(lc.k.data_ptr(), lc.v.data_ptr(), lc.pos.data_ptr(), lc.k.shape, lc.qbuf.shape) for lc in cache.layers]
    nbytes = cache.nbytes()
    logits = prefill(dec, cache, ids, torch.arange(40)[None])
    check_kept(cache.kept_positions(), budgets, 40)
    tok = logits[:, -1].argmax(-1)
    for step in range(500):
        before = cache.compactions
        logits = dec(tok[:, None], torch.tensor([[40 + step]]), cache, mode="decode")
        tok = logits[:, -1].argmax(-1)
        if cache.compactions != before:
            check_kept(cache.kept_positions(), budgets, 41 + step)
        assert [(lc.k.data_ptr(), lc.v.data_ptr(), lc.pos.data_ptr(), lc.k.shape, lc.qbuf.shape)
                for lc in cache.layers] == buffers
        assert all(lc.fill <= lc.capacity for lc in cache.layers)
    assert cache.nbytes() == nbytes
    assert cache.compactions == 500 // WINDOW + 1  # one at the prefill (40 tokens > budget), then every WINDOW steps
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("n", [1, BUDGET - 7, BUDGET, BUDGET + 13], ids=["1", "lt_budget", "eq_budget", "gt_budget"])
@pytest.mark.parametrize("name", ALL_PRESSES)
@torch.no_grad()
def test_prompt_lengths(model, name, n):
    """The prompt logits equal HF's; until the first eviction every step's logits equal the never-evicting
    decoder's; the prefill keeps min(n, budget) tokens (all of them when n <= budget); after each of the
    compactions in 40 decode steps every layer holds exactly its budget."""
    hf, dec = model
    ids = prompt(n, seed=n)
    press = build_press(name, dec, ids)
    budgets = press.layer_budgets(dec.spec.num_layers, n)
    cache = dec.new_cache(1, press, budgets, WINDOW)
    prefill(dec, cache, ids, torch.arange(n)[None])
    check_kept(cache.kept_positions(), budgets, n)
    if n <= min(budgets):
        assert all(torch.equal(p[0, 0][p[0, 0] >= 0], torch.arange(n)) for p in cache.kept_positions())
    press = build_press(name, dec, ids)
    res = generate(dec, ids, press=press, window=WINDOW, max_new_tokens=40, keep_logits=True, track_kept=True)
    full = generate(dec, ids, press=None, max_new_tokens=40, keep_logits=True)
    torch.testing.assert_close(res.prompt_logits, hf(ids).logits[:, -1], atol=1e-4, rtol=1e-4)
    if n <= min(budgets):
        torch.testing.assert_close(res.prompt_logits, full.prompt_logits, atol=1e-5, rtol=1e-5)
        # no eviction before the cache first fills: budget + window - n decode steps
        safe = min(budgets) + WINDOW - n - 1
        for a, b in zip(res.step_logits[:safe], full.step_logits[:safe], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert res.compactions >= 1 and len(res.kept_positions) == res.compactions
    for snap in res.kept_positions:
        check_kept(snap, budgets, int(max(p.max() for p in snap)) + 1)


def padded_batch(lens: list[int], seed: int = 10) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Left-padded rows of distinct tokens: a repeated token has, in layer 0, the same key norm at both positions
    (Knorm's exact tie in real arithmetic), which a batched and a solo run may round apart (kvexport.export.ties)."""
    rows = [torch.randperm(128, generator=torch.Generator().manual_seed(seed + i))[:n] for i, n in enumerate(lens)]
    N = max(lens)
    ids = torch.zeros(len(lens), N, dtype=torch.long)
    mask = torch.zeros(len(lens), N, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, N - len(r):] = r
        mask[i, N - len(r):] = 1
    return rows, ids, mask


@pytest.mark.parametrize("name", ALL_PRESSES)
@torch.no_grad()
def test_left_padding_batch_of_three(model, name):
    """Rows of 40, 33 and 27 tokens (all above the budget), left padded: padding is never kept; for
    per-row presses each row keeps the same positions after every compaction and produces the same
    tokens and logits as when run alone."""
    _, dec = model
    lens = [40, 33, 27]
    rows, ids, mask = padded_batch(lens)
    press = build_press(name, dec, ids, mask)
    res = generate(dec, ids, mask, press=press, window=WINDOW, max_new_tokens=30, keep_logits=True, track_kept=True)
    assert res.compactions >= 3
    budgets = press.layer_budgets(dec.spec.num_layers, max(lens))
    for snap in res.kept_positions:
        check_kept(snap, budgets, torch.stack([p.amax(dim=(1, 2)) for p in snap]).amax(0) + 1)
    if name not in PER_ROW:
        return
    for i, r in enumerate(rows):
        alone = generate(dec, r[None], press=build_press(name, dec, r[None]), window=WINDOW, max_new_tokens=30,
                         keep_logits=True, track_kept=True)
        assert torch.equal(alone.tokens[0], res.tokens[i])
        for a, b in zip(alone.step_logits, res.step_logits, strict=True):
            torch.testing.assert_close(a[0], b[i], atol=1e-4, rtol=1e-4)
        assert len(alone.kept_positions) == len(res.kept_positions)
        for snap_a, snap_b in zip(alone.kept_positions, res.kept_positions, strict=True):
            for la, lb in zip(snap_a, snap_b, strict=True):
                for h in range(la.shape[1]):
                    pa, pb = la[0, h], lb[i, h]
                    assert pa[pa >= 0].tolist() == pb[pb >= 0].tolist()


@pytest.mark.parametrize("name", ALL_PRESSES)
@torch.no_grad()
def test_left_padding_short_rows(model, name):
    """Rows of 40, 17 and 9 tokens: a row shorter than the budget keeps all its tokens and no padding,
    and matches its solo run until the batch's first compaction. (After it the short rows' padding
    slots are freed a compaction earlier than a solo run would compact, so later choices may differ:
    a static cache compacts all rows at once.)"""
    _, dec = model
    lens = [40, 17, 9]
    rows, ids, mask = padded_batch(lens, seed=20)
    press = build_press(name, dec, ids, mask)
    res = generate(dec, ids, mask, press=press, window=WINDOW, max_new_tokens=20, keep_logits=True, track_kept=True)
    budgets = press.layer_budgets(dec.spec.num_layers, max(lens))
    cache = dec.new_cache(3, build_press(name, dec, ids, mask), budgets, WINDOW)
    prefill(dec, cache, ids, positions_from_mask(mask))
    for lc in cache.layers:
        for i, n in enumerate(lens):
            p = lc.pos[i, :, : lc.fill]
            for h in range(p.shape[0]):
                want = list(range(n)) if n <= lc.budget else None
                got = p[h][p[h] >= 0].tolist()
                assert len(got) == min(n, lc.budget) and (want is None or got == want)
    first = min(budgets) + WINDOW - min(lc.fill for lc in cache.layers)  # decode steps before compaction
    for i, r in enumerate(rows[1:], start=1):
        alone = generate(dec, r[None], press=build_press(name, dec, r[None]), window=WINDOW, max_new_tokens=20,
                         keep_logits=True)
        torch.testing.assert_close(alone.prompt_logits[0], res.prompt_logits[i], atol=1e-4, rtol=1e-4)
        for a, b in zip(alone.step_logits[: first - 1], res.step_logits[: first - 1], strict=True):
            torch.testing.assert_close(a[0], b[i], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ALL_PRESSES)
@torch.no_grad()
def test_chunk_at_least_prompt_equals_single_shot(model, name):
    _, dec = model
    ids = prompt(37, seed=3)
    pos = torch.arange(37)[None]
    kept = []
    for chunk in (None, 37, 50):
        press = build_press(name, dec, ids)
        cache = dec.new_cache(1, press, press.layer_budgets(dec.spec.num_layers, 37), WINDOW)
        logits = prefill(dec, cache, ids, pos, chunk=chunk)
        kept.append((cache.kept_positions(), logits[:, -1]))
    for kp, lg in kept[1:]:
        assert all(torch.equal(a, b) for a, b in zip(kp, kept[0][0], strict=True))
        torch.testing.assert_close(lg, kept[0][1], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["streaming_llm", "knorm"])
@torch.no_grad()
def test_small_chunks_equal_single_shot_for_chunk_invariant_presses(model, name):
    """Knorm scores a key by itself and StreamingLLM by position, so keeping the top ``budget`` after
    every 7-token chunk keeps the same set as one top-``budget`` over the whole prompt: in every layer
    for StreamingLLM, in layer 0 for Knorm (deeper keys change: later chunks attend to a compacted
    cache, so their hidden states differ from a single-shot prefill's)."""
    _, dec = model
    ids = prompt(61, seed=4)
    pos = torch.arange(61)[None]
    out = []
    for chunk in (None, 7):
        press = build_press(name, dec, ids)
        cache = dec.new_cache(1, press, BUDGET, WINDOW)
        prefill(dec, cache, ids, pos, chunk=chunk)
        assert all(lc.fill == BUDGET for lc in cache.layers)
        out.append(cache.kept_positions())
    if name == "streaming_llm":
        first = out[0][0][0, 0]
        assert first[first >= 0].tolist() == [0, 1, 2, 3] + list(range(61 - BUDGET + 4, 61))
        assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))
    else:
        assert torch.equal(out[0][0], out[1][0])


@pytest.mark.parametrize("name", ALL_PRESSES)
@torch.no_grad()
def test_kept_tokens_keep_their_rope(model, name):
    """After prefill every layer's kept keys equal the full prefill's keys at the same positions, and
    after 30 decode steps (several compactions) layer 0's kept keys equal keys recomputed from the token
    and its true position: keys are never re-rotated, new tokens get their true positions."""
    _, dec = model
    ids = prompt(45, seed=6)
    pos = torch.arange(45)[None]
    press = build_press(name, dec, ids)
    full = dec.new_cache(1, None, 45, WINDOW)
    prefill(dec, full, ids, pos)
    cache = dec.new_cache(1, press, press.layer_budgets(dec.spec.num_layers, 45), WINDOW)
    prefill(dec, cache, ids, pos)
    for lf, lc in zip(full.layers, cache.layers, strict=True):
        p = lc.pos[:, :, : lc.fill]  # (1, Hkv, budget)
        ref = lf.k[:, :, :45].gather(2, p[..., None].expand(*p.shape, lf.k.shape[-1]))
        torch.testing.assert_close(lc.k[:, :, : lc.fill], ref, atol=1e-6, rtol=1e-6)
    res = generate(dec, ids, press=build_press(name, dec, ids), window=WINDOW, max_new_tokens=30)
    assert res.compactions >= 3
    all_ids = torch.cat([ids, res.tokens[:, :-1]], 1)  # the last token was never fed back
    k0 = layer0_keys(dec, all_ids, torch.arange(all_ids.shape[1])[None])
    lc = res.cache.layers[0]
    p = lc.pos[:, :, : lc.fill]
    assert (p >= 0).all()
    ref = k0.gather(2, p[..., None].expand(*p.shape, k0.shape[-1]))
    torch.testing.assert_close(lc.k[:, :, : lc.fill], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ALL_PRESSES)
@torch.no_grad()
def test_chunked_prefill_with_padding_longer_than_a_chunk(model, name):
    """Rows of 45, 12 and 30 tokens fed in chunks of 8: row 2's first four chunks are all padding.
    After every chunk each row holds min(budget, real tokens so far) valid slots and no padding; logits
    stay finite; StreamingLLM keeps each row's sinks + newest tokens, as a solo single-shot prefill."""
    _, dec = model
    lens = [45, 12, 30]
    rows, ids, mask = padded_batch(lens, seed=30)
    pos = positions_from_mask(mask)
    press = build_press(name, dec, ids, mask)
    budgets = press.layer_budgets(dec.spec.num_layers, max(lens))
    cache = dec.new_cache(3, press, budgets, WINDOW)
    for s in range(0, 45, 8):
        logits = dec(ids[:, s : s + 8], pos[:, s : s + 8], cache, mode="prefill")
        seen = (pos[:, : s + 8] >= 0).sum(-1)
        for lc, budget in zip(cache.layers, budgets, strict=True):
            p = lc.pos[:, :, : lc.fill]
            assert ((p >= 0).sum(-1) == seen.clamp(max=budget)[:, None]).all()
    assert torch.isfinite(logits[:, -1]).all()
    if name == "streaming_llm":
        for i, n in enumerate(lens):
            want = list(range(n)) if n <= BUDGET else [0, 1, 2, 3] + list(range(n - BUDGET + 4, n))
            for lc in cache.layers:
                p = lc.pos[i, 0, : lc.fill]
                assert p[p >= 0].tolist() == want
    res = generate(dec, ids, mask, press=build_press(name, dec, ids, mask), window=WINDOW, chunk=8,
                   max_new_tokens=12)
    assert res.compactions >= 1 and res.tokens.shape == (3, 12)
