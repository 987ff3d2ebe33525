# SPDX-License-Identifier: Apache-2.0
"""``kvexport serve`` as a user runs it (a subprocess): bad input is one line and a non-zero exit; a missing
backend is refused before the port is bound; its greedy answers to the ``openai`` client (streamed and not) are the
text ``kvexport generate`` prints for the same export, and for a conversion directory (an MLA export in DIR/onnx,
what the README serves); SIGTERM drains the requests in flight (bounded by
--drain-timeout) and exits 0 without a traceback; the README's curl example works against it."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]


def kvexport(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvexport", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def one_line_error(r: subprocess.CompletedProcess, code: int, match: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(match, lines[0]), r.stderr
    assert "serving" not in r.stdout


def test_tensorrt_is_refused_before_the_port_is_bound(export_dir):
    with socket.socket() as held:  # were the port bound first, this would fail as "cannot listen"
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = kvexport("serve", str(export_dir), "--backend", "tensorrt", "--port", str(port))
    one_line_error(r, 5, "TensorRT is not installed")


@pytest.mark.parametrize("args, code, match", [
    (["--port", "eighty"], 2, "Invalid value for '--port'"),
    (["--backend", "vllm"], 2, "--backend 'vllm' is not one of"),
    (["--max-sequences", "0"], 2, "--max-sequences 0 must be >= 1"),
    (["--max-sequences", "9"], 2, r"exceeds the export's decode batch \(4\)"),
    (["--drain-timeout", "-1"], 2, "--drain-timeout -1"),
    (["--decode", "fast"], 2, "--decode 'fast' is not one of: auto, batched, rows"),
    (["--backend", "pytorch", "--no-prepack"], 2, "--no-prepack applies to --backend onnxruntime"),
], ids=["port", "backend", "zero-sequences", "too-many-sequences", "drain", "decode", "prepack"])
def test_bad_cli_input_is_one_line(export_dir, args, code, match):
    one_line_error(kvexport("serve", str(export_dir), *args), code, match)


def test_bad_directories_are_one_line(export_dir, tmp_path):
    one_line_error(kvexport("serve", str(tmp_path / "nope")), 2, "is not a directory")
    one_line_error(kvexport("serve", str(tmp_path)), 4, "has no manifest.json")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        r = kvexport("serve", str(export_dir), "--port", str(held.getsockname()[1]))
    one_line_error(r, 2, "cannot listen on 127.0.0.1:")


def generate_text(export_dir: Path, prompt: str, n: int) -> str:
    """The completion ``kvexport generate EXPORT -p PROMPT -n N`` prints (``'prompt' -> 'text'``, reprs)."""
    r = subprocess.run([sys.executable, "-m", "kvexport", "generate", str(export_dir), "-p", prompt, "-n", str(n)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    head = f"{prompt[:60]!r} -> "
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(head)), None)
    assert line is not None, r.stdout
    return ast.literal_eval(line[len(head):])


def test_an_export_of_another_version_is_refused_at_start(export_dir, tmp_path):
    """Graphs that want host inputs this version does not give: one line before serving, not an error per request."""
    import shutil

    from kvexport.manifest import ONNX_EXPORT, read_manifest, write_manifest

    stale = tmp_path / "stale"
    shutil.copytree(export_dir, stale)
    doc = read_manifest(stale)
    doc["settings"]["graphs"]["prefill"]["inputs"].append("k_0_in")  # what an older export's prefill took
    write_manifest(stale, ONNX_EXPORT, doc["settings"], doc["model_hash"], tuple(doc["reports"]))
    one_line_error(kvexport("serve", str(stale), "--port", "0"), 4, r"prefill\.onnx wants inputs \['k_0_in'\]")


def test_batched_decode_needs_a_decode_batch_graph(export_dir, tmp_path):
    import shutil

    from kvexport.manifest import ONNX_EXPORT, read_manifest, write_manifest

    plain = tmp_path / "no-decode-batch"
    shutil.copytree(export_dir, plain)
    doc = read_manifest(plain)
    doc["settings"]["decode_batch"] = None
    del doc["settings"]["graphs"]["decode_batch"]
    write_manifest(plain, ONNX_EXPORT, doc["settings"], doc["model_hash"], tuple(doc["reports"]))
    one_line_error(kvexport("serve", str(plain), "--decode", "batched"), 2, "--decode batched needs a decode_batch "
                   "graph")


class Served:
    """``kvexport serve DIR --port 0`` in a subprocess; ``url`` from its first line."""

    def __init__(self, export_dir: Path, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvexport", "serve", str(export_dir), "--port", "0",
                                      "--model-name", "m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self.proc.stdout.readline()
        m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert m, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.url = m.group(1)

    def stop(self, timeout: float = 90) -> tuple[int, str, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


def stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict, threading.Event]:
    """A streamed completion read to its end in a thread: its events land in ``got['events']``; ``first`` is set
    once the first token arrived."""
    import http.client
    from urllib.parse import urlparse

    got: dict = {"events": [], "done": False}
    first = threading.Event()

    def run():
        u = urlparse(url)
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                got["done"] = True
            elif line.startswith("data: "):
                got["events"].append(json.loads(line[6:]))
                first.set()
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got, first


GENERATE_PROMPTS = ["def parse(", "class Config:\n    def __init__(self"]


def test_served_greedy_equals_kvexport_generate(export_dir, tokenizer):
    """The served greedy completion, streamed and not, decodes to the text ``kvexport generate`` prints (both
    decode with the special tokens, so an EOS shows in both)."""
    want = {p: generate_text(export_dir, p, 24) for p in GENERATE_PROMPTS}
    srv = Served(export_dir)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for p in GENERATE_PROMPTS:
            kw = dict(model="m", prompt=p, max_tokens=24, temperature=0, extra_body={"return_token_ids": True})
            ids = client.completions.create(**kw).choices[0].model_extra["token_ids"]
            streamed = [t for ch in client.completions.create(stream=True, **kw) for c in ch.choices
                        for t in (c.model_extra or {}).get("token_ids", [])]
            assert tokenizer.decode(ids) == tokenizer.decode(streamed) == want[p], p
    finally:
        rc, out, err = srv.stop()
    assert rc == 0 and "Traceback" not in err, err


def test_a_conversion_serves_its_onnx_export(mla_export_dir, tokenizer, tmp_path):
    """What the README's `kvexport serve out/kvx-student` serves: a conversion directory (its outputs verified,
    then DIR/onnx, an MLA export) answers as `kvexport generate DIR` does; served with --no-prepack (every
    session reads the one mapped copy of the weights) against generate's packed decode weights."""
    import shutil

    from kvexport import layout

    conv = tmp_path / "kvx-student"
    shutil.copytree(mla_export_dir, conv / layout.ONNX_DIR)
    (conv / layout.CONVERT_JSON).write_text("{}\n")
    layout.record_outputs(conv)
    want = generate_text(conv, GENERATE_PROMPTS[0], 16)
    srv = Served(conv, "--no-prepack")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model="m", prompt=GENERATE_PROMPTS[0], max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert tokenizer.decode(r.choices[0].model_extra["token_ids"]) == want
    finally:
        rc, out, err = srv.stop()
    assert rc == 0 and "Traceback" not in err, err
    (conv / layout.CONVERT_JSON).write_text('{"altered": true}\n')  # a conversion is verified before serving
    one_line_error(kvexport("serve", str(conv), "--port", "0"), 4, "convert.json was altered")


