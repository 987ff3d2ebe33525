# SPDX-License-Identifier: Apache-2.0
"""The limits a stranger cannot get around (kvexport/serve/limits.py), against ``kvexport serve`` run as a user runs
it with small limits: the body (413 from Content-Length before the body is sent, or once the bytes read pass it),
JSON nesting (400 before parsing), prompt characters and tokens (400 before tokenizing: the byte bound), max_tokens,
the queue's sequences and tokens; every refusal in OpenAI's shape, read by the ``openai`` client too, and nothing logged.

The byte bound and the depth scan are checked against independent references: the tokenizer's own counts on texts
of every kind, and the depth of the value Python's JSON parser builds."""

from __future__ import annotations

import http.client
import json
import math
import random
import socket

import openai
import pytest

from kvexport.serve.limits import json_depth, token_bytes
from tests.serve.conftest import MAX_POSITIONS
from tests.serve.process import ServerProcess

BODY, DEPTH, CHARS, MAX_TOKENS, QUEUE, QUEUED_TOKENS, REQUESTS = 65536, 32, 1000, 64, 2, 600, 2
OK = {"model": "m", "prompt": "def f(", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(chat_dir, tmp_path_factory):
    with ServerProcess(chat_dir, "--max-sequences", "1", "--max-body-bytes", str(BODY), "--max-json-depth",
                        str(DEPTH), "--max-prompt-chars", str(CHARS), "--max-tokens", str(MAX_TOKENS), "--max-queue",
                        str(QUEUE), "--max-queued-tokens", str(QUEUED_TOKENS), "--max-requests", str(REQUESTS),
                        log_dir=tmp_path_factory.mktemp("limits")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def refused(status_doc: tuple[int, dict], status: int, code: str, param=None) -> str:
    got, doc = status_doc
    assert got == status, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"} and (err["code"], err["param"]) == (code, param), err
    assert "\n" not in err["message"]
    return err["message"]


def test_the_banner_states_the_limits(server):
    assert (f"limits: body {BODY:,} B, JSON depth {DEPTH}, prompt {MAX_POSITIONS - 1} tokens / {CHARS:,} characters, "
            f"max_tokens {MAX_TOKENS}, queue {QUEUE} sequences / {QUEUED_TOKENS} tokens, {REQUESTS} requests in "
            "flight") in server.banner


def test_body_over_the_limit_is_413_before_it_is_read(server, client):
    # only the headers are sent: the answer comes from Content-Length alone
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 50000000\r\n\r\n")
    r = http.client.HTTPResponse(s)
    r.begin()
    doc = json.loads(r.read())
    s.close()
    msg = refused((r.status, doc), 413, "request_too_large")
    assert "50,000,000 bytes" in msg and f"at most {BODY:,} bytes" in msg
    # no Content-Length (chunked): refused once the bytes read pass the limit
    def chunks():
        yield b'{"model": "m", "prompt": "'
        for _ in range(20):
            yield b"a" * 8192
    c = server.connect()
    c.request("POST", "/v1/completions", body=chunks(), encode_chunked=True, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
    c.close()
    # the openai client reads the refusal of a 10 MB prompt
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="m", prompt="ab " * 3_400_000, max_tokens=2)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    # exactly at the limit is accepted (spaces pad the JSON to BODY bytes)
    raw = json.dumps(OK).encode()
    status, doc = server.send("/v1/completions", raw + b" " * (BODY - len(raw)))
    assert status == 200 and doc["usage"]["completion_tokens"] == 2
    refused(server.send("/v1/completions", raw + b" " * (BODY - len(raw) + 1)), 413, "request_too_large")
    server.assert_clean_log()


def nest(depth: int, leaf=1):
    v = leaf
    for i in range(depth):
        v = [v] if i % 2 else {"k": v}
    return v


@pytest.mark.parametrize("seed", range(6))
def test_json_depth_is_the_parsers(seed):
    """The byte scan against the depth of the value json.loads builds: strings full of brackets, quotes and
    backslashes, escapes, nesting of both kinds."""
    rng = random.Random(seed)

    def value(d: int):
        k = rng.random()
        if d > 12 or k < 0.3:
            return rng.choice([1, -2.5, None, True, "".join(rng.choice('ab[]{}"\\\n\u00e9\U0001f600') for _ in
                                                              range(rng.randrange(12)))])
        if k < 0.65:
            return [value(d + 1) for _ in range(rng.randrange(4))]
        return {"".join(rng.choice('x[{"\\') for _ in range(3)) + str(i): value(d + 1) for i in range(rng.randrange(4))}

    def depth(v) -> int:
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        return 0

    for _ in range(50):
        v = value(0)
        for ascii_only in (True, False):
            raw = json.dumps(v, ensure_ascii=ascii_only).encode()
            assert json_depth(raw) == depth(json.loads(raw)), raw
    assert json_depth(json.dumps(nest(100)).encode()) == 100


def test_nesting_over_the_limit_is_400_before_parsing(server):
    for raw in (b"[" * 60_000, b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        msg = refused(server.send("/v1/completions", raw), 400, "invalid_json")
        assert f"at most {DEPTH}" in msg
    # at the limit the body is parsed (and then refused for what it says), one deeper it is not
    msg = refused(server.send("/v1/completions", {**OK, "extra": nest(DEPTH - 1)}), 400, "unknown_parameter", "extra")
    assert msg == "Unrecognized request argument supplied: extra"
    refused(server.send("/v1/completions", {**OK, "extra": nest(DEPTH)}), 400, "invalid_json")
    # brackets inside strings are text
    status, doc = server.send("/v1/completions", {**OK, "prompt": '[{"\\' * 100})
    assert status == 200, doc
    server.assert_clean_log()


TEXTS = {
    "prose": "The grass is green. The sky is blue. " * 20,
    "code": "def f(x):\n    return [i * 2 for i in range(x)]  # doubled\n" * 10,
    "whitespace": ("\n" + " " * 44) * 40 + "\t" * 300,
    "separators": "#" * 2000 + "=" * 500 + "-" * 500,
    "cjk": "東京は日本の首都です。" * 60,
    "emoji": "\U0001f600\U0001f680" * 300,
    "digits": "".join(str(i) for i in range(800)),
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_the_byte_bound_never_exceeds_the_token_count(tokenizer, name):
    """A text of B UTF-8 bytes has at least ceil(B / L) tokens (L = token_bytes): counted by the tokenizer."""
    L = token_bytes(tokenizer)
    assert 1 < L < 100
    text = TEXTS[name]
    for cut in (len(text), len(text) // 3, 7):
        t = text[:cut]
        n = len(tokenizer(t, add_special_tokens=False)["input_ids"])
        assert n >= math.ceil(len(t.encode()) / L), (name, cut, n, L)


def test_prompt_size_is_refused_before_tokenizing(server, client, tokenizer):
    L = token_bytes(tokenizer)
    # more bytes than MAX_POSITIONS - 1 tokens can hold: refused from the byte bound ("at least")
    text = "x" * (L * (MAX_POSITIONS - 1) + 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=text, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert f"However, your prompt has at least {MAX_POSITIONS:,} tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the same for chat, over the message contents
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    # fewer bytes than that but more characters than --max-prompt-chars, over all prompts of the request
    msg = refused(server.send("/v1/completions", {**OK, "prompt": ["a " * 300, "b " * 201]}), 400, "prompt_too_long",
                  "prompt")
    assert f"{CHARS + 2:,} characters" in msg and f"at most {CHARS:,}" in msg
    # within both, yet more tokens than the context holds: refused exactly, after tokenizing
    text = "\u00e9\u00df" * 490
    n = len(tokenizer(text)["input_ids"])
    assert n >= MAX_POSITIONS and len(text) <= CHARS
    msg = refused(server.send("/v1/completions", {**OK, "prompt": text}), 400, "context_length_exceeded", "prompt")
    assert f"your prompt has {n:,} tokens" in msg
    server.assert_clean_log()


def test_max_tokens_over_the_servers_limit(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="def f(", max_tokens=MAX_TOKENS + 1)
    assert e.value.code == "invalid_value" and e.value.param == "max_tokens"
    assert f"at most {MAX_TOKENS} tokens per completion (--max-tokens)" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=MAX_TOKENS + 1)
    assert e.value.param == "max_completion_tokens"
    r = client.completions.create(model="m", prompt="def f(", max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS
    server.assert_clean_log()


def test_requests_the_queue_could_never_hold(server):
    """A request asking more than the queue may ever hold is a 400 (its own fault), whatever the queue holds now:
    more tokens (prompts + max_tokens) than --max-queued-tokens, more prompts than --max-queue. (The 503s of a queue
    full at the moment are the engine's admission: tests/serve/test_admission.py.)"""
    big = {**OK, "prompt": [[5] * 300, [5] * 300]}
    msg = refused(server.send("/v1/completions", big), 400, "request_too_large")
    assert "asks for 604 tokens" in msg and f"at most {QUEUED_TOKENS}" in msg
    msg = refused(server.send("/v1/completions", {**OK, "prompt": ["a", "b", "c"]}), 400, "invalid_value", "prompt")
    assert f"3 prompts in one request; this server takes at most {QUEUE}" in msg
    assert server.until_idle()["queued_tokens"] == 0
    server.assert_clean_log()


def test_requests_in_flight(server):
    """REQUESTS requests whose bodies never finish arriving are in flight for as long as their clients wait; one more
    is refused at once, before its body is read; when one of them goes, the next is served."""
    held = []
    for _ in range(REQUESTS):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"")
        held.append(s)
    server.until(lambda m: m["kvexport_requests_in_flight"] == REQUESTS, "in flight")
    status, doc = server.send("/v1/completions", OK)
    assert status == 503 and doc["error"]["type"] == "server_overloaded", doc  # OpenAI's type, as a full queue's
    assert f"{REQUESTS} requests in flight" in doc["error"]["message"]
    assert server.health()["status"] == "ok"  # other routes are not held
    held.pop().close()
    server.until(lambda m: m["kvexport_requests_in_flight"] == REQUESTS - 1, "one gone")
    status, doc = server.send("/v1/completions", OK)
    assert status == 200 and doc["usage"]["completion_tokens"] == 2
    for s in held:
        s.close()
    server.assert_clean_log()
