# SPDX-License-Identifier: Apache-2.0
"""Bad requests get OpenAI's JSON error object (message, type, param, code) with the right 4xx status, sent as raw
HTTP (malformed bodies a client library would never send), then once through the ``openai`` client; the server
stays healthy and counts every refusal."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import openai
import pytest

from kvexport.serve import ServerThread, open_model
from kvexport.serve.metrics import parse as parse_metrics
from tests.serve.conftest import MAX_POSITIONS

OK = {"model": "m", "prompt": "def f(", "max_tokens": 2}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

#: (id, method, path, body (a dict is sent as JSON, bytes as they are), status, param, code)
BATTERY = [
    ("malformed-json", "POST", "/v1/completions", b'{"model": "m", "prompt": ', 400, None, "invalid_json"),
    ("not-utf8", "POST", "/v1/completions", b"\xff\xfe", 400, None, "invalid_json"),
    ("not-an-object", "POST", "/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("missing-model", "POST", "/v1/completions", {"prompt": "x"}, 400, "model", "missing_required_parameter"),
    ("missing-prompt", "POST", "/v1/completions", {"model": "m"}, 400, "prompt", "missing_required_parameter"),
    ("unknown-model", "POST", "/v1/completions", {**OK, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("unknown-field", "POST", "/v1/completions", {**OK, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("negative-max-tokens", "POST", "/v1/completions", {**OK, "max_tokens": -1}, 400, "max_tokens",
     "integer_below_min_value"),
    ("zero-max-tokens", "POST", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens",
     "integer_below_min_value"),
    ("huge-max-tokens", "POST", "/v1/completions", {**OK, "max_tokens": 10**9}, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt-over-limit", "POST", "/v1/completions", {**OK, "prompt": [5] * (MAX_POSITIONS + 1)}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt-plus-completion-over-limit", "POST", "/v1/completions",
     {**OK, "prompt": [5] * (MAX_POSITIONS - 10), "max_tokens": 11}, 400, "max_tokens", "context_length_exceeded"),
    ("max-tokens-string", "POST", "/v1/completions", {**OK, "max_tokens": "16"}, 400, "max_tokens", "invalid_type"),
    ("max-tokens-float", "POST", "/v1/completions", {**OK, "max_tokens": 2.5}, 400, "max_tokens", "invalid_type"),
    ("temperature-string", "POST", "/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature",
     "invalid_type"),
    ("temperature-too-high", "POST", "/v1/completions", {**OK, "temperature": 3}, 400, "temperature",
     "decimal_above_max_value"),
    ("temperature-negative", "POST", "/v1/completions", {**OK, "temperature": -1}, 400, "temperature",
     "decimal_below_min_value"),
    ("top-p-zero", "POST", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("stream-string", "POST", "/v1/completions", {**OK, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("prompt-number", "POST", "/v1/completions", {**OK, "prompt": 5}, 400, "prompt", "invalid_type"),
    ("prompt-null", "POST", "/v1/completions", {**OK, "prompt": None}, 400, "prompt", "invalid_type"),
    ("prompt-id-out-of-vocab", "POST", "/v1/completions", {**OK, "prompt": [1, 99999]}, 400, "prompt",
     "invalid_value"),
    ("five-stops", "POST", "/v1/completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "invalid_value"),
    ("empty-stop", "POST", "/v1/completions", {**OK, "stop": ""}, 400, "stop", "invalid_value"),
    ("seed-string", "POST", "/v1/completions", {**OK, "seed": "7"}, 400, "seed", "invalid_type"),
    ("n-two", "POST", "/v1/completions", {**OK, "n": 2}, 400, "n", "unsupported_value"),
    ("logprobs", "POST", "/v1/completions", {**OK, "logprobs": 3}, 400, "logprobs", "unsupported_value"),
    ("chat-no-messages", "POST", "/v1/chat/completions", {"model": "m", "messages": []}, 400, "messages",
     "invalid_value"),
    ("chat-bad-role", "POST", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", "invalid_value"),
    ("chat-unknown-field", "POST", "/v1/chat/completions", {**CHAT, "prompt": "x"}, 400, "prompt",
     "unknown_parameter"),
    ("chat-tools", "POST", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools",
     "unsupported_value"),
    ("chat-negative-max-completion", "POST", "/v1/chat/completions", {**CHAT, "max_completion_tokens": -5}, 400,
     "max_completion_tokens", "integer_below_min_value"),
    ("get-completions", "GET", "/v1/completions", None, 405, None, None),
    ("unknown-route", "GET", "/v2/everything", None, 404, None, None),
    ("unknown-model-card", "GET", "/v1/models/gpt-4", None, 404, "model", "model_not_found"),
]


@pytest.fixture(scope="module")
def server(chat_dir):
    with ServerThread(open_model(chat_dir, name="m")) as srv:
        yield srv


def send(url: str, method: str, path: str, body) -> tuple[int, dict]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data is not None else {})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def metrics(url: str) -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    out = parse_metrics(conn.getresponse().read().decode())
    conn.close()
    return out


def test_bad_requests_get_openai_errors(server):
    before = metrics(server.url)['kvexport_requests_total{outcome="rejected"}']
    for name, method, path, body, status, param, code in BATTERY:
        got, doc = send(server.url, method, path, body)
        assert got == status, (name, doc)
        assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, name
        err = doc["error"]
        assert err["type"] == "invalid_request_error" and err["message"], name
        assert (err["param"], err["code"]) == (param, code), (name, err)
        assert "\n" not in err["message"] and "Traceback" not in err["message"], name
    m = metrics(server.url)
    assert m['kvexport_requests_total{outcome="rejected"}'] - before == len(BATTERY)
    assert m["kvexport_active_sequences"] == 0 and m["kvexport_queued_sequences"] == 0
    status, doc = send(server.url, "POST", "/v1/completions", OK)  # still serving
    assert status == 200 and doc["choices"][0]["text"] is not None


def test_openai_client_reads_the_errors(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="m", prompt="x", max_tokens=10**9)
    assert e.value.code == "context_length_exceeded" and f"maximum context length is {MAX_POSITIONS}" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="m", prompt="x", extra_body={"frobnicate": True})
    assert e.value.body["message"] == "Unrecognized request argument supplied: frobnicate"
