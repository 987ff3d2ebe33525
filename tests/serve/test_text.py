# SPDX-License-Identifier: Apache-2.0
"""Streamed text against the plain reference: the pieces of :class:`TextStream` join to the tokenizer's decode of
all tokens, cut before the first stop string (Python's ``str.find``), for many token sequences of the student's
tokenizer, including byte-level pieces that only make a character together; no piece is ever taken back."""

from __future__ import annotations

import numpy as np
import pytest

from kvexport.serve.text import TextStream
from tests.serve.conftest import STUDENT


@pytest.fixture(scope="module")
def tokenizer():
    from kvexport.models.loading import load_tokenizer

    return load_tokenizer(STUDENT)


def reference(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[str, bool]:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def sequences(tokenizer, n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    texts = ["def parse(x):\n    return x.split(',')\n", "naïve café — ünïcödé ✓ 日本語 🙂 done", "a.b.c.d.e.f.g"]
    out = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    out += [rng.integers(0, tokenizer.vocab_size, 40).tolist() for _ in range(n)]
    return out


@pytest.mark.parametrize("stops", [(), (".",), ("\n    ", "@@"), ("é —", "re", "x"), ("🙂",)])
def test_pieces_join_to_the_reference(tokenizer, stops):
    for ids in sequences(tokenizer, 30):
        ts, pieces = TextStream(tokenizer, stops), []
        for t in ids:
            pieces.append(ts.push(t))
            if ts.stopped:
                break
        pieces.append(ts.finish())
        want, stopped = reference(tokenizer, ids[:len(ts.ids)], stops)
        assert "".join(pieces) == want and ts.stopped == stopped, (ids, stops)
        if stopped:  # it stopped at the token that completed the stop string, not later
            assert reference(tokenizer, ids[:len(ts.ids) - 1], stops)[1] is False
        assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in want
