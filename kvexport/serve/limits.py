# SPDX-License-Identifier: Apache-2.0
"""What one request may ask of the server, enforced before the work it would cost is done.

| limit | flag | default | refused with |
|---|---|---|---|
| requests in flight | ``--max-requests`` | 256 | 503 ``server_overloaded`` before the body is read (:class:`RequestGate`) |
| request body | ``--max-body-bytes`` | 4 × the prompt characters, at least 1 MiB | 413 ``request_too_large``, from ``Content-Length`` before the body is read, else as soon as the bytes read pass it |
| JSON nesting | ``--max-json-depth`` | 32 | 400 ``invalid_json``, from a scan of the bytes before they are parsed |
| prompt tokens | ``--max-prompt-tokens`` | the context - 1 | 400 ``context_length_exceeded``: first from a byte bound (a prompt of B UTF-8 bytes has at least ``ceil(B / L)`` tokens, L the longest vocabulary entry), before anything is tokenized; then exactly |
| prompt characters | ``--max-prompt-chars`` | 16 × the prompt tokens | 400 ``prompt_too_long``: all prompts (or message contents) of one request together, before tokenizing |
| ``max_tokens`` | ``--max-tokens`` | the context, at most 4096 | 400 ``invalid_value`` |
| queued sequences | ``--max-queue`` | 1024 | 503 ``server_overloaded`` |
| queued tokens | ``--max-queued-tokens`` | 64 × the context, at least 2**20 | 503 ``server_overloaded`` (prompt + ``max_tokens`` of the sequences waiting for a slot); 400 ``request_too_large`` when one request alone asks more |

The byte bound is exact for tokenizers without a normalizer (byte-level BPE: GPT-2, Llama 3, Qwen, SmolLM2): every
token covers at most L bytes of the text. A normalizer may shorten text (NFC composes up to 3 code points into one),
so with one the bound is divided by :data:`NORMALIZER_SLACK`; a BPE that fuses runs of unknown characters into one
token has no such bound, and only the character limit applies.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from kvexport.errors import BadUsage
from kvexport.serve.errors import APIError, bad_request

DEFAULT_JSON_DEPTH = 32
DEFAULT_MAX_QUEUE = 1024
DEFAULT_MAX_REQUESTS = 256
#: request bodies parsed and prompts tokenized at once (each may hold ~100 MB while it runs; the others wait with
#: their bodies as bytes)
PREPARE_THREADS = 2
#: tokens of completion one request may ask for, at most (the context permitting)
DEFAULT_MAX_TOKENS = 4096
#: characters per prompt token the default character limit allows (English prose is ~4, code ~3)
CHARS_PER_TOKEN = 16
#: a tokenizer with a normalizer: the bytes one token covers may be this many times its vocabulary entry's
NORMALIZER_SLACK = 4
_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')  # every byte but these: deleted by the depth scan
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


@dataclass(frozen=True)
class Limits:
    """The server's limits (docs/serve.md "Limits"); None: derived from the model by :meth:`resolve`."""

    max_body_bytes: int | None = None
    max_json_depth: int = DEFAULT_JSON_DEPTH
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None
    max_tokens: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_queued_tokens: int | None = None
    max_requests: int = DEFAULT_MAX_REQUESTS
    #: the most UTF-8 bytes one token covers (None: no bound; set by :meth:`resolve`)
    token_bytes: int | None = None

    def __post_init__(self):
        for name in ("max_body_bytes", "max_json_depth", "max_prompt_tokens", "max_prompt_chars", "max_tokens",
                     "max_queue", "max_queued_tokens", "max_requests"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise BadUsage(f"--{name.replace('_', '-')} {v} must be >= 1")

    def resolve(self, limit: int, tokenizer) -> "Limits":
        """The limits for a model of context ``limit`` (prompt + completion) and its ``tokenizer``, defaults
        filled in; a prompt-token limit beyond the context is refused (one line)."""
        if self.max_prompt_tokens is not None and self.max_prompt_tokens >= limit:
            raise BadUsage(f"--max-prompt-tokens {self.max_prompt_tokens} must be below the context ({limit} tokens: "
                           "prompt and completion together)")
        prompt = self.max_prompt_tokens or max(1, limit - 1)
        chars = self.max_prompt_chars or CHARS_PER_TOKEN * prompt
        return replace(self, max_prompt_tokens=prompt, max_prompt_chars=chars,
                       max_body_bytes=self.max_body_bytes or max(2**20, 4 * chars),
                       max_tokens=self.max_tokens or min(limit, DEFAULT_MAX_TOKENS),
                       max_queued_tokens=self.max_queued_tokens or max(2**20, 64 * limit),
                       token_bytes=token_bytes(tokenizer))

    def describe(self) -> str:
        """One line for the server's start."""
        return (f"limits: body {self.max_body_bytes:,} B, JSON depth {self.max_json_depth}, prompt "
                f"{self.max_prompt_tokens:,} tokens / {self.max_prompt_chars:,} characters, max_tokens "
                f"{self.max_tokens:,}, queue {self.max_queue} sequences / {self.max_queued_tokens:,} tokens, "
                f"{self.max_requests} requests in flight")


def token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token can stand for (see the module docstring), or None where no bound
    holds. Read once from the vocabulary: the longest entry decoded alone (a byte that is part of a character
    decodes to U+FFFD, 3 bytes: more, never less), plus one for the space a SentencePiece decoder strips from the
    first token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = json.loads(backend.to_str()).get("model", {})
    if model.get("type") == "BPE" and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    pieces = backend.decode_batch([[i] for i in range(backend.get_vocab_size(with_added_tokens=True))],
                                  skip_special_tokens=False)
    longest = max(len(p.encode("utf-8", "replace")) for p in pieces) + 1
    return longest * (NORMALIZER_SLACK if backend.normalizer is not None else 1)


# ---------------------------------------------------------------------------------------------- requests in flight
class RequestGate:
    """ASGI middleware: at most ``limit`` requests to ``paths`` in flight at once (their bodies read, parsed,
    waiting for a slot, generating, streaming); one more is answered 503 ``server_overloaded`` at once, before its
    body is read. Bounds what the requests being read and parsed can hold together: ``limit`` × the body limit.
    ``counts["requests_in_flight"]`` is kept up to date (the server's metrics read it)."""

    def __init__(self, app, limit: int, paths: tuple[str, ...], counts: dict):
        self.app, self.limit, self.paths, self.counts = app, int(limit), paths, counts
        counts["requests_in_flight"] = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        if self.counts["requests_in_flight"] >= self.limit:
            body = json.dumps(APIError(503, f"The server is overloaded ({self.limit} requests in flight, "
                                       "--max-requests); retry later.", "server_overloaded").body()).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
            await send({"type": "http.response.body", "body": body})
            return None
        self.counts["requests_in_flight"] += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.counts["requests_in_flight"] -= 1


# ---------------------------------------------------------------------------------------------- the request body
async def read_body(request, max_bytes: int) -> bytes:
    """The request's body, at most ``max_bytes``: 413 from its ``Content-Length`` before anything is read, or as
    soon as the bytes received pass the limit (what the client sends after that is discarded by the server)."""
    declared = request.headers.get("content-length")
    declared = (declared or "").strip()
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > max_bytes):
        raise too_large(int(declared) if len(declared) <= 18 else None, max_bytes)
    got = bytearray()
    async for chunk in request.stream():
        got += chunk
        if len(got) > max_bytes:
            raise too_large(None, max_bytes)
    return bytes(got)


