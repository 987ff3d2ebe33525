# SPDX-License-Identifier: Apache-2.0
"""``kvexport serve`` under load: one stream against N concurrent streams, and memory over a long run.

    python -m benchmarks.bench_serve                 # student, SnapKV 256 + 32, 16 streams, 500-request soak
    python -m benchmarks.bench_serve --quick         # 4 streams, 40-request soak (a smoke run, minutes)
    python -m benchmarks.bench_serve --export DIR --streams 8 --tokens 32 --out /tmp/bs

The server runs as its own process (``python -m kvexport serve EXPORT --port 0``) on loopback; the client is one
asyncio loop speaking HTTP/1.1 and reading the server-sent events itself (no client library: its cost would be
counted as the server's). Each request sends a prompt of ``--prompt`` random token ids and asks for ``--tokens``
tokens with ``ignore_eos``, so every request does the same work. The export (``batch=1``,
``decode_batch=--streams``) is built once and cached (``KVEXPORT_BENCH_CACHE``, default ``~/.cache/kvexport/bench``).

Phases, one run each:
1. one stream: requests one after the other; tokens/s = tokens received / wall time;
2. N streams: N clients at once, each sending its requests back to back; aggregate tokens/s the same way;
   phases 1 and 2 alternate ``--rounds`` times (a shared machine's load drifts) and the medians are reported;
3. soak: ``--requests`` requests from N clients; the server's resident set (RSS) and its reported cache bytes are
   sampled every ``--sample-every`` requests; every request must come back complete.

Targets (docs/serve.md): aggregate >= 4x one stream; RSS and cache bytes flat within +-5 %; no request lost.
Writes ``serve_results.json`` and prints a Markdown table; no assertion fails the run (the numbers are the result).

``--profile`` instead runs the engine in this process, without HTTP, and says where its time goes: one stream, then
N, each sequence as above, the backend's calls timed (prefill chunks, decode steps: batched or slot by slot) and
the rest of each tick (sampling, text, scheduling) as host time; tokens/s without HTTP beside the HTTP numbers of a
normal run show what the server and client cost. ``--backend pytorch`` serves (or profiles) the PyTorch backend;
``--slots`` sets ``--max-sequences`` apart from ``--streams`` (default: as many as streams; 0: the server's own
default, the export's decode_batch or 4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from kvexport.cache.plan import DEFAULT_WINDOW

REPO = Path(__file__).resolve().parents[1]


def build_export(cache: Path, budget: int, window: int, chunk: int, streams: int) -> Path:
    """The student exported with SnapKV ``budget`` + ``window`` and a ``decode_batch`` of ``streams`` (cached)."""
    out = cache / f"serve-student-snapkv{budget}w{window}c{chunk}-db{streams}"
    if (out / "manifest.json").is_file():
        return out
    from kvexport.export import export_model

    t0 = time.perf_counter()
    export_model(str(REPO / "models" / "kvx-student"), out, press="snapkv", budget=budget, window=window, chunk=chunk,
                 batch=1, decode_batch=streams, force=True)
    print(f"exported {out} in {time.perf_counter() - t0:.0f} s (once; cached)", file=sys.stderr)
    return out


class Server:
    """``kvexport serve`` in a subprocess; ``host``/``port`` from its first line, ``pid`` for its RSS."""

    def __init__(self, export: Path, threads: int, slots: int, decode: str = "auto", backend: str = "onnxruntime"):
        cmd = [sys.executable, "-m", "kvexport", "serve", str(export), "--port", "0", "--model-name", "m",
               "--threads", str(threads), "--backend", backend, *(["--max-sequences", str(slots)] if slots else []),
               "--decode", decode]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        line = self.proc.stdout.readline()
        m = re.search(r"on http://([\d.]+):(\d+)", line)
        if not m:
            raise SystemExit(f"the server did not start: {line}{self.proc.stderr.read()}")
        self.host, self.port, self.pid, self.banner = m.group(1), int(m.group(2)), self.proc.pid, line.strip()

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.pid).memory_info().rss

    def stop(self) -> int:
        self.proc.terminate()
        self.proc.communicate(timeout=60)
        return self.proc.returncode


async def _request(host: str, port: int, method: str, path: str, body: dict | None = None):
    """(status, headers, reader, writer) of one HTTP/1.1 request on a fresh connection."""
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode() if body is not None else b""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return status, headers, reader, writer


async def _chunks(reader):
    """The decoded pieces of a chunked body."""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


async def stream_completion(host: str, port: int, body: dict) -> dict:
    """One streamed completion: tokens received, finish reason, time to first token, wall time."""
    t0 = time.perf_counter()
    status, headers, reader, writer = await _request(host, port, "POST", "/v1/completions", {**body, "stream": True})
    tokens, finish, first, done, buf = 0, None, None, False, b""
    async for piece in _chunks(reader):
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            payload = event[len(b"data: "):]
            if payload == b"[DONE]":
                done = True
                continue
            doc = json.loads(payload)
            for c in doc.get("choices", []):
                n = len(c.get("token_ids", []))
                if n and first is None:
                    first = time.perf_counter() - t0
                tokens += n
                finish = c.get("finish_reason") or finish
    writer.close()
    return {"status": status, "tokens": tokens, "finish": finish, "ttft": first, "wall": time.perf_counter() - t0,
            "done": done}


async def get(host: str, port: int, path: str) -> str:
    status, headers, reader, writer = await _request(host, port, "GET", path)
    body = b"".join([p async for p in _chunks(reader)]) if headers.get("transfer-encoding") == "chunked" else \
        await reader.read()
    writer.close()
    return body.decode()


async def run_clients(host: str, port: int, bodies: list[dict], clients: int, on_done=None) -> tuple[list, float]:
    """``bodies`` sent by ``clients`` concurrent clients, each request after its previous one; -> results, wall."""
    results: list = [None] * len(bodies)
    nxt = iter(range(len(bodies)))

    async def client():
        for i in nxt:
            results[i] = await stream_completion(host, port, bodies[i])
            if on_done is not None:
                await on_done(sum(r is not None for r in results))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - t0


def bodies(n: int, prompt: int, tokens: int, seed: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"model": "m", "prompt": rng.integers(3, 4000, prompt).tolist(), "max_tokens": tokens, "temperature": 0,
             "ignore_eos": True, "return_token_ids": True} for _ in range(n)]


def complete(results: list, tokens: int) -> int:
    return sum(1 for r in results if r and r["status"] == 200 and r["done"] and r["tokens"] == tokens
               and r["finish"] == "length")


async def bench(args, server: Server) -> dict:
    from kvexport.serve.metrics import parse

    h, p = server.host, server.port
    await run_clients(h, p, bodies(args.streams, args.prompt, 8, 0), args.streams)  # warm-up: every slot once
    rounds = []  # one stream, then N streams, alternated: a drift of the machine's load hits both alike
    for k in range(args.rounds):
        single, t1 = await run_clients(h, p, bodies(args.single_requests, args.prompt, args.tokens, 10 + k), 1)
        multi, tn = await run_clients(h, p, bodies(args.streams * args.per_stream, args.prompt, args.tokens, 20 + k),
                                      args.streams)
        rounds.append({"one": sum(r["tokens"] for r in single) / t1, "n": sum(r["tokens"] for r in multi) / tn,
                       "single": single, "multi": multi, "loadavg": os.getloadavg()[0]})
    tps1 = _median([r["one"] for r in rounds])
    tpsn = _median([r["n"] for r in rounds])
    single = [x for r in rounds for x in r["single"]]
    multi = [x for r in rounds for x in r["multi"]]
    before = parse(await get(h, p, "/metrics"))
    samples = []

    async def sample(done: int) -> None:
        if done % args.sample_every == 0:
            m = parse(await get(h, p, "/metrics"))
            samples.append({"requests": done, "rss": server.rss(),
                            "cache_bytes": int(m["kvexport_resident_cache_bytes_total"])})

    samples.append({"requests": 0, "rss": server.rss(), "cache_bytes": int(before["kvexport_resident_cache_bytes_total"])})
    soak, ts = await run_clients(h, p, bodies(args.requests, args.prompt, args.tokens, 3), args.streams, sample)
    after = parse(await get(h, p, "/metrics"))
    rss = [s["rss"] for s in samples]
    cache = [s["cache_bytes"] for s in samples]
    ok = complete(soak, args.tokens)
    served = int(after['kvexport_requests_total{outcome="ok"}'] - before['kvexport_requests_total{outcome="ok"}'])
    return {
        "one_stream": {"requests": len(single), "tokens_per_s": tps1, "complete": complete(single, args.tokens),
                       "ttft_s_median": _median([r["ttft"] for r in single])},
        "n_streams": {"streams": args.streams, "requests": len(multi), "tokens_per_s": tpsn,
                      "complete": complete(multi, args.tokens), "ttft_s_median": _median([r["ttft"] for r in multi])},
        "ratio": tpsn / tps1,
        "rounds": [{"one_stream_tokens_per_s": r["one"], "n_streams_tokens_per_s": r["n"], "ratio": r["n"] / r["one"],
                    "loadavg_1min": r["loadavg"]} for r in rounds],
        "soak": {"requests": args.requests, "complete": ok, "served_ok": served, "wall_s": ts,
                 "tokens_per_s": sum(r["tokens"] for r in soak if r) / ts, "samples": samples,
                 "rss_spread": (max(rss) - min(rss)) / min(rss), "cache_spread": (max(cache) - min(cache)) / min(cache),
                 "errors": int(after['kvexport_requests_total{outcome="error"}']),
                 "cancelled": int(after['kvexport_requests_total{outcome="cancelled"}'])},
    }


def workload_ceiling(res: dict, streams: int, tokens: int) -> dict | None:
    """The most N streams can gain over one on this workload when every prompt's prefill is compute (as on a CPU:
    N prompts cost N times one, batched or not) and every step of N rows costs one batched call: one stream spends
    ``P + T * t1`` per request (P: its median time to first token, T new tokens, t1 a batch-1 step), N streams at
    best ``N * P + T * t_N`` for N requests -> ``N * (P + T * t1) / (N * P + T * t_N)``."""
    g, a = res.get("graph_ceiling"), res["one_stream"]
    if not g or g["rows"] < streams or a["ttft_s_median"] is None:
        return None
    P, t1, tn = a["ttft_s_median"], g["decode_ms"] / 1e3, g["decode_batch_ms"] / 1e3
    return {"prefill_s": P, "ratio": streams * (P + tokens * t1) / (streams * P + tokens * tn)}


def _median(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def machine() -> dict:
    import platform

    model = "unknown"
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "loadavg": list(os.getloadavg())}


def markdown(res: dict) -> str:
    a, b, s = res["one_stream"], res["n_streams"], res["soak"]
    cfg = res["config"]
    verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    per_round = ", ".join(f"{r['ratio']:.2f}x" for r in res["rounds"])
    return "\n".join([
        "| measure | value | target |", "|---|---|---|",
        f"| one stream | {a['tokens_per_s']:.0f} tokens/s (TTFT {a['ttft_s_median'] * 1e3:.0f} ms) | |",
        f"| {b['streams']} streams | {b['tokens_per_s']:.0f} tokens/s aggregate (TTFT {b['ttft_s_median'] * 1e3:.0f} ms)"
        f" | |",
        f"| ratio | {res['ratio']:.2f}x (rounds: {per_round}) | >= 4x: {verdict(res['ratio'] >= 4)} |",
        f"| soak | {s['complete']}/{s['requests']} complete, {s['served_ok']} served, {s['errors']} errors, "
        f"{s['tokens_per_s']:.0f} tokens/s | no request lost: {verdict(s['complete'] == s['requests'])} |",
        f"| server RSS over the soak | spread {s['rss_spread'] * 100:.2f} % "
        f"({min(x['rss'] for x in s['samples']) / 2**20:.1f}-{max(x['rss'] for x in s['samples']) / 2**20:.1f} MiB) "
        f"| +-5 %: {verdict(s['rss_spread'] <= 0.05)} |",
        f"| cache bytes over the soak | spread {s['cache_spread'] * 100:.2f} % "
        f"({s['samples'][0]['cache_bytes'] / 2**20:.2f} MiB) | +-5 %: {verdict(s['cache_spread'] <= 0.05)} |",
        *([f"| graph ceiling (timed at start) | {g['rows']} rows in one decode_batch call {g['decode_batch_ms']:.2f} ms, "
           f"one row {g['decode_ms']:.2f} ms: {g['ratio']:.2f}x | |"] if (g := res.get("graph_ceiling")) else []),
        *([f"| workload ceiling (prefill is compute: N prompts cost N x one) | {w['ratio']:.2f}x (one prompt's "
           f"prefill {w['prefill_s'] * 1e3:.0f} ms) | |"] if (w := res.get("workload_ceiling")) else []),
        "", f"prompt {cfg['prompt']} tokens, {cfg['tokens']} new tokens per request, {cfg['threads']} onnxruntime "
        f"thread(s); {res['machine']['cpu']}, {res['machine']['cores']} cores, load average "
        f"{res['machine']['loadavg_start'][0]:.2f} at the start, {res['machine']['loadavg'][0]:.2f} at the end",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, help="an export to serve (default: the student, built and cached)")
    ap.add_argument("--quick", action="store_true", help="4 streams, 40-request soak")
    ap.add_argument("--streams", type=int, help="concurrent streams (default 16; 4 with --quick)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--single-requests", type=int, default=8, help="requests of the one-stream phase")
    ap.add_argument("--per-stream", type=int, default=4, help="requests per client in the N-stream phase")
    ap.add_argument("--rounds", type=int, default=3, help="one-stream / N-stream phase pairs (medians reported)")
    ap.add_argument("--requests", type=int, help="requests of the soak (default 500; 40 with --quick)")
    ap.add_argument("--sample-every", type=int, help="soak requests between memory samples (default 50)")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads of the server")
    ap.add_argument("--decode", default="auto", help="the server's --decode (auto, batched, rows)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--backend", default="onnxruntime", help="the server's --backend (onnxruntime, pytorch)")
    ap.add_argument("--slots", type=int, help="the server's --max-sequences (default: --streams; 0: the server's "
                    "own default)")
    ap.add_argument("--profile", action="store_true", help="the engine in this process, no HTTP: where the time "
                    "goes (benchmarks/serve_profile.py)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvexport-bench-serve"))
    args = ap.parse_args(argv)
    args.streams = args.streams or (4 if args.quick else 16)
    args.slots = args.streams if args.slots is None else args.slots
    args.requests = args.requests or (40 if args.quick else 500)
    args.sample_every = args.sample_every or (10 if args.quick else 50)
    from benchmarks.prepare import default_cache

    export = args.export or build_export(default_cache(), args.budget, args.window, args.chunk, args.streams)
    info = {**machine(), "loadavg_start": list(os.getloadavg())}
    if args.profile:
        return run_profile(args, export, info)
    server = Server(export, args.threads, args.slots, args.decode, args.backend)
    try:
        res = asyncio.run(bench(args, server))
    finally:
        rc = server.stop()
    res["machine"] = {**info, "loadavg": list(os.getloadavg())}
    m = re.search(r"decode_batch ([\d.]+) ms for (\d+) rows, decode ([\d.]+) ms per slot", server.banner)
    if m:  # the most batching can give at the graph level: N rows in one call vs N calls of one row
        tb, n, t1 = float(m.group(1)), int(m.group(2)), float(m.group(3))
        res["graph_ceiling"] = {"decode_batch_ms": tb, "rows": n, "decode_ms": t1, "ratio": n * t1 / tb}
        res["workload_ceiling"] = workload_ceiling(res, args.streams, args.tokens)
    res["config"] = {"export": str(export), "streams": args.streams, "slots": args.slots, "tokens": args.tokens,
                     "prompt": args.prompt, "threads": args.threads, "decode": args.decode, "backend": args.backend,
                     "server": server.banner, "server_exit": rc}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_results.json").write_text(json.dumps(res, indent=2) + "\n")
    print(markdown(res))
    print(f"\nwrote {args.out / 'serve_results.json'}")
    return 0


def run_profile(args, export: Path, info: dict) -> int:
    from benchmarks import serve_profile

    res = serve_profile.profile(export, args.streams, args.prompt, args.tokens, args.backend, args.slots or None,
                                args.threads, args.decode, args.single_requests, args.per_stream)
    res["machine"] = {**info, "loadavg": list(os.getloadavg())}
    res["config"] = {"export": str(export), "streams": args.streams, "slots": args.slots, "tokens": args.tokens,
                     "prompt": args.prompt, "threads": args.threads, "decode": args.decode, "backend": args.backend}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_profile.json").write_text(json.dumps(res, indent=2) + "\n")
    print(serve_profile.markdown(res))
    print(f"load average {info['loadavg_start'][0]:.2f} at the start, {res['machine']['loadavg'][0]:.2f} at the end; "
          f"wrote {args.out / 'serve_profile.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
