# SPDX-License-Identifier: Apache-2.0
"""The HTTP API (Starlette): OpenAI's completions and chat completions, models, health and metrics.

``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events ``data: {...}\\n\\n`` ending
with ``data: [DONE]``, or one JSON body), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Every error is OpenAI's JSON error object with its 4xx/5xx status; what a client sends is checked against the
server's :class:`~kvexport.serve.limits.Limits` before the work it asks for is done (the body's size before it is
read, its nesting before it is parsed, a prompt's size before it is tokenized), and nothing a client does is a 500
or a logged traceback. A client that goes away cancels its sequences: a stream when its connection closes, a
non-streamed request as soon as the server sees the disconnect, so the slot is free for the next sequence.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvexport.serve import metrics as metrics_mod
from kvexport.serve.engine import Engine, Event, Sequence
from kvexport.serve.errors import APIError
from kvexport.serve.limits import PREPARE_THREADS, Limits, RequestGate, clip, decode_json, read_body
from kvexport.serve.model import ServedModel
from kvexport.serve.openai_api import Reply, chat_prompt, completion_prompts, sequences
from kvexport.serve.schemas import ChatRequest, CompletionRequest, parse


class ErrorResponse(JSONResponse):
    """OpenAI's error object, ASCII-escaped (a message never fails to render, whatever it quotes)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


class SequenceStream(StreamingResponse):
    """A streamed answer that cancels its sequences however it ends, also when the client was gone before the
    first event was sent (the event generator then never runs, nor its own clean-up)."""

    def __init__(self, engine: Engine, seqs: list[Sequence], content, **kw):
        super().__init__(content, **kw)
        self.engine, self.seqs = engine, seqs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.seqs:
                if s.state != "done":
                    self.engine.cancel(s)


def build_app(model: ServedModel, engine: Engine, limits: Limits) -> Starlette:
    """The ASGI app serving ``model`` through ``engine`` (started and stopped with the app's lifespan), refusing
    what passes ``limits`` (resolved: :meth:`Limits.resolve`) before doing the work."""
    created = int(time.time())
    inflight = {"requests_in_flight": 0}  # kept by the RequestGate
    card = {"id": model.name, "object": "model", "created": created, "owned_by": "kvexport"}

    @asynccontextmanager
    async def lifespan(app):
        app.state.preparing = anyio.CapacityLimiter(PREPARE_THREADS)
        loop = asyncio.get_running_loop()
        engine.publish = lambda events: loop.call_soon_threadsafe(_dispatch, events)
        if not engine.alive:
            engine.start()
        yield
        engine.stop()

    async def health(request: Request) -> Response:
        state = "draining" if app.state.draining else ("ok" if engine.alive else "engine stopped")
        return JSONResponse({"status": state, "model": model.name, **engine.counts(), **inflight},
                            status_code=200 if state == "ok" else 503)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def one_model(request: Request) -> Response:
        if request.path_params["model"] != model.name:
            raise _unknown_model(request.path_params["model"])
        return JSONResponse(card)

    async def metrics(request: Request) -> Response:
        import psutil

        gauges = {**engine.counts(), **inflight, "rss": psutil.Process().memory_info().rss}
        text = metrics_mod.render(engine.metrics, gauges, model.backend.resident_bytes())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Response:
        if app.state.draining or not engine.alive:
            raise APIError(503, "The server is shutting down; retry on another instance.", "server_overloaded")
        try:
            raw = await read_body(request, limits.max_body_bytes)
        except ClientDisconnect:  # the client left while sending: nobody reads an answer
            return Response(status_code=499)
        # parsing and tokenizing (bounded by the limits) run beside the event loop, so the streams being served go
        # on, PREPARE_THREADS at a time, so what waits is the bodies' bytes
        req, seqs = await anyio.to_thread.run_sync(_prepare, raw, chat, limiter=app.state.preparing)
        del raw
        reply = Reply(model.name, chat, req.return_token_ids)
        queue: asyncio.Queue = asyncio.Queue()
        for i, s in enumerate(seqs):
            s.sink = lambda ev, i=i: queue.put_nowait((i, ev))
        _admit(seqs)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return SequenceStream(engine, seqs, _stream(engine, reply, seqs, queue, usage),
                                  media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, engine, reply, seqs, queue)

    def _admit(seqs: list[Sequence]) -> None:
        """Queue the request's sequences, or refuse it: 400 when it alone asks more than the queue may hold, 503
        while the queue is full."""
        asked = sum(len(s.prompt) + s.max_tokens for s in seqs)
        if asked > limits.max_queued_tokens:
            raise APIError(400, f"This request asks for {asked:,} tokens (prompts and max_tokens); this server queues "
                           f"at most {limits.max_queued_tokens:,} (--max-queued-tokens).", "invalid_request_error",
                           None, "request_too_large")
        why = engine.submit_all(seqs)
        if why is not None:
            what = {"queue": f"{limits.max_queue} sequences wait for a slot", "tokens": f"the sequences waiting for a "
                    f"slot hold {limits.max_queued_tokens:,} tokens", "stopped": "it is stopping"}[why]
            raise APIError(503, f"The server is overloaded ({what}); retry later.", "server_overloaded")

    def _prepare(raw: bytes, chat: bool):
        """The body's bytes -> (the request, its sequences), or the refusal (an APIError)."""
        req = parse(ChatRequest if chat else CompletionRequest, decode_json(raw, limits.max_json_depth))
        if req.model != model.name:
            raise _unknown_model(req.model)
        prompts = [chat_prompt(req, model, limits)] if chat else completion_prompts(req, model, limits)
        return req, sequences(req, prompts, model, chat, limits)

    async def on_api_error(request: Request, exc: APIError) -> Response:
        if exc.status < 500:
            engine.metrics.count("rejected")
        return ErrorResponse(exc.body(), status_code=exc.status)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        return await on_api_error(request, APIError(exc.status_code, f"{request.method} {clip(request.url.path)}: "
                                                    f"{exc.detail}", "invalid_request_error"))

    async def on_error(request: Request, exc: Exception) -> Response:
        """A fault of the server's own (never a client's doing): 500, and Starlette hands it on to be logged."""
        return ErrorResponse(APIError(500, f"internal error: {exc.__class__.__name__}: {exc}", "server_error").body(),
                             status_code=500)

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                            Route("/v1/models/{model:path}", one_model), Route("/metrics", metrics),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat, methods=["POST"])],
                    exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_error},
                    middleware=[Middleware(RequestGate, limit=limits.max_requests,
                                           paths=("/v1/completions", "/v1/chat/completions"), counts=inflight)],
                    lifespan=lifespan)
    app.state.draining = False
    return app


