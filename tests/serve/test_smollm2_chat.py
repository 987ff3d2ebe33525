# SPDX-License-Identifier: Apache-2.0
"""``/v1/chat/completions`` on the real SmolLM2-135M-Instruct through its own chat template: ``kvexport serve`` of
the real-model tests' conversion (``tests/real/conftest.py``: SnapKV 128 + window 16, fp32 cache; these chats and
their answers fit in its budget, so nothing is evicted and it holds what a full cache holds), asked through the
``openai`` client, streamed and not, answers what transformers answers greedily when it reads the GGUF file itself
and applies the file's chat template (its ``generate``, ``do_sample=False``, on its own full cache): the same token
ids up to and with the end of turn, and the same text. On the onnxruntime backend (streamed and not) and on the
PyTorch one."""

from __future__ import annotations

import pytest

from tests.real.conftest import converted, smollm2, transformers_original  # noqa: F401 - fixtures
from tests.serve.process import ServerProcess

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]
TOKENS = 32


@pytest.fixture(scope="module")
def full_export(converted):  # noqa: F811
    assert converted.returncode == 0, converted.stderr[-3000:]
    return converted.out / "onnx"


@pytest.fixture(scope="module")
def references(transformers_original):  # noqa: F811
    """Per chat: transformers' greedy token ids (ending with the end-of-turn token where it stops) and its text."""
    import torch

    hf, tok = transformers_original
    out = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = hf.generate(ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=TOKENS,
                              do_sample=False)
        new = gen[0, ids["input_ids"].shape[1]:].tolist()
        out.append((ids["input_ids"][0].tolist(), new, tok.decode(new, skip_special_tokens=True)))
    assert all(new[-1] == tok.eos_token_id for _, new, _ in out)  # each answer ends its turn within TOKENS
    assert all(len(prompt) + len(new) <= 128 for prompt, new, _ in out)  # never evicted: the budget holds it all
    return out


@pytest.mark.parametrize("backend", ["onnxruntime", "pytorch"])
def test_chat_equals_transformers_greedy(full_export, references, backend, tmp_path):
    with ServerProcess(full_export, "--backend", backend, log_dir=tmp_path) as srv:
        client = srv.client(timeout=600)
        for chat, (prompt, want, text) in zip(CHATS, references, strict=True):
            kw = dict(model="m", messages=chat, max_tokens=TOKENS, temperature=0, extra_body={"return_token_ids": True})
            r = client.chat.completions.create(**kw)
            c = r.choices[0]
            assert r.model_extra["prompt_token_ids"] == prompt
            assert c.model_extra["token_ids"] == want and c.message.content == text, (c.message.content, text)
            assert c.finish_reason == ("stop" if len(want) < TOKENS else "length")
            if backend == "pytorch":  # streaming is the same code on either backend
                continue
            got, streamed = [], ""
            for chunk in client.chat.completions.create(stream=True, **kw):
                for ch in chunk.choices:
                    got += (ch.model_extra or {}).get("token_ids", [])
                    streamed += ch.delta.content or ""
            assert got == want and streamed == text
        srv.assert_clean_log()

