# SPDX-License-Identifier: Apache-2.0
"""OpenAI's completion and chat semantics over the engine: requests -> :class:`Sequence` s, events -> bodies.

Defaults are OpenAI's: ``max_tokens`` 16 for completions, ``temperature`` 1, ``top_p`` 1; chat completions
default to the rest of the context, at most :data:`CHAT_MAX_TOKENS`. A sequence may use ``limit`` positions
(prompt + completion: the export's ``max_positions``, or a full cache's capacity); a request beyond it is refused
with ``context_length_exceeded`` before it takes a slot.
"""

from __future__ import annotations

import time
import uuid

from kvexport.serve.engine import Event, Sequence
from kvexport.serve.errors import bad_request
from kvexport.serve.limits import Limits, check_max_tokens, check_text, check_tokens
from kvexport.serve.model import ServedModel
from kvexport.serve.sampling import SamplingParams
from kvexport.serve.schemas import ChatRequest, CompletionRequest

COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 512


def completion_prompts(req: CompletionRequest, model: ServedModel, limits: Limits) -> list[list[int]]:
    """``prompt`` (a string, strings, token ids, lists of token ids) -> one list of token ids per choice. Text is
    refused from its size before it is tokenized (:func:`kvexport.serve.limits.check_text`); an empty prompt (``""``,
    ``[]``) starts a new document, as OpenAI's does: :meth:`ServedModel.encode` of "" (a BOS where the tokenizer adds
    one), else the tokenizer's BOS or, without one, its EOS (the document separator)."""
    p = req.prompt
    if isinstance(p, str) or not p:
        p = [p or ""]
    if len(p) > limits.max_queue:
        raise bad_request(f"Invalid 'prompt': {len(p)} prompts in one request; this server takes at most "
                          f"{limits.max_queue} (--max-queue).", "prompt", "invalid_value")
    if all(isinstance(x, str) for x in p):
        check_text(p, limits, model.limit, "prompt")
        prompts = [model.encode(x) for x in p]
    elif all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = [list(x) for x in p]
    start = model.encode("") or [t for t in (model.tokenizer.bos_token_id, model.eos) if t is not None][:1]
    prompts = [ids or list(start) for ids in prompts]
    if any(not ids for ids in prompts):
        raise bad_request("Invalid 'prompt': the prompt is empty and this tokenizer has no BOS or EOS token to start "
                          "a document with.", "prompt", "invalid_value")
    for ids in prompts:
        check_tokens(len(ids), limits, model.limit, "prompt")
    V = model.backend.vocab_size
    if any(not 0 <= t < V for ids in prompts for t in ids):
        raise bad_request(f"Invalid 'prompt': token ids must be in [0, {V}).", "prompt", "invalid_value")
    return prompts


def chat_prompt(req: ChatRequest, model: ServedModel, limits: Limits) -> list[int]:
    """The messages through the tokenizer's chat template; 400 when the tokenizer has none. The message contents
    are refused from their size before the template renders (:func:`kvexport.serve.limits.check_text`)."""
    if model.chat_template is None:
        raise bad_request(f"The model '{model.name}' has no chat template (its tokenizer_config.json sets no "
                          "'chat_template'), so /v1/chat/completions is not available; use /v1/completions.",
                          "messages", "chat_template_missing")
    messages = [m.as_template_input() for m in req.messages]
    check_text(["".join(m["content"] for m in messages)], limits, model.limit, "messages")
    ids = model.encode_chat(messages)
    check_tokens(len(ids), limits, model.limit, "messages")
    return ids


def sequences(req, prompts: list[list[int]], model: ServedModel, chat: bool, limits: Limits) -> list[Sequence]:
    """One :class:`Sequence` per prompt, with the request's limits checked against the model's context and the
    server's ``--max-tokens``."""
    limit = model.limit
    asked = req.completion_limit() if chat else req.max_tokens
    param = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
    seed = None if req.seed is None else req.seed % 2**64  # OpenAI's int64 seeds; NumPy takes them unsigned
    out = []
    for ids in prompts:
        n = len(ids)
        if n >= limit:
            raise _too_long(limit, n, asked or 1, "messages" if chat else "prompt")
        m = asked if asked is not None else (min(limit - n, CHAT_MAX_TOKENS, limits.max_tokens) if chat else
                                             COMPLETION_MAX_TOKENS)
        if n + m > limit:
            raise _too_long(limit, n, m, param)
        check_max_tokens(asked, limits, param)  # within the context, yet more than the server's --max-tokens
        sampling = SamplingParams(1.0 if req.temperature is None else req.temperature,
                                  1.0 if req.top_p is None else req.top_p, seed)
        out.append(Sequence(ids, m, sampling, req.stops(), None if req.ignore_eos else model.eos))
    return out


def _too_long(limit: int, n: int, m: int, param: str):
    return bad_request(f"This model's maximum context length is {limit} tokens. However, you requested {n + m} "
                       f"tokens ({n} in the prompt, {m} for the completion). Please reduce the length of the prompt "
                       "or the completion.", param, "context_length_exceeded")


class Reply:
    """The response bodies of one request: ``chat`` or completion, ``ids`` with ``return_token_ids``."""

    def __init__(self, model: str, chat: bool, ids: bool):
        self.model, self.chat, self.ids = model, chat, ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, seqs: list[Sequence]) -> dict:
        p, c = sum(len(s.prompt) for s in seqs), sum(len(s.tokens) for s in seqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def full(self, seqs: list[Sequence], texts: list[str]) -> dict:
        """The non-streaming body."""
        choices = []
        for i, (s, text) in enumerate(zip(seqs, texts, strict=True)):
            c = {"index": i, "logprobs": None, "finish_reason": s.finish}
            c.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            if self.ids:
                c["token_ids"] = list(s.tokens)
            choices.append(c)
        body = {**self._head(self.object), "choices": choices, "usage": self.usage(seqs)}
        if self.ids:
            body["prompt_token_ids"] = [list(s.prompt) for s in seqs] if len(seqs) > 1 else list(seqs[0].prompt)
        return body

    def chunk(self, index: int, text: str | None, finish: str | None, tokens: list[int] | None = None,
              role: bool = False) -> dict:
        """One streamed chunk: the text ``text`` (and its ``tokens``) of choice ``index``, ``finish`` on the last."""
        c = {"index": index, "logprobs": None, "finish_reason": finish}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            c["delta"] = delta
        else:
            c["text"] = text or ""
        if self.ids and tokens is not None:
            c["token_ids"] = tokens
        return {**self._head(self.object + (".chunk" if self.chat else "")), "choices": [c]}

    def usage_chunk(self, seqs: list[Sequence]) -> dict:
        return {**self._head(self.object + (".chunk" if self.chat else "")), "choices": [], "usage": self.usage(seqs)}


def finished_ok(ev: Event) -> bool:
    return ev.finish in ("stop", "length")


__all__ = ["completion_prompts", "chat_prompt", "sequences", "Reply", "COMPLETION_MAX_TOKENS", "CHAT_MAX_TOKENS"]
