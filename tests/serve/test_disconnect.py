# SPDX-License-Identifier: Apache-2.0
"""A client that goes away frees its slot: a stream closed after its first events, and a non-streamed request
whose connection closes while it runs. Both are cancelled long before their ``max_tokens``, and a queued request
then gets the slot (one slot here)."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import pytest

from kvexport.serve import ServerThread, open_model
from kvexport.serve.metrics import parse as parse_metrics

LONG = {"model": "m", "prompt": "def parse(", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(export_dir):
    with ServerThread(open_model(export_dir, name="m", max_sequences=1)) as srv:
        yield srv


def connect(url: str) -> http.client.HTTPConnection:
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=60)


def metrics(url: str) -> dict:
    c = connect(url)
    c.request("GET", "/metrics")
    out = parse_metrics(c.getresponse().read().decode())
    c.close()
    return out


def until(url: str, cond, what: str, deadline: float = 60.0) -> dict:
    """Poll the metrics until ``cond(metrics)`` holds (a bound on the wait, not a timing assertion)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        m = metrics(url)
        if cond(m):
            return m
        time.sleep(0.05)
    raise AssertionError(f"not {what} after {deadline} s: {metrics(url)}")


def post(url: str, body: dict) -> http.client.HTTPConnection:
    c = connect(url)
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return c


def cancelled(m: dict) -> float:
    return m['kvexport_requests_total{outcome="cancelled"}']


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_disconnect_frees_the_slot(server, stream):
    before = metrics(server.url)
    c = post(server.url, {**LONG, "stream": stream})
    if stream:
        r = c.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        assert r.read(7) == b"data: {"  # the first event arrived: the sequence runs
    else:
        until(server.url, lambda m: m["kvexport_active_sequences"] == 1, "admitted")
    c.sock.close()  # the client goes away mid-generation
    c.close()
    m = until(server.url, lambda m: cancelled(m) == cancelled(before) + 1 and m["kvexport_active_sequences"] == 0,
              "cancelled")
    assert m["kvexport_generated_tokens_total"] - before["kvexport_generated_tokens_total"] < LONG["max_tokens"]
    # the only slot is free again: a new request runs to its end
    c = post(server.url, {**LONG, "max_tokens": 4})
    doc = json.loads(c.getresponse().read())
    assert doc["choices"][0]["finish_reason"] == "length" and doc["usage"]["completion_tokens"] == 4
