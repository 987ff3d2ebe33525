# SPDX-License-Identifier: Apache-2.0
"""``kvexport serve`` as its own process on loopback, as a user runs it, for the tests that need the real thing:
its log (stderr, to a file read at any time: a traceback in it fails the test), its resident memory, raw HTTP and
the ``openai`` client against it."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[2]
#: what must never be in the server's log for a client's doing
FAULTS = ("Traceback", "Exception in ASGI", "ERROR", "error:")


class ServerProcess:
    """``kvexport serve DIR --port 0 --model-name m ARGS`` until :meth:`stop`; ``url``, ``pid``, ``banner`` (its
    first line) and :meth:`log` (its stderr so far)."""

    def __init__(self, directory: Path, *args: str, log_dir: Path, start_timeout: float = 300):
        self.log_path = log_dir / f"serve-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - open for the process's life
        self.proc = subprocess.Popen([sys.executable, "-m", "kvexport", "serve", str(directory), "--port", "0",
                                      "--model-name", "m", *args], stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.banner = self.proc.stdout.readline()
        m = re.search(r"on (http://127\.0\.0\.1:(\d+))", self.banner)
        if not m:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {self.banner}{self.log()}")
        self.url, self.port, self.pid = m.group(1), int(m.group(2)), self.proc.pid

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self, timeout: float = 120):
        """The ``openai`` client pointed at this server (no retries: a refusal is seen as it is)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def assert_clean_log(self) -> None:
        text = self.log()
        assert not any(f in text for f in FAULTS), text[-4000:]

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.pid).memory_info().rss

    def connect(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def send(self, path: str, body, method: str = "POST", headers: dict | None = None) -> tuple[int, dict]:
        """(status, JSON body) of one request; ``body`` a dict (sent as JSON) or bytes (sent as they are)."""
        c = self.connect()
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        raw = r.read()
        c.close()
        return r.status, json.loads(raw)

    def metrics(self) -> dict:
        from kvexport.serve.metrics import parse

        c = self.connect()
        c.request("GET", "/metrics")
        out = parse(c.getresponse().read().decode())
        c.close()
        return out

    def until(self, cond, what: str, deadline: float = 60) -> dict:
        """Poll the metrics until ``cond(metrics)`` holds (a bound on the wait, not a timing assertion)."""
        end = time.monotonic() + deadline
        while not cond(m := self.metrics()):
            assert time.monotonic() < end, f"not {what} after {deadline} s: {m}"
            time.sleep(0.05)
        return m

    def health(self) -> dict:
        return self.send("/health", None, "GET")[1]

    def until_idle(self, deadline: float = 60) -> dict:
        """Poll /health until no sequence is active or queued (a bound on the wait, not a timing assertion)."""
        end = time.monotonic() + deadline
        while True:
            h = self.health()
            if h["active_sequences"] == h["queued_sequences"] == h["queued_tokens"] == h["requests_in_flight"] == 0:
                return h
            assert time.monotonic() < end, f"still busy after {deadline} s: {h}"
            time.sleep(0.05)

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode


def host_port(url: str) -> tuple[str, int]:
    u = urlparse(url)
    return u.hostname, u.port