def too_large(size: int | None, max_bytes: int) -> APIError:
    said = f"{size:,} bytes" if size is not None else "more"
    return APIError(413, f"The request body is too large: {said}; this server accepts at most {max_bytes:,} bytes "
                    "(--max-body-bytes).", "invalid_request_error", None, "request_too_large")


def json_depth(raw: bytes) -> int:
    """How deep ``raw`` (JSON) nests arrays and objects, from its bytes in one pass (no recursion, no parse).

    Escaped backslashes, then escaped quotes go first, so every remaining quote opens or closes a string; the
    bytes inside strings are dropped; the running sum of ``[{`` (+1) and ``]}`` (-1) peaks at the depth. For JSON
    that is not well formed the number is what a parser reading from the start would reach before its error."""
    s = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _STRUCTURE)
    outside = b"".join(s.split(b'"')[::2])
    return max(accumulate(map(_STEP.__getitem__, outside)), default=0)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def decode_json(raw: bytes, max_depth: int) -> Any:
    """The request body (UTF-8) -> a JSON value, or the 400 OpenAI would answer: not UTF-8, not JSON (NaN and Infinity
    are not JSON, nor are numbers of more than 4300 digits), nested deeper than ``max_depth``, or a string holding an
    unpaired UTF-16 surrogate (``"\\ud800"``, which no text encoding can carry)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_json(f"not UTF-8: {e.reason} at byte {e.start}") from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise bad_request(f"The JSON body nests {depth} levels deep; this server accepts at most {max_depth} "
                          "(--max-json-depth).", None, "invalid_json")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # a JSONDecodeError, a constant, an integer of > 4300 digits
        raise _not_json(e.msg if isinstance(e, json.JSONDecodeError) else str(e).split(";")[0]) from None
    bad = _surrogate(body, ())
    if bad is not None:
        param = ".".join(str(p) for p in bad) or None
        raise bad_request(f"Invalid {f'{param!r}' if param else 'body'}: a string holds an unpaired UTF-16 surrogate "
                          "(\\ud800-\\udfff); send valid Unicode text.", param, "invalid_value")
    return body


def _not_json(why: str) -> APIError:
    return bad_request("We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
                       f"your HTTP library correctly. The OpenAI API expects a JSON payload.) ({why})", None,
                       "invalid_json")


def _surrogate(value, path: tuple) -> tuple | None:
    """The path of the first string (or key) holding an unpaired surrogate, else None (depth is bounded by now)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            hit = _surrogate(k, path) if isinstance(k, str) else None
            hit = hit if hit is not None else _surrogate(v, (*path, k))
            if hit is not None:
                return hit
    elif isinstance(value, list):
        for i, v in enumerate(value):
            hit = _surrogate(v, (*path, i))
            if hit is not None:
                return hit
    return None


