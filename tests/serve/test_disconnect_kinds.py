# SPDX-License-Identifier: Apache-2.0
"""Every way a client can go away, streamed and not, three at a time against two slots (so some wait in the queue
when they go): mid-headers, mid-body, right after the request, with a reset (RST), after the first bytes of the
answer, after half-closing its side, after a while. ``kvexport serve`` logs nothing for any of them, every request
whose body arrived ends exactly once (completed or cancelled), the slots and the queue empty, and the next answer is
the solo run's."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from tests.serve.conftest import encode, reference
from tests.serve.process import ServerProcess

LONG = {"model": "m", "prompt": "def parse(", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
KINDS = ["headers", "body", "at-once", "reset", "after-first-bytes", "half-close", "later"]


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    with ServerProcess(export_dir, "--max-sequences", "2", log_dir=tmp_path_factory.mktemp("disconnects")) as srv:
        yield srv


def leave(port: int, body: dict, kind: str) -> bool:
    """Send ``body`` and go away as ``kind`` says; True when the whole request reached the server."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        if kind == "headers":
            s.sendall(head[:25])
            return False
        if kind == "body":
            s.sendall(head + data[:7])
            time.sleep(0.05)
            return False
        s.sendall(head + data)
        if kind == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
            time.sleep(0.2)
        elif kind == "after-first-bytes":
            s.recv(64)
        elif kind == "half-close":
            s.shutdown(socket.SHUT_WR)
            time.sleep(0.2)
        elif kind == "later":
            time.sleep(0.5)
        return True
    finally:
        s.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_every_kind_of_disconnect(server, solo, tokenizer, stream):
    before = server.metrics()
    arrived = 0
    for kind in KINDS:
        for _ in range(3):
            arrived += leave(server.port, {**LONG, "stream": stream}, kind)
    server.until_idle()
    after = server.metrics()
    ended = sum(after[f'kvexport_requests_total{{outcome="{o}"}}'] - before[f'kvexport_requests_total{{outcome="{o}"}}']
                for o in ("ok", "cancelled"))
    assert ended == arrived
    for o in ("error", "rejected"):
        key = f'kvexport_requests_total{{outcome="{o}"}}'
        assert after[key] == before[key], o
    assert after["kvexport_generated_tokens_total"] - before["kvexport_generated_tokens_total"] < arrived * 400
    # the server answers on, as a solo run would
    want, _ = reference(solo, encode(tokenizer, "def parse("), 12)
    status, doc = server.send("/v1/completions", {**LONG, "max_tokens": 12, "return_token_ids": True})
    assert status == 200 and doc["choices"][0]["token_ids"] == want
    server.assert_clean_log()
