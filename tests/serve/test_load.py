# SPDX-License-Identifier: Apache-2.0
"""A bounded load test on loopback: 24 requests (streamed and not) from 12 client threads against 4 slots, so
sequences queue, join and leave the running batch. Every answer equals its solo greedy run, nothing is lost or
left running, and the cache memory the server reports is what it was before. Bounded by request count and a
deadline; no speed is asserted (benchmarks/bench_serve.py measures it)."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import openai
import pytest

from kvexport.serve import ServerThread, open_model
from kvexport.serve.metrics import parse as parse_metrics
from tests.serve.conftest import reference

LENGTHS = [5, 17, 33, 60, 100, 150]  # one to ten prefill chunks
TOKENS, CLIENTS, PER_CLIENT = 16, 12, 2


@pytest.fixture(scope="module")
def server(export_dir):
    with ServerThread(open_model(export_dir, name="m")) as srv:
        yield srv


def metrics(url: str) -> dict:
    return parse_metrics(urllib.request.urlopen(url + "/metrics", timeout=30).read().decode())


def test_bounded_load(server, solo):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 4000, n).tolist() for n in LENGTHS]
    want = [reference(solo, p, TOKENS)[0] for p in prompts]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = metrics(server.url)
    resident = server.model.backend.resident_bytes()

    def one(k: int) -> tuple[int, list[int]]:
        i = k % len(prompts)
        kw = dict(model="m", prompt=prompts[i], max_tokens=TOKENS, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
        if k % 2:
            ids = [t for ch in client.completions.create(stream=True, **kw) for c in ch.choices
                   for t in (c.model_extra or {}).get("token_ids", [])]
        else:
            ids = client.completions.create(**kw).choices[0].model_extra["token_ids"]
        return i, ids

    n = CLIENTS * PER_CLIENT
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(one, k) for k in range(n)]
        done, not_done = wait(futures, timeout=240)
    assert not not_done, f"{len(not_done)} of {n} requests unfinished at the deadline"
    for f in futures:
        i, ids = f.result()
        assert ids == want[i], i
    after = metrics(server.url)
    delta = {k: after[k] - before[k] for k in after if k.endswith("_total") or "_total{" in k}
    assert delta['kvexport_requests_total{outcome="ok"}'] == n
    assert delta['kvexport_requests_total{outcome="error"}'] == delta['kvexport_requests_total{outcome="cancelled"}'] == 0
    assert delta["kvexport_generated_tokens_total"] == n * TOKENS
    assert delta["kvexport_prompt_tokens_total"] == sum(LENGTHS[k % len(LENGTHS)] for k in range(n))
    assert after["kvexport_active_sequences"] == after["kvexport_queued_sequences"] == 0
    assert server.model.backend.resident_bytes() == resident
    assert after["kvexport_resident_cache_bytes_total"] == before["kvexport_resident_cache_bytes_total"]
