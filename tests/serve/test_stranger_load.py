# SPDX-License-Identifier: Apache-2.0
"""A stranger's load on ``kvexport serve`` (its own process, loopback, default limits) through the ``openai`` client:
8 clients at once, prompts of 5 to 300 tokens (token ids and text), streamed and not, some going away mid-answer,
and oversized or malformed requests among them (a 2 MB body, too many characters, too many bytes for the context, a
100,000-deep JSON body, max_tokens past the context), over a warm-up round and three measured rounds.

Asserted: no answer is a 5xx and nothing is logged; every completed answer equals the solo reference, ``kvexport
generate``'s PyTorch path (kvexport.generation.generate on the student with the export's press, budgets, window
and chunk), token for token, and a stream left early got a prefix of it; each refusal is the 4xx its limit names;
the server's resident memory after the measured rounds is within RSS_SLACK of what it was after the warm-up; the
slots and the queue are empty at the end. Bounded by request count and a deadline; nothing is timed (speed:
benchmarks/bench_serve.py). Nothing here depends on the slot count or how decode steps are batched."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import openai
import pytest

from tests.serve.conftest import STUDENT, encode
from tests.serve.process import ServerProcess

CLIENTS, ROUNDS = 8, 3
LENGTHS = [5, 17, 33, 60, 100, 150, 300]
TEXTS = ["def parse(", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self", "x = [i for i in"]
#: resident memory the server may gain over the measured rounds (allocator noise; an oversized request that was
#: parsed or tokenized in full would cost far more: a 2 MB prompt is ~700k tokens)
RSS_SLACK = 24 * 2**20


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    with ServerProcess(export_dir, log_dir=tmp_path_factory.mktemp("load")) as srv:
        yield srv


@pytest.fixture(scope="module")
def jobs(export_dir, tokenizer):
    """(prompt, max_tokens, reference tokens) of every prompt the clients send, from the PyTorch path."""
    import torch

    from kvexport.export.source import press_from_dict
    from kvexport.generation import generate
    from kvexport.manifest import read_manifest
    from kvexport.mla.io import load_decoder

    s = read_manifest(export_dir)["settings"]
    decoder, _ = load_decoder(STUDENT)
    rng = np.random.default_rng(34)
    prompts = [rng.integers(3, 4000, n).tolist() for n in LENGTHS] + TEXTS
    out = []
    for k, p in enumerate(prompts):
        ids = encode(tokenizer, p) if isinstance(p, str) else p
        m = (4, 16, 32)[k % 3]
        res = generate(decoder, torch.tensor([ids]), press=press_from_dict(s["press"]), window=s["window"],
                       chunk=s["chunk"], max_new_tokens=m)
        out.append((p, m, res.tokens[0].tolist()))
    return out


#: the strangers' requests: (prompt, max_tokens) or raw bytes -> the status and error code their limit names
STRANGERS = {
    "big-body": (("ab " * 700_000, 2), 413, "request_too_large"),  # 2.1 MB: over the 1 MiB body
    "many-chars": (("a" * 9000, 2), 400, "prompt_too_long"),  # fewer bytes than 511 tokens can hold, > 8176 chars
    "many-bytes": ((("\n" + " " * 44) * 600, 2), 400, "context_length_exceeded"),  # > 511 x 46 bytes
    "deep": (b"[" * 100_000, 400, "invalid_json"),
    "past-context": (("def f(", 10**6), 400, "context_length_exceeded"),
}


def stranger(srv: ServerProcess, kind: str) -> int:
    """One oversized or malformed request; returns its status after checking its error code."""
    what, status, code = STRANGERS[kind]
    if isinstance(what, bytes):
        got = srv.send("/v1/completions", what)
        assert (got[0], got[1]["error"]["code"]) == (status, code), kind
        return got[0]
    c = srv.client()
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="m", prompt=what[0], max_tokens=what[1])
    assert (e.value.status_code, e.value.code) == (status, code), kind
    return e.value.status_code


def one(srv: ServerProcess, job, mode: str, rng: random.Random) -> tuple[int, list[int] | None, bool]:
    """(status, tokens received, complete) of one request: ``mode`` json, stream or leave (a stream dropped after
    a few chunks)."""
    prompt, m, _ = job
    c = srv.client()
    kw = dict(model="m", prompt=prompt, max_tokens=m, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    try:
        if mode == "json":
            return 200, c.completions.create(**kw).choices[0].model_extra["token_ids"], True
        stream = c.completions.create(stream=True, **kw)
        got, cut = [], rng.randrange(1, 4) if mode == "leave" else None
        for n, chunk in enumerate(stream):
            for ch in chunk.choices:
                got += (ch.model_extra or {}).get("token_ids", [])
            if cut is not None and n + 1 >= cut:
                stream.close()
                return 200, got, False
        return 200, got, True
    except openai.APIStatusError as e:
        return e.status_code, None, False


def run_round(srv: ServerProcess, jobs, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    work = [("job", k, rng.choice(["json", "stream", "stream", "leave"])) for k in range(len(jobs)) for _ in range(2)]
    work += [("stranger", kind, None) for kind in ("big-body", "many-chars", "many-bytes", "deep", "past-context")]
    rng.shuffle(work)
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(stranger, srv, what) if tag == "stranger" else
                   pool.submit(lambda k=what, mode=mode, s=rng.random(): (k, *one(srv, jobs[k], mode, random.Random(s))))
                   for tag, what, mode in work]
        done, not_done = wait(futures, timeout=300)
    assert not not_done, f"{len(not_done)} of {len(work)} requests unfinished at the deadline"
    return [f.result() for f in futures]


def test_a_strangers_load(server, jobs):
    results, rss = [], []
    for r in range(1 + ROUNDS):  # round 0 warms up
        results += run_round(server, jobs, r)
        server.until_idle()
        rss.append(server.rss())
    statuses = [x if isinstance(x, int) else x[1] for x in results]
    assert not [s for s in statuses if s >= 500], statuses
    answered = [x for x in results if not isinstance(x, int)]
    complete = partial = 0
    for k, status, got, whole in answered:
        assert status == 200
        want = jobs[k][2]
        if whole:
            assert got == want, k
            complete += 1
        else:
            assert got == want[:len(got)], k
            partial += 1
    assert complete >= len(answered) // 2 and partial >= 1
    assert max(rss[1:]) - rss[0] <= RSS_SLACK, [x / 2**20 for x in rss]
    h = server.until_idle()
    assert h["status"] == "ok"
    server.assert_clean_log()
