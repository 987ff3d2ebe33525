# SPDX-License-Identifier: Apache-2.0
"""The TensorRT step driver (TrtGenerator: the one host over TensorRT engines) against the PyTorch library path,
with a stand-in engine runner.

Each ``<graph>.engine`` of a stand-in engine folder is run by onnxruntime on the export's ``<graph>.onnx`` through
Polygraphy's runner interface, so everything the TensorRT path does on the host (engine folder checks, cache
hand-over between calls, chunked prefill, compaction, validate's TensorRT pairs, profile's TensorRT runner) is
compared with an independent reference: :func:`kvexport.generation.generate` with the export's model and settings
(not OrtGenerator, which shares the host). Real engines run only where TensorRT and a GPU exist
(tests/tensorrt/test_build_engine_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort  # noqa: E402
import pytest

from kvexport.cli import main
from kvexport.errors import BadArtifact
from kvexport.manifest import MANIFEST, sha256_file, write_manifest
from kvexport.tensorrt.generator import ENGINE_KIND, TrtGenerator


class OnnxAsEngine:
    """Polygraphy-style runner: ``infer(feed_dict)`` runs the ONNX graph the stand-in engine names."""

    def __init__(self, engine: Path, plugins=None):
        self.onnx = Path(json.loads(engine.read_text())["onnx"])
        self.calls = 0

    def activate(self):
        self.sess = ort.InferenceSession(str(self.onnx), providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.sess.get_outputs()]

    def deactivate(self):
        self.sess = None

    def infer(self, feed_dict, check_inputs=True, copy_outputs_to_host=True):
        self.calls += 1
        wanted = {i.name for i in self.sess.get_inputs()}
        feeds = {k: np.ascontiguousarray(v) for k, v in feed_dict.items() if k in wanted}
        return dict(zip(self.names, self.sess.run(self.names, feeds), strict=True))


def fake_engines(export_dir: Path, out: Path) -> Path:
    """An engine folder like `kvexport build-engine` writes, each engine naming the graph it stands for."""
    out.mkdir()
    for g in sorted(export_dir.glob("*.onnx")):
        (out / (g.stem + ".engine")).write_text(json.dumps({"onnx": str(g)}))
    (out / "engines.json").write_text("[]\n")
    write_manifest(out, ENGINE_KIND, {"export_manifest_sha256": sha256_file(export_dir / MANIFEST)})
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_models):
    from kvexport.export import export_model

    d = tmp_path_factory.mktemp("trtgen")
    out = export_model(tiny_models("llama"), d / "x", press="streaming_llm", budget=12, window=4, chunk=8)
    fake_engines(out, d / "x-tensorrt")
    return out


def library_run(export_dir: Path, model, ids: np.ndarray, n_new: int):
    """The PyTorch library path with the export's settings on ``model`` (the source of the export)."""
    from kvexport.export.reference import load_reference_model, reference_generate
    from kvexport.export.source import press_from_dict
    from kvexport.manifest import verify_manifest

    manifest = verify_manifest(export_dir)
    s = manifest["settings"]
    return reference_generate(load_reference_model(manifest, model), s, press_from_dict(s["press"]), ids,
                              np.ones_like(ids), n_new)


def test_trt_generator_matches_the_library_path(exported, tiny_models):
    ids = np.random.default_rng(1).integers(3, 128, (1, 19))
    ref = library_run(exported, tiny_models("llama"), ids, 14)
    with TrtGenerator(exported, runner_factory=OnnxAsEngine) as gen:  # default engine folder: x-tensorrt
        res = gen.generate(ids, None, 14, keep_logits=True)
        calls = {n: r.calls for n, r in gen.runners.items()}
    np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
    np.testing.assert_allclose(np.stack(res.step_logits), np.stack([x.numpy() for x in ref.step_logits]), atol=1e-4,
                               rtol=0)  # the parity tests' fp32 tolerance
    assert res.compactions == ref.compactions > 0 and res.compaction_steps == ref.compaction_steps
    for a, b in zip(res.kept_positions, ref.kept_positions, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y.numpy())
    # 19 tokens = 3 chunks of 8, two of them overflowing the budget; the rest of the compactions while decoding
    assert calls == {"prefill": 3, "compact_prefill": 2, "decode": 13, "compact": res.compactions - 2}


