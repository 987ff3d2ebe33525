# SPDX-License-Identifier: Apache-2.0
"""The real server on 127.0.0.1 (a free port, uvicorn in a thread) through the real ``openai`` client: completions
and chat, streamed and not. Greedy output equals a solo run of the PyTorch library path with the export's model and settings token for token (and
its text); stop strings cut where the reference text has them; seeded sampling replays exactly; several prompts in
one request; models, health and metrics."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import openai
import pytest

from kvexport.serve import ServerThread, open_model
from kvexport.serve.metrics import parse as parse_metrics
from kvexport.serve.sampling import SamplingParams, choose
from tests.serve.conftest import encode, reference

PROMPTS = ["def parse(", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self", "x = [i for i in"]


@pytest.fixture(scope="module")
def server(chat_dir):
    with ServerThread(open_model(chat_dir, name="kvx-student")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_solo(chat_dir):
    from tests.serve.conftest import LibraryRun

    return LibraryRun(chat_dir)


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def streamed(chunks) -> tuple[str, list[int], str | None, object]:
    """(text, token ids, finish reason, usage) of a completion stream."""
    text, ids, finish, usage, n = "", [], None, None, 0
    for ch in chunks:
        usage = ch.usage or usage
        for c in ch.choices:
            text += c.text if hasattr(c, "text") else (c.delta.content or "")
            ids += (c.model_extra or {}).get("token_ids", [])
            finish = c.finish_reason or finish
            n += 1
    assert n >= 1
    return text, ids, finish, usage


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_solo_run(client, solo, tokenizer, prompt):
    ids = encode(tokenizer, prompt)
    want, _ = reference(solo, ids, 24, tokenizer.eos_token_id)
    r = client.completions.create(model="kvx-student", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert token_ids(c) == want
    assert c.text == tokenizer.decode(want, skip_special_tokens=True)
    assert c.finish_reason == ("stop" if want[-1] == tokenizer.eos_token_id else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    assert r.model_extra["prompt_token_ids"] == ids and r.object == "text_completion" and r.model == "kvx-student"


def test_streamed_completion_equals_solo_run(client, solo, tokenizer):
    ids = encode(tokenizer, PROMPTS[1])
    want, _ = reference(solo, ids, 40, tokenizer.eos_token_id)
    stream = client.completions.create(model="kvx-student", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
    text, got, finish, usage = streamed(stream)
    assert got == want and text == tokenizer.decode(want, skip_special_tokens=True)
    assert finish == ("stop" if want[-1] == tokenizer.eos_token_id else "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want))


def test_several_prompts_in_one_request(client, solo, tokenizer):
    r = client.completions.create(model="kvx-student", prompt=PROMPTS, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, p in zip(r.choices, PROMPTS, strict=True):
        assert token_ids(c) == reference(solo, encode(tokenizer, p), 12, tokenizer.eos_token_id)[0]


def test_token_id_prompt(client, solo):
    ids = np.random.default_rng(3).integers(3, 4000, 100).tolist()
    r = client.completions.create(model="kvx-student", prompt=ids, max_tokens=16, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert token_ids(r.choices[0]) == reference(solo, ids, 16)[0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_ends_the_text_before_it(client, solo, tokenizer, stream):
    ids = encode(tokenizer, PROMPTS[1])
    full = tokenizer.decode(reference(solo, ids, 40)[0], skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]  # three characters from the middle of the greedy text
    want = full[:full.find(stop)]
    kw = dict(model="kvx-student", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=["@@never@@", stop],
              extra_body={"ignore_eos": True})
    if stream:
        text, _, finish, _ = streamed(client.completions.create(stream=True, **kw))
    else:
        c = client.completions.create(**kw).choices[0]
        text, finish = c.text, c.finish_reason
    assert (text, finish) == (want, "stop")


def test_seeded_sampling_replays(client, solo, tokenizer):
    """The same seed gives the same tokens; they are the tokens the sampler draws from the solo run's logits."""
    kw = dict(model="kvx-student", prompt=PROMPTS[0], max_tokens=20, temperature=0.9, top_p=0.9,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a = token_ids(client.completions.create(seed=123, **kw).choices[0])
    b = token_ids(client.completions.create(seed=123, **kw).choices[0])
    assert a == b
    others = {tuple(token_ids(client.completions.create(seed=s, **kw).choices[0])) for s in (1, 2, 3)}
    assert len(others | {tuple(a)}) > 1
    ids = encode(tokenizer, PROMPTS[0])
    res = solo.generate(np.array([ids]), max_new_tokens=20, forced_tokens=np.array([a]), keep_logits=True)
    params = SamplingParams(0.9, 0.9, 123)
    rng = params.rng()
    logits = [res.prompt_logits[0]] + [x[0] for x in res.step_logits]
    assert [choose(lg, params, rng) for lg in logits] == a


def chat_ids(chat_dir, messages) -> list[int]:
    from kvexport.models.loading import load_tokenizer

    return load_tokenizer(chat_dir / "tokenizer").apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=True, return_dict=False)


MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse("}]


def test_chat_greedy_equals_solo_run(client, chat_solo, chat_dir, tokenizer):
    ids = chat_ids(chat_dir, MESSAGES)
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 10  # the template was applied
    want, _ = reference(chat_solo, ids, 24, tokenizer.eos_token_id)
    r = client.chat.completions.create(model="kvx-student", messages=MESSAGES, max_tokens=24, temperature=0,
                                       extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert token_ids(c) == want and c.message.role == "assistant"
    assert c.message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)
    text, got, finish, usage = streamed(client.chat.completions.create(
        model="kvx-student", messages=MESSAGES, max_completion_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert (text, got, finish) == (c.message.content, want, c.finish_reason)
    assert usage.completion_tokens == len(want)


def test_chat_needs_a_chat_template(export_dir):
    with ServerThread(open_model(export_dir, name="plain")) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="plain", messages=MESSAGES)
        assert e.value.status_code == 400 and e.value.code == "chat_template_missing"
        assert "no chat template" in e.value.body["message"] and "/v1/completions" in e.value.body["message"]
        assert c.completions.create(model="plain", prompt="x", max_tokens=2).choices[0].finish_reason


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["kvx-student"]
    assert client.models.retrieve("kvx-student").owned_by == "kvexport"
    health = json.loads(urllib.request.urlopen(server.url + "/health").read())
    assert health == {"status": "ok", "model": "kvx-student", "active_sequences": 0, "queued_sequences": 0,
                      "slots": 4}
    client.completions.create(model="kvx-student", prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    m = parse_metrics(urllib.request.urlopen(server.url + "/metrics").read().decode())
    res = server.model.backend.resident_bytes()
    assert m["kvexport_resident_cache_bytes_total"] == res["total"]
    assert [m[f'kvexport_resident_cache_bytes{{slot="{r}"}}'] for r in range(4)] == [res["per_slot"]["total"]] * 4
    assert m['kvexport_requests_total{outcome="ok"}'] >= 1 and m["kvexport_generated_tokens_total"] >= 3
    assert m["kvexport_active_sequences"] == 0 and m["kvexport_queued_sequences"] == 0 and m["kvexport_slots"] == 4
    assert m["kvexport_process_resident_memory_bytes"] > res["total"]
