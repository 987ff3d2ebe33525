# SPDX-License-Identifier: Apache-2.0
"""The bad-input battery: for every subcommand, inputs that must be refused with the right exit code, a
one-line message naming the problem, no traceback and no partial output.

Each case builds its input under ``tmp_path`` from the session fixtures (a tiny model directory, an MLA
rewrite, two tiny exports) and runs ``kvexport.cli.main`` in-process. Afterwards nothing new may exist
under ``tmp_path`` except what the case made itself, and the shared fixtures must still verify.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from kvexport.manifest import verify_manifest
from tests.hardening.conftest import make_model_dir, run_cli


@dataclass
class Ctx:
    model: Path
    export: Path
    full: Path
    mla: Path
    tmp: Path

    def model_copy(self, mutate: Callable[[Path], None] | None = None) -> Path:
        d = self.tmp / "model"
        shutil.copytree(self.model, d)
        if mutate is not None:
            mutate(d)
        return d

    def export_copy(self, mutate: Callable[[Path], None] | None = None) -> Path:
        d = self.tmp / "export"
        shutil.copytree(self.export, d)
        if mutate is not None:
            mutate(d)
        return d

    def file(self, name: str, data: bytes = b"x") -> Path:
        p = self.tmp / name
        p.write_bytes(data)
        return p


P = ["-p", "hello world"]


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _corrupt(d: Path) -> None:
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header
    f.write_bytes(bytes(data))


def _config(**changes):
    def mutate(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return mutate


def _flip_byte(name: str):
    def mutate(d: Path) -> None:
        with open(d / name, "r+b") as f:
            f.seek(1000)
            b = f.read(1)
            f.seek(1000)
            f.write(bytes([b[0] ^ 1]))
    return mutate


def _rm(*names):
    def mutate(d: Path) -> None:
        for n in names:
            for f in d.glob(n):
                f.unlink()
    return mutate


def _write(name: str, data: str):
    def mutate(d: Path) -> None:
        (d / name).write_text(data)
    return mutate


def _version(d: Path) -> None:
    doc = json.loads((d / "manifest.json").read_text())
    doc["kvexport_version"] = "0.0.0-other"
    (d / "manifest.json").write_text(json.dumps(doc))


def _teacher_other_vocab(c: Ctx) -> Path:
    return make_model_dir(c.tmp / "teacher", vocab=400)


def _data(c: Ctx) -> Path:
    return c.file("data.txt", ("hello world " * 200).encode())


def _distill(c: Ctx, teacher: Path, data: Path, *extra) -> list:
    return ["distill", c.mla, "--teacher", teacher, "--data", data, "--tokens", "64", "--seq-len", "16",
            "--batch-size", "2", "--out", c.tmp / "dist", "--no-progress", *extra]


# (id, args builder, exit code, words the message must contain)
CASES: list[tuple[str, Callable[[Ctx], list], int, tuple[str, ...]]] = [
    # ---- model directories (generate loads them) ------------------------------------------------------------
    ("truncated-safetensors", lambda c: ["generate", c.model_copy(_truncate), *P], 3, ("model.safetensors", "damaged")),
    ("corrupt-safetensors", lambda c: ["generate", c.model_copy(_corrupt), *P], 3, ("model.safetensors", "damaged")),
    ("unknown-architecture", lambda c: ["generate", c.model_copy(_config(model_type="gpt2")), *P], 3,
     ("unsupported model family", "gpt2")),
    ("config-missing-layers", lambda c: ["generate", c.model_copy(_config(num_hidden_layers=None)), *P], 3,
     ("num_hidden_layers",)),
    ("config-missing-hidden", lambda c: ["generate", c.model_copy(_config(hidden_size=None)), *P], 3,
     ("hidden_size",)),
    ("config-not-json", lambda c: ["generate", c.model_copy(_write("config.json", "{oops")), *P], 3,
     ("config.json", "not valid JSON")),
    ("config-missing", lambda c: ["generate", c.model_copy(_rm("config.json")), *P], 3, ("no config.json",)),
    ("weights-missing", lambda c: ["generate", c.model_copy(_rm("*.safetensors")), *P], 3, ("safetensors",)),
    ("model-dir-missing", lambda c: ["generate", c.tmp / "nope", *P], 3, ("does not exist",)),
    ("tokenizer-missing", lambda c: ["generate", c.model_copy(_rm("tokenizer*")), *P], 2, ("no tokenizer",)),
    # ---- prompts and generation options ---------------------------------------------------------------------
    ("empty-prompt", lambda c: ["generate", c.model, "-p", ""], 2, ("empty",)),
    ("blank-prompt", lambda c: ["generate", c.model, "-p", "  \n "], 2, ("empty",)),
    ("non-utf8-prompt-file", lambda c: ["generate", c.model, "--prompt-file", c.file("p.txt", b"\xff\xfe\xfa ok")],
     2, ("UTF-8",)),
    ("prompt-file-missing", lambda c: ["generate", c.model, "--prompt-file", c.tmp / "none.txt"], 2,
     ("does not exist",)),
    ("window-zero", lambda c: ["generate", c.model, *P, "--window", "0"], 2, ("window", ">= 1")),
    ("unknown-press", lambda c: ["generate", c.model, *P, "--press", "nope", "--budget", "8"], 2,
     ("unknown press", "accepted")),
    ("budget-zero", lambda c: ["generate", c.model, *P, "--budget", "0"], 2, ("budget",)),
    ("budget-negative", lambda c: ["generate", c.model, *P, "--budget", "-3"], 2, ("budget",)),
    ("ratio-out-of-range", lambda c: ["generate", c.model, *P, "--ratio", "1.5"], 2, ("ratio", "[0, 1)")),
    ("dtype-unknown", lambda c: ["generate", c.model, *P, "--dtype", "int8"], 2, ("--dtype", "int8", "fp16")),
    ("max-new-tokens-zero", lambda c: ["generate", c.model, *P, "-n", "0"], 2, ("--max-new-tokens",)),
    ("chunk-zero", lambda c: ["generate", c.model, *P, "--chunk", "0"], 2, ("chunk",)),
    # ---- export ----------------------------------------------------------------------------------------------
    ("export-out-is-file", lambda c: ["export", c.model, "--out", c.file("afile")], 2, ("is a file",)),
    ("export-out-under-file", lambda c: ["export", c.model, "--out", c.file("afile") / "sub"], 2, ("afile",)),
    ("export-out-not-empty", lambda c: ["export", c.model, "--out", c.export_copy()], 2, ("not empty", "--force")),
    ("export-mla-rank-zero", lambda c: ["export", c.model, "--out", c.tmp / "o", "--mla-rank", "0", "--rope-dim",
                                        "8"], 2, ("rank", ">= 1")),
    ("export-mla-rank-too-large", lambda c: ["export", c.model, "--out", c.tmp / "o", "--mla-rank", "100000",
                                             "--rope-dim", "8"], 2, ("rank", "100000", "larger")),
    ("export-rope-without-rank", lambda c: ["export", c.model, "--out", c.tmp / "o", "--rope-dim", "8"], 2,
     ("--rope-dim", "--mla-rank")),
    ("export-unexportable-press", lambda c: ["export", c.model, "--out", c.tmp / "o", "--press", "random",
                                             "--budget", "8"], 2, ("cannot be exported",)),
    ("export-budget-beyond-positions", lambda c: ["export", c.model, "--out", c.tmp / "o", "--press", "knorm",
                                                  "--budget", "40000"], 2, ("position range",)),
    ("export-window-zero", lambda c: ["export", c.model, "--out", c.tmp / "o", "--press", "knorm", "--budget", "8",
                                      "--window", "0"], 2, ("--window",)),
    ("export-ops-unknown", lambda c: ["export", c.model, "--out", c.tmp / "o", "--ops", "weird"], 2,
     ("--ops", "custom, standard")),
    ("export-dtype-bf16", lambda c: ["export", c.model, "--out", c.tmp / "o", "--dtype", "bf16"], 2,
     ("--dtype", "fp32, fp16")),
    ("export-dynamic-with-press", lambda c: ["export", c.model, "--out", c.tmp / "o", "--press", "knorm",
                                             "--budget", "8", "--dynamic-cache"], 2, ("--dynamic-cache",)),
    ("export-budget-without-press", lambda c: ["export", c.model, "--out", c.tmp / "o", "--budget", "8"], 2,
     ("--budget", "press")),
    # ---- export directories (generate / validate / build-engine) ---------------------------------------------
    ("onnx-edited-after-export", lambda c: ["generate", c.export_copy(_flip_byte("decode.onnx")), *P], 4,
     ("decode.onnx", "altered")),
    ("export-foreign-file", lambda c: ["generate", c.export_copy(_write("extra.onnx", "x")), *P], 4,
     ("extra.onnx", "foreign")),
    ("export-file-missing", lambda c: ["validate", c.export_copy(_rm("compact.onnx"))], 4,
     ("missing compact.onnx",)),
    ("manifest-not-json", lambda c: ["generate", c.export_copy(_write("manifest.json", "{nope")), *P], 4,
     ("manifest.json", "not valid JSON")),
    ("manifest-other-version", lambda c: ["generate", c.export_copy(_version), *P], 4, ("0.0.0-other",)),
    ("export-batch-mismatch", lambda c: ["generate", c.export, *P, "-p", "two"], 2, ("--batch 1",)),
    # an export's cache is fixed: a flag that would change it is refused, not ignored
    ("export-press-given", lambda c: ["generate", c.export, *P, "--press", "knorm", "--budget", "4"], 2,
     ("--press, --budget", "is an export", "fixed")),
    ("export-window-given", lambda c: ["generate", c.export, *P, "--window", "8"], 2, ("--window:", "is an export")),
    ("export-kv-dtype-given", lambda c: ["generate", c.export, *P, "--kv-dtype", "int8"], 2, ("--kv-dtype:",)),
    ("prompt-longer-than-export", lambda c: ["generate", c.full, "-p", "hello world " * 10, "-n", "4"], 2,
     ("exceeds the export's maximum 24",)),
    ("validate-steps-zero", lambda c: ["validate", c.export, "--steps", "0"], 2, ("--steps",)),
    ("validate-not-an-export", lambda c: ["validate", c.model], 4, ("manifest.json", "not a kvexport artifact")),
    ("validate-min-agreement-above-1", lambda c: ["validate", c.export, "--min-agreement", "2"], 2,
     ("--min-agreement 2", "[0, 1]")),
    ("validate-ppl-increase-negative", lambda c: ["validate", c.export, "--max-ppl-increase", "-1"], 2,
     ("--max-ppl-increase", ">= 0")),
    ("validate-eval-data-missing", lambda c: ["validate", c.export, "--eval-data", c.tmp / "none.txt"], 2,
     ("--eval-data", "does not exist", "bundled:NAME")),
    ("validate-gate-without-fidelity", lambda c: ["validate", c.export, "--no-fidelity", "--min-agreement", "0.5"],
     2, ("--no-fidelity",)),
    ("generate-engine-folder", lambda c: ["generate", _engine_dir(c), *P], 2,
     ("TensorRT engines", "--backend tensorrt --engines")),
    ("press-none-with-budget", lambda c: ["generate", c.model, *P, "--press", "none", "--budget", "8"], 2,
     ("--budget/--ratio/--neighbors need a --press",)),
    ("plugin-not-a-library", lambda c: ["build-engine", c.export, "--plugins", c.file("libfake.so", b"not elf")],
     4, ("not a shared library",)),
    ("build-engine-edited-export", lambda c: ["build-engine", c.export_copy(_flip_byte("prefill.onnx"))], 4,
     ("prefill.onnx", "altered")),
    ("build-engine-out-inside-export", lambda c: ["build-engine", c.export, "--out", c.export / "engines"], 2,
     ("inside",)),
    # ---- MLA rewrite / inspect / distill ----------------------------------------------------------------------
    ("mla-energy-with-rank", lambda c: ["rewrite", c.model, "--out", c.tmp / "o", "--mla-rank", "16",
                                        "--mla-energy", "0.9"], 2, ("exactly one",)),
    ("mla-energy-out-of-range", lambda c: ["rewrite", c.model, "--out", c.tmp / "o", "--mla-energy", "1.5"], 2,
     ("1.5", "(0, 1]")),
    ("mla-rope-dim-odd", lambda c: ["rewrite", c.model, "--out", c.tmp / "o", "--mla-rank", "16", "--rope-dim",
                                    "7"], 2, ("even",)),
    ("mla-rank-too-large", lambda c: ["rewrite", c.model, "--out", c.tmp / "o", "--mla-rank", "4096",
                                      "--rope-dim", "8"], 2, ("4096", "larger")),
    ("rewrite-already-mla", lambda c: ["rewrite", c.mla, "--out", c.tmp / "o", "--mla-rank", "16", "--rope-dim",
                                       "8"], 2, ("already an MLA",)),
    ("rewrite-out-is-file", lambda c: ["rewrite", c.model, "--out", c.file("afile"), "--mla-rank", "16",
                                       "--rope-dim", "8"], 2, ("is a file",)),
    ("inspect-rope-without-rank", lambda c: ["inspect", c.model, "--rope-dim", "8"], 2, ("--rope-dim",)),
    ("mla-weights-truncated", lambda c: ["generate", _mla_truncated(c), *P], 4, ("model.safetensors",)),
    ("distill-vocab-mismatch", lambda c: _distill(c, _teacher_other_vocab(c), _data(c)), 3,
     ("vocabulary", "400", "320")),
    ("distill-data-missing", lambda c: _distill(c, c.model, c.tmp / "none.txt"), 2, ("does not exist",)),
    ("distill-data-empty", lambda c: _distill(c, c.model, c.file("empty.txt", b"")), 2, ("empty",)),
    ("distill-tokens-zero", lambda c: _distill(c, c.model, _data(c))[:7] + ["0", "--out", c.tmp / "dist"], 2,
     ("--tokens",)),
    ("distill-out-is-file", lambda c: _distill(c, c.model, _data(c))[:-3] + ["--out", c.file("afile")], 2,
     ("is a file",)),
    # ---- the command line itself (parsed by typer/click) -------------------------------------------------------
    ("unknown-option", lambda c: ["generate", c.model, "--nope"], 2, ("No such option", "--nope", "--help")),
    ("option-not-a-number", lambda c: ["generate", c.model, "--budget", "abc"], 2, ("--budget", "integer")),
    ("required-option-missing", lambda c: ["export", c.model], 2, ("--out",)),
    ("unknown-command", lambda c: ["exprot", c.model], 2, ("No such command", "exprot")),
    # ---- convert / profile / report / eval -------------------------------------------------------------------
    ("convert-without-out", lambda c: ["convert", c.model], 2, ("--out",)),
    ("convert-energy-with-rank", lambda c: ["convert", c.model, "--out", c.tmp / "o", "--mla-rank", "16",
                                            "--mla-energy", "0.9"], 2, ("--mla-rank", "--mla-energy")),
    ("convert-unknown-press", lambda c: ["convert", c.model, "--out", c.tmp / "o", "--press", "nope", "--budget",
                                         "8"], 2, ("unknown press",)),
    ("profile-unknown-backend", lambda c: ["profile", c.export, "--backend", "bogus", "--out", c.tmp / "p.json"], 2,
     ("--backend", "bogus")),
    ("profile-repeats-zero", lambda c: ["profile", c.export, "--repeats", "0", "--out", c.tmp / "p.json"], 2,
     ("--repeats 0", ">= 1")),
    ("report-not-a-conversion", lambda c: ["report", c.model], 4, ("convert.json",)),
    ("eval-ratios-not-numbers", lambda c: ["eval", "presses", c.model, "--ratios", "abc"], 2, ("--ratios",)),
    ("eval-windows-zero", lambda c: ["eval", "presses", c.model, "--windows", "0"], 2, ("--windows",)),
    ("eval-press-kwargs-not-json", lambda c: ["eval", "presses", c.model, "--press-kwargs", "{n_future: 3"], 2,
     ("--press-kwargs", "JSON")),
    ("eval-press-kwargs-not-nested", lambda c: ["eval", "presses", c.model, "--press-kwargs", '{"knorm": 3}'], 2,
     ("--press-kwargs", "objects")),
    ("eval-press-kwargs-unknown-press", lambda c: ["eval", "presses", c.model, "--press-kwargs", '{"nope": {}}'], 2,
     ("nope", "expected_attention")),
    ("eval-press-kwargs-unknown-setting", lambda c: ["eval", "presses", c.model, "--press-kwargs",
                                                     '{"expected_attention": {"n_futur": 32}}'], 2,
     ("n_futur", "n_future_positions")),
    ("eval-press-kwargs-not-in-presses", lambda c: ["eval", "presses", c.model, "--presses", "knorm", "--press-kwargs",
                                                    '{"expected_attention": {"n_future_positions": 32}}'], 2,
     ("expected_attention", "--presses", "knorm")),
    ("eval-press-kwargs-bad-value", lambda c: ["eval", "presses", c.model, "--press-kwargs",
                                               '{"expected_attention": {"n_future_positions": "x"}}'], 2,
     ("expected_attention",)),
]


def _engine_dir(c: Ctx) -> Path:
    """A folder that says it holds TensorRT engines (what `kvexport build-engine` writes)."""
    d = c.tmp / "engines"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": 1, "kind": "tensorrt-engines", "files": {},
                                                 "kvexport_version": "0"}))
    return d


def _mla_truncated(c: Ctx) -> Path:
    d = c.tmp / "mla"
    shutil.copytree(c.mla, d)
    _truncate(d)
    return d


def test_battery_is_large_and_distinct():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30
    assert {a for c in CASES for a in ("generate", "export", "validate", "build-engine", "rewrite", "inspect",
                                        "distill", "convert", "profile", "report", "eval")} >= {
        "generate", "export", "validate", "build-engine", "rewrite", "inspect", "distill", "convert", "profile",
        "report", "eval"}


def _tree(d: Path) -> dict[str, int]:
    return {p.relative_to(d).as_posix(): p.stat().st_size for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize(("name", "build", "code", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, build, code, words, model_dir, export_dir, full_export_dir, mla_dir, tmp_path, capsys):
    ctx = Ctx(model_dir, export_dir, full_export_dir, mla_dir, tmp_path)
    args = build(ctx)
    before = _tree(tmp_path)
    rc, err = run_cli(args, capsys)
    assert rc == code, (rc, err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    for w in words:
        assert w in err[0], (w, err[0])
    # no partial output: nothing appeared under tmp_path (no --out, no temporary sibling), nothing changed
    assert _tree(tmp_path) == before
    # the shared artifacts are untouched
    verify_manifest(export_dir)
    verify_manifest(full_export_dir)
