# SPDX-License-Identifier: Apache-2.0
"""The export stage in a child process (issue 20, kvexport.convert.isolate): a large checkpoint's exports run in a
fresh process, so that what the exporter leaves behind is not in validate's peak. The child's export must be the
in-process one, byte for byte; its progress lines, its errors and its death must reach the parent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import pytest

from kvexport.cli import main
from kvexport.convert import exporting
from kvexport.convert.isolate import ChildFailed, call_in_child
from kvexport.errors import BadUsage

ARGS = ["--press", "knorm", "--budget", "16", "--window", "4", "--chunk", "8", "--mla-rank", "16", "--rope-dim", "8",
        "--contexts", "32", "--decode-steps", "4", "--validate-steps", "8", "--repeats", "1", "--no-profile"]


def _graphs(d: Path) -> dict[str, bytes]:
    """Every graph of an export (protos without their external weights) and every other file but the manifest and
    parity.json, which record paths and times."""
    out = {}
    for f in sorted(d.rglob("*")):
        if not f.is_file() or f.name in ("manifest.json", "parity.json"):
            continue
        rel = f.relative_to(d).as_posix()
        if f.suffix == ".onnx":
            out[rel] = onnx.load(str(f), load_external_data=False).SerializeToString(deterministic=True)
        else:
            out[rel] = f.read_bytes()
    return out


def test_child_export_equals_the_in_process_one(tiny_hf_dir, tmp_path, monkeypatch):
    inline, child = tmp_path / "inline", tmp_path / "child"
    assert main(["convert", str(tiny_hf_dir), "--out", str(inline), "--no-validate", *ARGS]) == 0
    monkeypatch.setattr(exporting, "CHILD_EXPORT_BYTES", 0)  # every checkpoint counts as large
    seen = []
    real = call_in_child

    def watched(fn, *args, **kw):
        seen.append(fn.__name__)
        return real(fn, *args, **kw)

    import kvexport.convert.isolate as isolate

    monkeypatch.setattr(isolate, "call_in_child", watched)
    assert main(["convert", str(tiny_hf_dir), "--out", str(child), *ARGS]) == 0  # validated, against the original
    assert seen == ["run_jobs"]
    stages = {s["name"]: s for s in json.loads((child / "convert.json").read_text())["stages"]}
    assert stages["export"]["note"].endswith("in a child process")
    assert stages["validate"]["status"] == "done" and stages["validate"]["note"].startswith("PASSED")
    inline_stages = {s["name"]: s for s in json.loads((inline / "convert.json").read_text())["stages"]}
    assert "in a child process" not in inline_stages["export"]["note"]
    for kind in ("onnx", "baseline"):
        a, b = _graphs(inline / kind), _graphs(child / kind)
        assert a.keys() == b.keys() and len(a) >= 3
        for name in a:
            assert a[name] == b[name], f"{kind}/{name} differs between the child's export and the in-process one"


# ----------------------------------------------------------------------------- the helper itself
def _say_and_return(n: int, progress=None) -> int:
    for i in range(n):
        progress(f"step {i + 1}/{n} in {os.getpid()}")
    return os.getpid()


def _refuse(progress=None) -> None:
    raise BadUsage("--budget 3 must exceed the 64 tokens snapkv always keeps")


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no")


def _raise_unpicklable() -> None:
    raise _Unpicklable("a lock inside")


def _die() -> None:
    os._exit(9)


def test_progress_result_and_errors_come_back():
    lines = []
    pid = call_in_child(_say_and_return, 3, progress=lines.append, what="test")
    assert pid != os.getpid()
    assert lines == [f"step {i}/3 in {pid}" for i in (1, 2, 3)]
    with pytest.raises(BadUsage, match="must exceed the 64 tokens") as e:
        call_in_child(_refuse, progress=lines.append, what="test")
    assert any("raised in the test process" in n and "_refuse" in n for n in e.value.__notes__)
    with pytest.raises(ChildFailed, match="_Unpicklable: a lock inside"):
        call_in_child(_raise_unpicklable, what="test")
    with pytest.raises(ChildFailed, match="exit status 9 "):
        call_in_child(_die, what="test")


_DRIVER = """
import sys
from kvexport.convert import exporting
from kvexport.cli import main
exporting.CHILD_EXPORT_BYTES = 0
sys.exit(main(sys.argv[1:]))
"""


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(k) for k in task.read_text().split()]
        except OSError:
            pass
    return kids


def test_sigterm_during_the_child_export_stops_the_child(tiny_hf_dir, tmp_path):
    """The parent, signalled while the child exports, stops the child and cleans up: no process and no temporary
    directory outlive it (the driver is an unguarded script: the child must not run it again)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "c"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.Popen([sys.executable, "-c", _DRIVER, "convert", str(tiny_hf_dir), "--out", str(out), *ARGS],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not kids and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            kids = _children(p.pid)
        assert kids, "the export never started its child process"
        time.sleep(2.0)  # the child is importing or exporting
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "error: interrupted (received SIGTERM)" in err and "Traceback" not in err
    assert not [k for k in kids if Path(f"/proc/{k}").exists() and "zombie" not in
                Path(f"/proc/{k}/status").read_text().lower()]
    assert not out.exists() and sorted(p.name for p in tmp_path.glob(".c.*")) == []
