# SPDX-License-Identifier: Apache-2.0
"""What the server counts, and its Prometheus text rendering (``GET /metrics``).

Counters only grow (requests by outcome, tokens, steps, compactions); gauges are read when rendered (active and
queued sequences, resident cache bytes per slot and in total, the process's resident set). ``tokens_per_second``
is the rate of generated tokens over the last ``window`` seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Metrics:
    window: float = 10.0
    started: float = field(default_factory=time.monotonic)
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("ok", "cancelled", "error", "rejected"), 0))
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0
    compactions: int = 0
    _recent: deque = field(default_factory=deque)  # (time, tokens) per engine tick
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def tick(self, tokens: int) -> None:
        """An engine tick that generated ``tokens`` tokens."""
        now = time.monotonic()
        with self._lock:
            self.generated_tokens += tokens
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - self.window:
                self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - self.window]
        if not recent:
            return 0.0
        span = min(self.window, now - self.started)
        return sum(n for _, n in recent) / max(span, 1e-9)


def render(metrics: Metrics, gauges: dict, resident: dict) -> str:
    """Prometheus text exposition (version 0.0.4) of ``metrics``, the engine's ``gauges`` and ``resident`` bytes
    (:meth:`SlotBackend.resident_bytes`)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP kvexport_{name} {help_}")
        lines.append(f"# TYPE kvexport_{name} {kind}")
        for labels, v in samples:
            lines.append(f"kvexport_{name}{labels} {v:.6g}" if isinstance(v, float) else f"kvexport_{name}{labels} {v}")

    with metrics._lock:
        req = dict(metrics.requests)
        counters = (metrics.prompt_tokens, metrics.generated_tokens, metrics.prefill_chunks, metrics.decode_steps,
                    metrics.compactions)
    metric("requests_total", "counter", "Requests by outcome (rejected: a 4xx answer).",
           [(f'{{outcome="{k}"}}', v) for k, v in req.items()])
    for name, v, h in zip(("prompt_tokens_total", "generated_tokens_total", "prefill_chunks_total",
                           "decode_steps_total", "compactions_total"), counters,
                          ("Prompt tokens admitted.", "Tokens generated.", "Prefill chunks run.",
                           "Decode steps run (one per tick, all decoding sequences together).",
                           "Cache compactions (prefill and decode)."), strict=True):
        metric(name, "counter", h, [("", v)])
    metric("tokens_per_second", "gauge", f"Generated tokens per second over the last {metrics.window:g} s.",
           [("", float(metrics.tokens_per_second()))])
    for name, h in (("active_sequences", "Sequences holding a cache slot."),
                    ("queued_sequences", "Sequences waiting for a slot."),
                    ("queued_tokens", "Prompt and max_tokens of the sequences waiting for a slot."),
                    ("requests_in_flight", "Completion requests being read, waiting, generating or streaming."),
                    ("slots", "Cache slots sequences are admitted to.")):
        metric(name, "gauge", h, [("", int(gauges[name]))])
    per = resident["per_slot"]["total"]
    metric("resident_cache_bytes", "gauge", "Cache bytes allocated per slot (fixed), by slot.",
           [(f'{{slot="{r}"}}', per) for r in range(int(resident["slots"]))])
    metric("resident_cache_bytes_total", "gauge", "All cache bytes allocated: every slot and the shared step "
           "buffers.", [("", int(resident["total"]))])
    metric("process_resident_memory_bytes", "gauge", "Resident set size of the server process.",
           [("", int(gauges["rss"]))])
    metric("uptime_seconds", "gauge", "Seconds since the server started.",
           [("", float(time.monotonic() - metrics.started))])
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value} (the lines :func:`render` writes)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


__all__ = ["Metrics", "render", "parse"]
