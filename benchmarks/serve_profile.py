# SPDX-License-Identifier: Apache-2.0
"""Where a server's time goes: the engine in this process, no HTTP, stepped by hand (``bench_serve --profile``).

Each of ``streams`` clients keeps one sequence in the engine (a closed loop, as the HTTP clients do: the next is
submitted when the last ends); every sequence has the same prompt length and ``tokens`` new tokens (EOS ignored).
The backend's calls are timed where the engine makes them: ``start`` (a slot's reset), ``prefill`` (one chunk),
``decode`` (one step of every decoding sequence: one batched call or one call per slot); the rest of each tick is
``host`` (sampling, incremental text, scheduling). One stream and ``streams`` streams are run back to back.
"""

from __future__ import annotations

import os
import time

import numpy as np


def _timed(backend, name: str, acc: dict) -> None:
    """Wrap ``backend.<name>`` so its calls add their seconds (and, for decode, their rows) to ``acc``."""
    fn = getattr(backend, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[name] += time.perf_counter() - t0
            acc[name + "_calls"] += 1
            if name == "decode":
                acc["decode_rows"] += len(a[0])

    setattr(backend, name, wrapper)


def _phase(model, streams: int, requests: int, prompt: int, tokens: int, seed: int, acc: dict) -> dict:
    from kvexport.serve import Engine, Sequence

    rng = np.random.default_rng(seed)
    engine = Engine(model.backend, model.tokenizer, max_queue=10**6)
    todo = [rng.integers(3, min(4000, model.backend.vocab_size), prompt).tolist() for _ in range(requests)]
    live, made = 0, 0

    def submit() -> None:
        nonlocal live
        if todo:
            engine.submit(Sequence(todo.pop(), tokens))
            live += 1

    for _ in range(streams):
        submit()
    for k in acc:
        acc[k] = 0
    t0 = time.perf_counter()
    while live:
        for _, ev in engine.step():
            made += ev.token is not None
            if ev.finish is not None:
                live -= 1
                submit()
    wall = time.perf_counter() - t0
    engine.stop()
    backend = sum(acc[k] for k in ("start", "prefill_step", "decode"))
    return {"streams": streams, "requests": requests, "tokens": made, "wall_s": wall, "tokens_per_s": made / wall,
            "seconds": {"prefill": acc["prefill_step"], "decode": acc["decode"], "start": acc["start"],
                        "host": wall - backend},
            "decode_calls": acc["decode_calls"], "decode_rows_per_call": acc["decode_rows"] / max(1, acc["decode_calls"]),
            "prefill_chunks": acc["prefill_step_calls"], "loadavg_1min": os.getloadavg()[0]}


def profile(export, streams: int, prompt: int, tokens: int, backend: str = "onnxruntime", slots: int | None = None,
            threads: int = 1, decode: str = "auto", single_requests: int = 4, per_stream: int = 2) -> dict:
    """One stream, then ``streams`` streams, on ``export`` served by ``backend`` with ``slots`` slots (default: as
    the server's); -> per phase tokens/s and seconds by part."""
    from kvexport.serve import open_model

    model = open_model(export, backend, slots or None, threads, "m", decode)
    acc = dict.fromkeys(("start", "prefill_step", "decode", "start_calls", "prefill_step_calls", "decode_calls",
                         "decode_rows"), 0)
    for name in ("start", "prefill_step", "decode"):
        _timed(model.backend, name, acc)
    _phase(model, 1, 1, prompt, 4, 99, acc)  # warm-up
    one = _phase(model, 1, single_requests, prompt, tokens, 1, acc)
    many = _phase(model, streams, streams * per_stream, prompt, tokens, 2, acc)
    out = {"backend": model.backend.name, "slots": model.backend.n_slots, "describe": model.backend.describe(),
           "one": one, "many": many, "ratio": many["tokens_per_s"] / one["tokens_per_s"]}
    model.backend.close()
    return out


def _part(ph: dict, k: str) -> str:
    sec = ph["seconds"][k]
    return f"{sec / ph['tokens'] * 1e3:.2f} ms/token ({sec / ph['wall_s']:.0%})"


def markdown(res: dict) -> str:
    rows = ["| streams | tokens/s | prefill | decode | host | decode calls (rows per call) | prefill chunks | load |",
            "|---|---|---|---|---|---|---|---|"]
    for ph in (res["one"], res["many"]):
        parts = " | ".join(_part(ph, k) for k in ("prefill", "decode", "host"))
        rows.append(f"| {ph['streams']} | {ph['tokens_per_s']:.0f} | {parts} | {ph['decode_calls']} "
                    f"({ph['decode_rows_per_call']:.1f}) | {ph['prefill_chunks']} | {ph['loadavg_1min']:.1f} |")
    rows.append(f"\nengine alone, no HTTP: {res['many']['streams']} streams / one = {res['ratio']:.2f}x; {res['backend']}"
                f", {res['slots']} slots; {res['describe']}")
    return "\n".join(rows)


__all__ = ["profile", "markdown"]
