# SPDX-License-Identifier: Apache-2.0
"""Atomic outputs under interruption: SIGINT / SIGTERM in the middle of a stage leaves the previous DIR as it
was and no temporary leftovers, and the CLI exits with 128 + the signal number.

``kvexport export`` is signalled from outside (a real subprocess, once its temporary directory exists); the
other stages are interrupted from inside, at a known point, by a patched writer that sends the signal to its
own process (the same handler runs: ``kvexport.atomic.interrupts_raise`` inside ``kvexport.cli.main``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvexport.cli import main
from kvexport.manifest import verify_manifest
from tests.hardening.conftest import EXPORT_ARGS, copy_of, leftovers, messages


def _digest(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_export_signalled_mid_run_keeps_previous_dir(sig, model_dir, export_dir, tmp_path):
    out = copy_of(export_dir, tmp_path / "x")  # the previous result, to be replaced with --force
    before = _digest(out)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.Popen([sys.executable, "-m", "kvexport", "export", str(model_dir), "--out", str(out), "--force",
                          "--press", "knorm", *EXPORT_ARGS[2:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while not leftovers(tmp_path, "x") and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leftovers(tmp_path, "x"), "the export never created its temporary directory"
        time.sleep(1.0)  # well inside the graph export
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, err[-2000:]
    assert messages(err)[-1] == f"error: interrupted (received {signal.Signals(sig).name})"
    assert "Traceback" not in err
    assert _digest(out) == before and leftovers(tmp_path, "x") == []
    verify_manifest(out)


def _kill_self(*_a, **_k):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises here
    raise AssertionError("SIGTERM did not interrupt")


def test_rewrite_interrupted_while_saving(model_dir, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    def partial_then_kill(model, filename, *a, **k):
        Path(filename).write_bytes(b"half a file")
        _kill_self()

    monkeypatch.setattr(safetensors.torch, "save_model", partial_then_kill)
    out = tmp_path / "mla"
    rc = main(["rewrite", str(model_dir), "--out", str(out), "--mla-rank", "16", "--rope-dim", "8"])
    assert rc == 128 + signal.SIGTERM
    assert messages(capsys.readouterr().err) == ["error: interrupted (received SIGTERM)"]
    assert not out.exists() and leftovers(tmp_path, "mla") == []


def test_distill_checkpoint_interrupted(mla_dir, model_dir, tmp_path, monkeypatch, capsys):
    import accelerate

    def partial_then_kill(self, output_dir=None, **k):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "model.safetensors").write_bytes(b"half")
        _kill_self()

    monkeypatch.setattr(accelerate.Accelerator, "save_state", partial_then_kill)
    data = tmp_path / "data.txt"
    data.write_text("hello world " * 200)
    out = tmp_path / "dist"
    rc = main(["distill", str(mla_dir), "--teacher", str(model_dir), "--data", str(data), "--tokens", "64",
               "--seq-len", "16", "--batch-size", "2", "--save-every", "1", "--out", str(out), "--no-progress"])
    assert rc == 128 + signal.SIGTERM
    assert messages(capsys.readouterr().err)[-1] == "error: interrupted (received SIGTERM)"
    ck = out / "checkpoints"
    # no checkpoint directory at all: neither a half-written step-* (which --resume would pick) nor its temp
    assert not ck.exists() or sorted(p.name for p in ck.iterdir()) == []
    from kvexport.mla.distill import latest_checkpoint

    assert latest_checkpoint(out) is None


def test_convert_interrupted_in_a_stage(model_dir, export_dir, tmp_path, monkeypatch, capsys):
    import kvexport.convert.stages as stages

    monkeypatch.setattr(stages, "stage_export", _kill_self)
    out = copy_of(export_dir, tmp_path / "conv")  # some previous content of DIR
    before = _digest(out)
    rc = main(["convert", str(model_dir), "--out", str(out), "--force", "--press", "streaming_llm", "--budget", "16",
               "--window", "8", "--chunk", "8", "--no-validate", "--no-profile", "--no-baseline"])
    assert rc == 128 + signal.SIGTERM, capsys.readouterr().err
    assert messages(capsys.readouterr().err)[-1] == "error: interrupted (received SIGTERM)"
    assert _digest(out) == before and leftovers(tmp_path, "conv") == []


def test_signal_handlers_are_restored():
    from kvexport.atomic import interrupts_raise

    old = signal.getsignal(signal.SIGTERM)
    with interrupts_raise() as st:
        assert signal.getsignal(signal.SIGTERM) is not old
    assert signal.getsignal(signal.SIGTERM) is old and st.signum is None


def test_atomic_write_bytes_leaves_old_file_on_failure(tmp_path, monkeypatch):
    from kvexport.atomic import atomic_write_bytes

    f = tmp_path / "report.html"
    atomic_write_bytes(f, b"old")
    real = os.replace

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(f, b"new")
    monkeypatch.setattr(os, "replace", real)
    assert f.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_build_engine_interrupted_keeps_previous_engines(tmp_path, monkeypatch, capsys):
    """With a stand-in TensorRT: SIGTERM while the second engine is written; the previous engine folder stays."""
    import onnx

    import kvexport.tensorrt as trt_pkg
    from kvexport.manifest import write_manifest
    from tests.tensorrt.onnx_models import topk_gather_model
    from tests.tensorrt.test_engine_build_fake import make_fake_trt

    export = tmp_path / "x"
    export.mkdir()
    for name in ("decode.onnx", "prefill.onnx"):
        onnx.save(topk_gather_model(), str(export / name))
    write_manifest(export, "onnx-export", {})
    previous = tmp_path / "x-tensorrt"
    previous.mkdir()
    (previous / "decode.engine").write_bytes(b"OLD PLAN")
    fake, _ = make_fake_trt("10.3.0")
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    built = []

    def build_then_kill(onnx_path, engine_path, **k):
        Path(engine_path).write_bytes(b"half a plan")
        built.append(engine_path)
        if len(built) == 2:
            _kill_self()
        from kvexport.tensorrt.engine import EngineReport

        return EngineReport(onnx=str(onnx_path), engine=str(engine_path), tensorrt="10.3.0", fp16=False, bytes=11)

    monkeypatch.setattr(trt_pkg, "build_engine", build_then_kill)
    rc = main(["build-engine", str(export)])
    assert rc == 128 + signal.SIGTERM, capsys.readouterr().err
    assert sorted(p.name for p in previous.iterdir()) == ["decode.engine"]
    assert (previous / "decode.engine").read_bytes() == b"OLD PLAN"
    assert leftovers(tmp_path, "x-tensorrt") == [] and sorted(p.name for p in tmp_path.iterdir()) == ["x",
                                                                                                      "x-tensorrt"]
    verify_manifest(export)  # nothing was written into the export
