# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A saved tiny Llama (2 layers, 4 heads, 2 KV heads, head 16, vocab 4096) with the bundled tokenizer."""
    from tests.convert.helpers import make_tiny_hf_dir

    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")