def test_engine_folder_checks(exported, tmp_path):
    with pytest.raises(BadArtifact, match="no TensorRT engines at .*build-engine"):
        TrtGenerator(exported, engines=tmp_path / "none", runner_factory=OnnxAsEngine)
    stale = fake_engines(exported, tmp_path / "stale")
    man = json.loads((stale / MANIFEST).read_text())
    man["settings"]["export_manifest_sha256"] = "0" * 64
    (stale / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(BadArtifact, match="built from another version"):
        TrtGenerator(exported, engines=stale, runner_factory=OnnxAsEngine)
    altered = fake_engines(exported, tmp_path / "altered")
    (altered / "decode.engine").write_text("{}")
    with pytest.raises(BadArtifact, match="decode.engine was altered"):
        TrtGenerator(exported, engines=altered, runner_factory=OnnxAsEngine)


def test_validate_adds_tensorrt_pairs(exported, tmp_path, tiny_models):
    import shutil

    from kvexport.export import validate

    d = tmp_path / "x"
    shutil.copytree(exported, d)
    fake_engines(d, tmp_path / "x-tensorrt")
    gen = TrtGenerator(d, runner_factory=OnnxAsEngine)
    from kvexport.export import OrtGenerator

    rep = validate(d, prompts=[5, 20], steps=6, trt_generator=gen, backend="tensorrt", model=tiny_models("llama"),
                   candidate=OrtGenerator(d, share_weights=False))  # plain sessions, as the stand-in engines
    assert set(rep["pairs"]) == {"pytorch~onnxruntime", "onnxruntime~tensorrt", "pytorch~tensorrt"}
    assert rep["pairs"]["onnxruntime~tensorrt"]["max_abs_logit_error"] == 0.0
    for p in rep["pairs"].values():
        assert p["passed"] and p["token_agreement"] == 1.0 and p["index_agreement"] == 1.0
    assert rep["pairs"]["pytorch~tensorrt"]["max_abs_logit_error"] == pytest.approx(
        rep["pairs"]["pytorch~onnxruntime"]["max_abs_logit_error"])
    assert json.loads((d / "parity.json").read_text())["pairs"].keys() == rep["pairs"].keys()


def test_profile_runner_on_tensorrt(exported, tiny_models):
    """The profiler times the TensorRT driver through the one loop: its run is the library path's, and what it
    reports resident is the formula's."""
    from kvexport.cache.memory import CacheShape
    from kvexport.manifest import verify_manifest
    from kvexport.profile.profiler import profile_runner
    from kvexport.profile.runners import ProfiledDriver

    ids = np.random.default_rng(2).integers(3, 128, (1, 17))
    shape = CacheShape.from_export(verify_manifest(exported)["settings"])
    r = ProfiledDriver(TrtGenerator(exported, runner_factory=OnnxAsEngine), "tensorrt", cache_shape=shape)
    assert r.generate(ids, 11).tokens[0].tolist() == library_run(exported, tiny_models("llama"), ids, 11).tokens[0].tolist()
    out = profile_runner(r, [17], decode_steps=10, vocab_size=128, repeats=1)
    row = out["contexts"][0]
    assert out["backend"] == "tensorrt" and row["decode_steps"] == 10
    assert row["resident"] == shape.resident_bytes_at(27)


@pytest.mark.parametrize("argv", [
    ["generate", "{d}", "--backend", "tensorrt", "-p", "hi"],
    ["validate", "{d}", "--backend", "tensorrt", "--steps", "2"],
    ["profile", "{d}", "--backend", "tensorrt", "--no-baseline", "--no-report", "--contexts", "16", "--out",
     "{d}.json"],
])
def test_without_tensorrt_one_line_exit_5(exported, argv, capsys):
    try:
        import tensorrt  # noqa: F401
        import torch

        if torch.cuda.is_available():
            pytest.skip("TensorRT and a GPU are present; the missing-backend path does not apply")
    except ImportError:
        pass
    rc = main([a.replace("{d}", str(exported)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 5, err
    assert len(err) == 1 and err[0].startswith("error: ") and ("TensorRT" in err[0] or "GPU" in err[0]), err


def _no_trt_gpu() -> str | None:
    from tests.tensorrt.test_build_engine_cli import _have_trt_gpu

    return _have_trt_gpu()


@pytest.mark.gpu
@pytest.mark.skipif(_no_trt_gpu() is not None, reason=str(_no_trt_gpu()))
def test_real_engines_generate_like_the_library_path(exported, tmp_path, tiny_models):
    """Real TensorRT engines (build-engine) through TrtGenerator: greedy tokens equal the PyTorch library path's,
    logits within 1e-3, same kept positions after each compaction (fp32 engines)."""
    import shutil

    d = tmp_path / "x"
    shutil.copytree(exported, d)
    assert main(["build-engine", str(d)]) == 0
    ids = np.random.default_rng(3).integers(3, 128, (1, 19))
    ref = library_run(d, tiny_models("llama"), ids, 14)
    with TrtGenerator(d) as gen:
        res = gen.generate(ids, None, 14, keep_logits=True)
    np.testing.assert_array_equal(res.tokens, ref.tokens.numpy())
    np.testing.assert_allclose(np.stack(res.step_logits), np.stack([x.numpy() for x in ref.step_logits]), atol=1e-3)
    for a, b in zip(res.kept_positions, ref.kept_positions, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y.numpy())