BODY = {"model": "m", "prompt": "def parse(", "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def tokens_of(events: list[dict]) -> int:
    return sum(len(c.get("token_ids", [])) for ev in events for c in ev.get("choices", []))


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(export_dir):
    srv = Served(export_dir)
    t, got, first = stream_in_thread(srv.url, {**BODY, "max_tokens": 200})
    assert first.wait(60) and got["events"]
    rc, out, err = srv.stop()
    t.join(60)
    assert rc == 0, err
    assert got["done"] and tokens_of(got["events"]) == 200  # the stream ran to its end after the signal
    assert got["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert "SIGTERM: draining 1 active" in err and "Traceback" not in err and "error" not in err.lower(), err


def test_drain_is_bounded(export_dir):
    # a drain of 0 s cancels at the signal: a fast machine decodes the student's 480 tokens in well under a second,
    # so any positive deadline could let the stream finish and the cut would not be seen
    srv = Served(export_dir, "--drain-timeout", "0")
    t, got, first = stream_in_thread(srv.url, {**BODY, "max_tokens": 480})
    assert first.wait(60)
    rc, out, err = srv.stop()
    t.join(60)
    assert rc == 0 and "Traceback" not in err, err
    assert tokens_of(got["events"]) < 480 and got["done"]  # cut short: an error event, then [DONE]
    assert got["events"][-1]["error"]["message"] == "the server stopped before the completion finished"


def test_readme_curl_example(export_dir):
    """The README's curl lines, pointed at a server of the test export, answer an OpenAI body."""
    import shutil

    from kvexport.serve import ServerThread, open_model

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Serving"):]
    section = section[:section.index("\n## ", 3)]
    curls = [c for c in re.findall(r"^curl .*?(?<!\\)$", section, flags=re.M | re.S)]
    assert len(curls) >= 2, section
    with ServerThread(open_model(export_dir, name="kvx-student")) as srv:
        for cmd in curls:
            cmd = cmd.replace("\\\n", " ").replace("http://127.0.0.1:8000", srv.url)
            r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, (cmd, r.stderr)
            body = r.stdout.strip()
            if body.startswith("data: "):  # a streamed answer
                assert body.endswith("data: [DONE]") and '"choices"' in body, body
            else:
                doc = json.loads(body)
                assert "choices" in doc or "data" in doc, doc
