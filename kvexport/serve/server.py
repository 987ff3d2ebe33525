# SPDX-License-Identifier: Apache-2.0
"""Running the server: ``serve(DIR, ...)`` (what ``kvexport serve`` calls) and :class:`ServerThread` (tests, the
benchmark, embedding).

Order: the model and its backend are opened first (a missing backend or a bad directory is refused with one
line), then the port is bound (a port in use is one line too), then uvicorn serves. SIGTERM or SIGINT drains: the
listening socket closes, the requests in flight run to their end for at most ``drain_timeout`` seconds (then they
are cancelled), the engine stops and ``serve`` returns 0; a second SIGINT stops at once.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
from pathlib import Path

from kvexport.errors import BadUsage
from kvexport.serve.app import build_app
from kvexport.serve.engine import Engine
from kvexport.serve.limits import Limits
from kvexport.serve.model import ServedModel, open_model

#: seconds uvicorn waits beyond the drain deadline for the cancelled requests to send their last bytes
GRACE = 5.0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); BadUsage when it cannot be had."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(2048)
    except OSError as e:
        raise BadUsage(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def _uvicorn_server(app, drain_timeout: float, on_signal=None):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with signals that end ``serve`` cleanly: no re-raised signal after the drain."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        def handle_exit(self, sig, frame):
            if on_signal is not None and not self.should_exit:
                on_signal(sig)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout)
    return Server(config)


def make_app(model: ServedModel, limits: Limits | None = None, track_kept: bool = False):
    """(the app, its engine) for ``model`` under ``limits`` (default: :class:`Limits` ()), resolved for the model."""
    limits = (limits or Limits()).resolve(model.limit, model.tokenizer)
    engine = Engine(model.backend, model.tokenizer, max_queue=limits.max_queue, track_kept=track_kept,
                    max_queued_tokens=limits.max_queued_tokens)
    app = build_app(model, engine, limits)
    app.state.limits = limits
    return app, engine


def serve(directory: str | Path, host: str = "127.0.0.1", port: int = 8000, backend: str = "onnxruntime",
          max_sequences: int | None = None, threads: int | None = None, name: str | None = None,
          drain_timeout: float = 30.0, decode: str = "auto", limits: Limits | None = None, prepack: bool = True) -> int:
    """Serve ``directory`` until SIGTERM/SIGINT (see the module docstring); returns the exit status, 0."""
    import asyncio

    if drain_timeout < 0:
        raise BadUsage(f"--drain-timeout {drain_timeout} must be >= 0")
    model = open_model(directory, backend, max_sequences, threads, name, decode, prepack)
    app, engine = make_app(model, limits)
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    res = model.backend.resident_bytes()

    def on_signal(sig) -> None:
        app.state.draining = True
        n = engine.counts()
        print(f"{signal.Signals(sig).name}: draining {n['active_sequences']} active and {n['queued_sequences']} "
              f"queued sequence(s) (at most {drain_timeout:g} s)", file=sys.stderr, flush=True)
        # at the deadline the engine cancels what is left: each request then ends with an error of its own
        # (uvicorn's own deadline, later, would cancel the request tasks and print their tracebacks)
        timer = threading.Timer(drain_timeout, engine.cancel_all)
        timer.daemon = True
        timer.start()

    server = _uvicorn_server(app, drain_timeout + GRACE, on_signal)
    print(f"serving {model.name} ({model.export_dir}, {model.backend.name}) on http://{host}:{bound} - "
          f"{model.backend.n_slots} sequences at once, {res['per_slot']['total'] / 2**20:.2f} MiB cache per slot, "
          f"{res['total'] / 2**20:.2f} MiB in all; context {model.limit} tokens; {model.backend.describe()}; "
          f"{app.state.limits.describe()}", flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        engine.stop()
        model.backend.close()
        sock.close()
    print("stopped", file=sys.stderr, flush=True)
    return 0


class ServerThread:
    """The server on ``host`` (a free port) in a background thread: ``with ServerThread(model) as srv: srv.url``.

    The engine is exposed as ``srv.engine`` (``track_kept=True`` keeps each sequence's compactions)."""

    def __init__(self, model: ServedModel, host: str = "127.0.0.1", track_kept: bool = False,
                 limits: Limits | None = None, drain_timeout: float = 5.0):
        self.model = model
        self.app, self.engine = make_app(model, limits, track_kept)
        self.sock = bind(host, 0)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = _uvicorn_server(self.app, drain_timeout + GRACE)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="kvexport-serve")

    def __enter__(self) -> "ServerThread":
        import time

        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.app.state.draining = True
        self.engine.cancel_all()
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


__all__ = ["serve", "bind", "ServerThread", "make_app"]
