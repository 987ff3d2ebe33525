# SPDX-License-Identifier: Apache-2.0
"""Malformed requests that once were 500s with a traceback in the log (deep nesting, NaN, integers of thousands of
digits, unpaired surrogates, a negative seed) are OpenAI-shaped 4xx answers from ``kvexport serve`` run as a user
runs it, and its log stays clean; and the small fixes: a float's bound is worded "decimal", an empty prompt (``""``,
``[]``, ``[[]]``) starts a new document as OpenAI's does, ``stream_options`` needs ``stream``."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from tests.serve.conftest import reference
from tests.serve.process import ServerProcess

OK = {"model": "m", "prompt": "def f(", "max_tokens": 2}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def raw(doc: dict, **replace: str) -> bytes:
    """``doc`` as JSON with the values of ``replace``'s keys written as the given raw JSON text."""
    text = json.dumps({**doc, **{k: f"@@{k}@@" for k in replace}})
    for k, v in replace.items():
        text = text.replace(json.dumps(f"@@{k}@@"), v)
    return text.encode()


#: (id, path, raw body, status, param, code)
BATTERY = [
    ("depth-100k", "/v1/completions", b"[" * 100_000, 400, None, "invalid_json"),
    ("depth-in-prompt", "/v1/completions", raw(OK, prompt="[" * 3000 + "]" * 3000), 400, None, "invalid_json"),
    ("nan", "/v1/completions", raw(OK, temperature="NaN"), 400, None, "invalid_json"),
    ("infinity", "/v1/completions", raw(OK, top_p="-Infinity"), 400, None, "invalid_json"),
    ("5000-digit-integer", "/v1/completions", raw(OK, max_tokens="9" * 5000), 400, None, "invalid_json"),
    ("not-utf8-inside", "/v1/completions", b'{"model": "m", "prompt": "\xc3\x28"}', 400, None, "invalid_json"),
    ("utf16-body", "/v1/completions", json.dumps(OK).encode("utf-16"), 400, None, "invalid_json"),
    ("empty-body", "/v1/completions", b"", 400, None, "invalid_json"),
    ("surrogate-prompt", "/v1/completions", raw(OK, prompt='"\\ud800 x"'), 400, "prompt", "invalid_value"),
    ("surrogate-prompt-list", "/v1/completions", raw(OK, prompt='["a", "\\udfff"]'), 400, "prompt.1",
     "invalid_value"),
    ("surrogate-model", "/v1/completions", raw(OK, model='"\\ud800"'), 400, "model", "invalid_value"),
    ("surrogate-stop", "/v1/completions", raw(OK, stop='"\\ud83d"'), 400, "stop", "invalid_value"),
    ("surrogate-key", "/v1/completions", b'{"\\ud800": 1}', 400, None, "invalid_value"),
    ("surrogate-chat", "/v1/chat/completions", raw(CHAT, messages='[{"role": "user", "content": "\\udc00"}]'), 400,
     "messages.0.content", "invalid_value"),
    ("seed-above-int64", "/v1/completions", raw(OK, seed=str(2**63)), 400, "seed", "integer_above_max_value"),
    ("seed-below-int64", "/v1/completions", raw(OK, seed=str(-2**63 - 1)), 400, "seed", "integer_below_min_value"),
    ("stop-too-long", "/v1/completions", raw(OK, stop=json.dumps("x" * 257)), 400, "stop", "invalid_value"),
    ("stream-options-without-stream", "/v1/completions", raw(OK, stream_options='{"include_usage": true}'), 400,
     "stream_options", "invalid_value"),
    ("huge-model-name", "/v1/completions", raw(OK, model=json.dumps("g" * 100_000)), 404, "model",
     "model_not_found"),
    ("huge-unsupported-value", "/v1/completions", raw(OK, logit_bias=json.dumps({str(i): 1 for i in range(5000)})),
     400, "logit_bias", "unsupported_value"),
]


@pytest.fixture(scope="module")
def server(chat_dir, tmp_path_factory):
    with ServerProcess(chat_dir, log_dir=tmp_path_factory.mktemp("malformed")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_malformed_bodies_are_4xx_and_nothing_is_logged(server):
    for name, path, body, status, param, code in BATTERY:
        got, doc = server.send(path, body)
        assert got == status, (name, doc)
        err = doc["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", name
        assert (err["param"], err["code"]) == (param, code), (name, err)
        assert "\n" not in err["message"] and len(err["message"]) < 400, (name, err["message"][:500])
    assert server.health()["status"] == "ok"
    server.assert_clean_log()


def test_bounds_of_decimals_and_integers_are_worded_as_openai_words_them(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", temperature=-1)
    assert e.value.code == "decimal_below_min_value"
    assert e.value.body["message"] == ("Invalid 'temperature': decimal below minimum value. Expected a value >= 0, "
                                       "but got -1 instead.")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", top_p=1.5)
    assert e.value.body["message"] == ("Invalid 'top_p': decimal above maximum value. Expected a value <= 1, "
                                       "but got 1.5 instead.")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", max_tokens=0)
    assert e.value.body["message"] == ("Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, "
                                       "but got 0 instead.")


def test_an_empty_prompt_starts_a_new_document(client, solo, tokenizer):
    """``""``, ``[]`` and ``[[]]`` are one prompt: the tokenizer's encoding of "" (here: its BOS), as a solo run
    of that prompt continues it."""
    start = tokenizer("", add_special_tokens=True)["input_ids"]
    assert start == [tokenizer.bos_token_id]
    want, _ = reference(solo, start, 8)
    for prompt in ("", [], [[]]):
        r = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        assert r.model_extra["prompt_token_ids"] == start and r.choices[0].model_extra["token_ids"] == want, prompt


def test_seeds_are_openais_int64(client, tokenizer):
    """A negative seed (OpenAI takes any int64) replays like any other, and differs from its neighbour."""
    def draw(seed: int) -> list[int]:
        r = client.completions.create(model="m", prompt="def f(", max_tokens=12, temperature=1.0, seed=seed,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        return r.choices[0].model_extra["token_ids"]

    a = draw(-1)
    assert draw(-1) == a and draw(-2**63) != a
    assert np.unique(a).size > 1