# ---------------------------------------------------------------------------------------------- prompts
def check_text(texts: list[str], limits: Limits, context: int, param: str) -> None:
    """Refuse prompt text (all of one request's prompts or message contents) before it is tokenized: too many
    tokens for certain (the byte bound), or more characters than the server accepts."""
    if limits.token_bytes is not None:
        for t in texts:
            n = len(t.encode("utf-8"))
            least = math.ceil(n / limits.token_bytes)
            if least > limits.max_prompt_tokens:
                raise prompt_too_long(limits, context, least, param, f"{n:,} bytes, at most {limits.token_bytes} "
                                      "bytes per token")
    chars = sum(len(t) for t in texts)
    if chars > limits.max_prompt_chars:
        raise bad_request(f"The prompt is too long: {chars:,} characters; this server accepts at most "
                          f"{limits.max_prompt_chars:,} per request (--max-prompt-chars).", param, "prompt_too_long")


def check_tokens(n: int, limits: Limits, context: int, param: str) -> None:
    if n > limits.max_prompt_tokens:
        raise prompt_too_long(limits, context, n, param)


def prompt_too_long(limits: Limits, context: int, n: int, param: str, bound: str | None = None) -> APIError:
    has = f"at least {n:,} tokens ({bound})" if bound else f"{n:,} tokens"
    if limits.max_prompt_tokens >= context - 1:
        head = f"This model's maximum context length is {context} tokens. However, your prompt has {has}."
    else:
        head = (f"This server accepts at most {limits.max_prompt_tokens:,} prompt tokens (--max-prompt-tokens; the "
                f"model's context is {context}). However, your prompt has {has}.")
    return bad_request(f"{head} Please reduce the length of the prompt.", param, "context_length_exceeded")


def check_max_tokens(asked: int | None, limits: Limits, param: str) -> None:
    if asked is not None and asked > limits.max_tokens:
        raise bad_request(f"Invalid '{param}': {clip(asked)} is too large; this server generates at most "
                          f"{limits.max_tokens:,} tokens per completion (--max-tokens).", param, "invalid_value")


def clip(value, n: int = 80) -> str:
    """``repr(value)`` cut to ``n`` characters (a refusal never echoes a megabyte back)."""
    r = repr(value)
    return r if len(r) <= n else r[:n - 3] + "..."


__all__ = ["Limits", "RequestGate", "read_body", "decode_json", "json_depth", "check_text", "check_tokens",
           "check_max_tokens", "token_bytes", "clip"]
