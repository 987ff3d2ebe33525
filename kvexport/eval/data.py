# SPDX-License-Identifier: Apache-2.0
"""Held-out text for evaluations: the Python-stdlib split the reference models were trained without.

The split is defined once, in ``scripts/train_reference.py`` (``corpus_files``: every stdlib ``*.py``
outside ``site-packages``/test folders/``pydoc_data``; a file is held out iff
``sha256(relative path)[0] < 13``, ≈5 %). This module imports that script by path and reuses its
functions (``corpus_files``, ``read_text``, ``encode_split``), so evaluation and training cannot drift apart.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import torch

from kvexport.errors import MissingBackend
from kvexport.paths import REPO_ROOT

TRAIN_SCRIPT = REPO_ROOT / "scripts" / "train_reference.py"


@functools.cache
def train_reference():
    """The ``scripts/train_reference.py`` module (imported by path; the split lives there)."""
    if not TRAIN_SCRIPT.is_file():
        raise MissingBackend(f"{TRAIN_SCRIPT} is missing; the held-out split is defined there (run from a source "
                             "checkout of kvexport)")
    name = "kvexport_train_reference"
    spec = importlib.util.spec_from_file_location(name, TRAIN_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def corpus_files() -> tuple[list[str], list[str]]:
    """-> (train, held-out): stdlib-relative POSIX paths, sorted (``train_reference.corpus_files``)."""
    return train_reference().corpus_files()


def read_text(rel: str) -> str | None:
    """A stdlib file's text, or None when it is not UTF-8."""
    return train_reference().read_text(rel)


def heldout_texts() -> list[str]:
    """The held-out files' texts (UTF-8 ones), in split order."""
    return [t for t in (read_text(r) for r in corpus_files()[1]) if t is not None]


@functools.lru_cache(maxsize=4)
def _stream(tokenizer) -> torch.Tensor:
    tr = train_reference()
    held = corpus_files()[1]
    if tokenizer.bos_token_id is not None and tokenizer.eos_token_id is not None:
        return torch.from_numpy(tr.encode_split(held, tokenizer).astype("int64"))
    out: list[int] = []  # a tokenizer without bos/eos (a user's model): files simply concatenated
    for t in heldout_texts():
        out += tokenizer(t, add_special_tokens=False)["input_ids"]
    return torch.tensor(out, dtype=torch.long)


def heldout_stream(tokenizer) -> torch.Tensor:
    """(N,) int64: the held-out files tokenized and concatenated as ``bos text eos`` (training's layout)."""
    return _stream(tokenizer)


def heldout_windows(tokenizer, n: int, length: int, offset: int = 0) -> torch.Tensor:
    """(n', length) int64, n' <= n: non-overlapping windows spread evenly over :func:`heldout_stream`,
    starting ``offset`` tokens into it (different offsets give different windows for different tasks)."""
    stream = heldout_stream(tokenizer)[offset:]
    total = stream.numel() // length
    if total == 0 or n < 1:
        return stream.new_zeros(0, length)
    idx = torch.linspace(0, total - 1, min(n, total)).long()
    return torch.stack([stream[i * length : (i + 1) * length] for i in idx.tolist()])
