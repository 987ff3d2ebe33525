# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the MLA tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def distill_setup(tmp_path_factory):
    """(dir, teacher dir with a tiny BPE tokenizer, train ids, held-out ids), all made offline."""
    from kvexport.mla.distill import read_tokens
    from kvexport.models.loading import load_tokenizer
    from tests.mla.distill_fixtures import make_text, model_dir

    d = tmp_path_factory.mktemp("distill")
    teacher_dir = model_dir(d / "teacher")
    (d / "train.txt").write_text(make_text(3000, 1))
    (d / "held.txt").write_text(make_text(1500, 2))
    tok = load_tokenizer(teacher_dir)
    return d, teacher_dir, read_tokens(d / "train.txt", tok, 128), read_tokens(d / "held.txt", tok, 128)
