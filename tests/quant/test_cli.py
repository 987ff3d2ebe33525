# SPDX-License-Identifier: Apache-2.0
"""``--weights`` as a user meets it: ``kvexport export --weights int4`` of the bundled student validated by
``kvexport validate`` (parity against the PyTorch library path holding the same int4 weights, fidelity against the
fp32 original), bad values refused in one line with nothing written, and ``kvexport convert --weights int4`` on a
tiny model end to end."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from kvexport.cli import main
from kvexport.convert.config import ConvertConfig
from kvexport.export.parity import TOLERANCES
from kvexport.export.reference import load_reference_model
from kvexport.manifest import verify_manifest
from kvexport.paths import DEFAULT_MODEL

ARGS = ["--press", "snapkv", "--budget", "96", "--window", "16", "--chunk", "32"]


@pytest.fixture(scope="module")
def int4_student(tmp_path_factory):
    out = tmp_path_factory.mktemp("weights-cli") / "int4"
    assert main(["export", "--out", str(out), *ARGS, "--weights", "int4"]) == 0
    return out


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_export_int4_validates_against_pytorch_with_the_same_weights(int4_student, capsys):
    s = verify_manifest(int4_student)["settings"]
    assert s["weights"]["format"] == "int4" and s["weights"]["accuracy_level"] == 0  # float32 activations
    assert "MatMulNBits" in _ops(int4_student / "decode.onnx")
    assert main(["validate", str(int4_student), "--steps", "16"]) == 0
    rep = json.loads((int4_student / "parity.json").read_text())
    pair = rep["pairs"]["pytorch~onnxruntime"]
    assert pair["passed"] and pair["token_agreement"] == pair["index_agreement"] == 1.0
    assert pair["max_abs_logit_error"] <= TOLERANCES["fp32"][0]  # the fp32 gates: same weights, same arithmetic
    assert rep["settings"]["weights"] == "int4" and rep["weights"]["quantized"] == 4 * 7 + 2
    assert rep["tolerances"]["rule"] == "fp32 (the reference holds the export's int4 weights, float32 arithmetic)"
    assert (rep["tolerances"]["atol"], rep["tolerances"]["rtol"]) == TOLERANCES["fp32"][:2]
    fid = rep["fidelity"]  # against the fp32 original, as for any compression
    assert fid["original"] == str(DEFAULT_MODEL.resolve()) and 0 < fid["next_token_agreement"] < 1


def test_a_reference_without_the_int4_weights_fails(int4_student, monkeypatch):
    """Prompts past the budget (compactions): validate passes against the reference holding the int4 weights and
    fails when that reference is the fp32 model (validate's parity would not notice a reference that ignored the
    export's weights otherwise)."""
    from kvexport.export import validation

    prompts = [np.random.default_rng(seed).integers(3, 4096, size=n).tolist() for n, seed in ((150, 1), (300, 2))]
    rep = validation.validate(int4_student, prompts=prompts, steps=8, fidelity=False, write=False)
    assert rep["pairs"]["pytorch~onnxruntime"]["passed"]
    monkeypatch.setattr(validation, "load_reference_model",
                        lambda man, model, root: load_reference_model(man, model, root=root, weights=False))
    pair = validation.validate(int4_student, prompts=prompts, steps=8, fidelity=False, write=False)["pairs"][
        "pytorch~onnxruntime"]
    assert not pair["passed"] and pair["max_abs_logit_error"] > 1.0, pair


def _err(args, capsys) -> tuple[int, list[str]]:
    rc = main(args)
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("args,says", [
    (["export", "--weights", "int3"], "--weights 'int3' unknown; accepted: fp32, fp16, int4, int4-a8, int4-qdq"),
    (["export", "--weights", "int4", "--dtype", "fp16"], "rewrites an fp32 export's weights"),
    (["convert", "--weights", "q4_1"], "--weights 'q4_1' unknown; accepted: fp32, fp16, int4, int4-a8, int4-qdq"),
    (["convert", "--weights", "int4", "--fp16"], "rewrites an fp32 export's weights"),
    (["convert", "--weights", "int4", "--target", "tensorrt"], "use --weights int4-qdq"),
])
def test_bad_weights_refused_in_one_line(args, says, tmp_path, capsys):
    out = tmp_path / "out"
    rc, err = _err([*args, "--out", str(out)], capsys)
    assert rc == 2 and len(err) == 1 and says in err[0], err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_convert_int4_end_to_end(tmp_path, capsys):
    from tests.convert.helpers import make_tiny_hf_dir

    tiny_hf_dir = make_tiny_hf_dir(tmp_path / "tiny-llama")
    out = tmp_path / "tiny-int4"
    rc = main(["convert", str(tiny_hf_dir), "--out", str(out), "--press", "knorm", "--budget", "16", "--window", "4",
               "--chunk", "8", "--weights", "int4", "--no-profile", "--no-baseline", "--validate-steps", "4"])
    assert rc == 0, capsys.readouterr().err
    assert ConvertConfig.from_file(out / "convert.json").weights == "int4"  # --config reproduces it
    e = verify_manifest(out / "onnx")["settings"]["weights"]
    assert e["format"] == "int4" and len(e["tensors"]) == 2 * 7 + 1  # 7 per layer and the LM head
    assert "MatMulNBits" in _ops(out / "onnx" / "decode.onnx")
    rep = json.loads((out / "parity.json").read_text())
    assert rep["pairs"]["pytorch~onnxruntime"]["passed"] and rep["settings"]["weights"] == "int4"
    assert "int4" in rep["tolerances"]["rule"] and "fidelity" in rep
    assert not (out / "baseline").exists()
    stages = {s["name"]: s for s in json.loads((out / "convert.json").read_text())["stages"]}
    assert "int4 weights" in stages["export"]["note"]
