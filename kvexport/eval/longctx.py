# SPDX-License-Identifier: Apache-2.0
"""Long-context recall probes for real (pretrained, English) models, token-exact at any length and depth.

- ``passkey`` (Mohtashami & Jaggi, 2023, "Landmark Attention"): the classic English form. A header asks to
  remember a key, filler sentences ("The grass is green. The sky is blue. ...") hide ``The pass key is 52445.
  Remember it. 52445 is the pass key.`` at relative depth ``d`` of the prompt, and the prompt ends with ``What is
  the pass key? The pass key is``. Score: the key's digits lead the greedy answer (:func:`~kvexport.eval.tasks.
  extract_answer`).
- ``span_recall``: held-out English prose (:func:`kvexport.eval.data.prose_stream`) whose last ``SPAN_CUE`` tokens
  repeat a span at depth ``d`` (its only occurrence); greedy generation must continue with the ``SPAN_ANSWER``
  tokens that followed it there (exact match of their text).

Each prompt has exactly ``length`` tokens (filler cut at a token), so prompts of one length batch without padding.
Seeds fix keys, filler and spans; depth is the needle's (span's) end relative to the prompt length.
"""

from __future__ import annotations

import random

from kvexport.errors import BadUsage
from kvexport.eval.tasks import SPAN_ANSWER, SPAN_CUE, RecallExample, _bos, _ids, _occurs

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_HEADER = "There is a pass key hidden in the text below. Find it and remember it.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)


def passkey_example(tok, length: int, depth: float, seed: int = 0) -> RecallExample:
    """One English passkey prompt of exactly ``length`` tokens, the needle ending at ``depth`` of it."""
    rng = random.Random(f"passkey:{seed}:{length}:{depth}")
    key = str(rng.randint(10000, 99999))
    head = _bos(tok) + _ids(tok, PASSKEY_HEADER)
    needle = _ids(tok, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    tail = _ids(tok, PASSKEY_QUESTION)
    room = length - len(head) - len(needle) - len(tail)
    if room < 8:
        raise BadUsage(f"passkey: {length} tokens leave no room for filler around the needle and question")
    unit = _ids(tok, FILLER)
    filler = unit * (room // len(unit) + 2)
    cut = min(room, max(0, int(depth * length) - len(head) - len(needle)))
    prompt = head + filler[:cut] + needle + filler[cut:room] + tail
    assert len(prompt) == length
    return RecallExample(prompt, key, "passkey", (len(head) + cut + len(needle)) / length)


def span_example(tok, stream, length: int, depth: float, seed: int = 0) -> RecallExample:
    """One span-recall prompt of exactly ``length`` tokens of prose from ``stream`` ((N,) ids), the repeated span
    ending at ``depth``: the last SPAN_CUE tokens copy the span, the answer is the SPAN_ANSWER tokens after it."""
    ids = [int(t) for t in stream]
    body = length - len(_bos(tok)) - SPAN_CUE
    if body < SPAN_CUE + SPAN_ANSWER + 8 or len(ids) < body + 1:
        raise BadUsage(f"span_recall: {length} tokens do not fit (prose stream {len(ids)} tokens)")
    rng = random.Random(f"span:{seed}:{length}:{depth}")
    for _ in range(200):
        start = rng.randrange(0, len(ids) - body)
        filler = ids[start : start + body]
        at = min(max(0, int(depth * body) - SPAN_CUE - SPAN_ANSWER), body - SPAN_CUE - SPAN_ANSWER)
        at += rng.randrange(0, 8)
        at = min(at, body - SPAN_CUE - SPAN_ANSWER)
        cue, answer = filler[at : at + SPAN_CUE], filler[at + SPAN_CUE : at + SPAN_CUE + SPAN_ANSWER]
        if _occurs(filler, cue) == 1 and tok.decode(answer).strip():
            prompt = _bos(tok) + filler + cue
            return RecallExample(prompt, tok.decode(answer), "span_recall",
                                 (len(_bos(tok)) + at + SPAN_CUE + SPAN_ANSWER) / length, tuple(answer))
    raise BadUsage(f"span_recall: no span with a unique {SPAN_CUE}-token cue at depth {depth} in 200 draws")


def probes(tok, kinds, lengths, depths=DEPTHS, seed: int = 0) -> dict[tuple[str, int], list[RecallExample]]:
    """{(kind, length): one example per depth} for ``kinds`` in ("passkey", "span_recall")."""
    from kvexport.eval.data import prose_stream

    out = {}
    for kind in kinds:
        for n in lengths:
            if kind == "passkey":
                out[(kind, n)] = [passkey_example(tok, n, d, seed) for d in depths]
            elif kind == "span_recall":
                stream = prose_stream(tok)
                out[(kind, n)] = [span_example(tok, stream, n, d, seed) for d in depths]
            else:
                raise BadUsage(f"unknown probe {kind!r}; accepted: passkey, span_recall")
    return out


__all__ = ["FILLER", "DEPTHS", "passkey_example", "span_example", "probes"]