def _unknown_model(name: str) -> APIError:
    name = name if len(name) <= 80 else name[:77] + "..."
    return APIError(404, f"The model '{name}' does not exist or you do not have access to it.",
                    "invalid_request_error", "model", "model_not_found")


def _dispatch(events: list[tuple[Sequence, Event]]) -> None:
    """On the event loop: each sequence's events to its request."""
    for s, ev in events:
        if s.sink is not None:
            s.sink(ev)


def _failure(ev: Event) -> APIError | None:
    """The error a sequence's last event stands for (None: it finished normally)."""
    if ev.finish == "error":
        return APIError(500, f"generation failed: {ev.error}", "server_error")
    if ev.finish == "cancelled":
        return APIError(503, "the server stopped before the completion finished", "server_overloaded")
    return None


async def _collect(request: Request, engine: Engine, reply: Reply, seqs: list[Sequence],
                   queue: asyncio.Queue) -> Response:
    """Wait for every sequence of a non-streamed request (or the client's disconnect, which cancels them)."""
    texts = [""] * len(seqs)

    async def results() -> APIError | None:
        left = len(seqs)
        while left:
            i, ev = await queue.get()
            texts[i] += ev.text
            if ev.finish is not None:
                left -= 1
                if _failure(ev) is not None:
                    return _failure(ev)
        return None

    done, gone = asyncio.ensure_future(results()), asyncio.ensure_future(_disconnected(request))
    try:
        finished, _ = await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (the server stops)
        gone.cancel()
        if not done.done():  # the client left (or the server cancelled this request): free the slots
            done.cancel()
            for s in seqs:
                engine.cancel(s)
    if done not in finished:  # the client went away: nobody reads an answer
        return Response(status_code=499)
    err = done.result()
    if err is not None:
        raise err
    return JSONResponse(reply.full(seqs, texts))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(engine: Engine, reply: Reply, seqs: list[Sequence], queue: asyncio.Queue, usage: bool):
    """Server-sent events: a chunk per choice and wake-up (the pieces that arrived together are merged), then
    ``[DONE]``. Leaving early (the client disconnected) cancels the sequences still running."""
    try:
        if reply.chat:
            for i in range(len(seqs)):
                yield _sse(reply.chunk(i, None, None, role=True))
        left = len(seqs)
        while left:
            got = [await queue.get()]
            while not queue.empty():
                got.append(queue.get_nowait())
            merged: dict[int, list] = {}
            for i, ev in got:
                m = merged.setdefault(i, ["", [], None, None])
                m[0] += ev.text
                if ev.token is not None:
                    m[1].append(ev.token)
                if ev.finish is not None:
                    m[2], m[3] = ev.finish, _failure(ev)
            for i, (text, tokens, finish, err) in merged.items():
                if err is not None:
                    yield _sse(err.body())
                    left -= 1
                    continue
                if text or finish or tokens:
                    yield _sse(reply.chunk(i, text, finish, tokens))
                left -= finish is not None
        if usage:
            yield _sse(reply.usage_chunk(seqs))
        yield "data: [DONE]\n\n"
    finally:
        for s in seqs:
            if s.state != "done":
                engine.cancel(s)


__all__ = ["build_app"]
