# SPDX-License-Identifier: Apache-2.0
"""The engine's admission (kvexport.serve.engine.Engine.submit_all) on the real backend, stepped by the test (no
thread, so what waits is known): a request's sequences are queued all or none; ``max_queue`` sequences and
``max_queued_tokens`` tokens (prompt + max_tokens) may wait for a slot; a sequence's tokens leave the count when it
takes a slot or ends while waiting; a stopped engine takes nothing."""

from __future__ import annotations

from kvexport.serve import Engine, Sequence
from kvexport.serve.backends.graphs import GraphSlots


def test_queue_limits_and_their_accounting(export_dir, tokenizer):
    engine = Engine(GraphSlots(export_dir, max_sequences=1), tokenizer, max_queue=2, max_queued_tokens=600)

    def seq(n: int, m: int = 4) -> Sequence:
        return Sequence(list(range(5, 5 + n)), m)

    a, b = seq(100), seq(200, 96)  # 104 and 296 tokens
    assert engine.submit_all([a, b]) is None
    assert engine.counts()["queued_tokens"] == 400 and engine.counts()["queued_sequences"] == 2
    assert engine.submit_all([seq(10)]) == "queue"  # a third would wait
    engine.step()  # a takes the only slot: its tokens leave the queue's count
    assert a.state not in ("new", "queued") and b.state == "queued" and engine.counts()["queued_tokens"] == 296
    c = seq(300)
    assert engine.submit_all([c, seq(1)]) == "queue"  # all or none: c is not queued either
    assert c.state == "new" and engine.counts()["queued_tokens"] == 296
    assert engine.submit_all([seq(301)]) == "tokens"  # 296 + 305 > 600
    assert engine.submit_all([c]) is None and engine.counts()["queued_tokens"] == 600  # 296 + 304: at the limit
    engine.cancel(b)
    engine.step()  # b ends while waiting: its tokens go
    assert b.finish == "cancelled" and engine.counts()["queued_tokens"] == 304
    while a.state != "done":
        engine.step()
    engine.step()  # c takes the slot a left
    assert c.state not in ("new", "queued", "done") and engine.counts() == {"active_sequences": 1, "queued_sequences": 0,
                                                                    "queued_tokens": 0, "slots": 1}
    engine.stop()
    assert engine.submit_all([seq(1)]) == "stopped" and engine.counts()["queued_tokens"] == 0
