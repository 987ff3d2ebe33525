# SPDX-License-Identifier: Apache-2.0
"""Held-out text for evaluations: the Python standard library split used to train the reference models.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages``, ``test``,
``tests``, ``idle_test``, ``pydoc_data`` and ``__pycache__``, sorted by relative POSIX path. A file is
held out iff the first byte of ``sha256(relative path)`` is below :data:`HELDOUT_BYTE` (≈5 %).
``scripts/train_reference.py`` trains on the rest, so these files were never seen in training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__"})
HELDOUT_BYTE = 13


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> tuple[list[str], list[str]]:
    """-> (train, held-out): stdlib-relative POSIX paths, sorted."""
    root = stdlib_root()
    rels = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)
    )
    train, held = [], []
    for r in rels:
        (held if hashlib.sha256(r.encode()).digest()[0] < HELDOUT_BYTE else train).append(r)
    return train, held


def read_text(rel: str) -> str | None:
    """A stdlib file's text, or None when it is not UTF-8."""
    try:
        return (stdlib_root() / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def heldout_texts() -> list[str]:
    """The held-out files' texts (the UTF-8 ones), in split order."""
    return [t for t in (read_text(r) for r in corpus_files()[1]) if t is not None]


_STREAMS: dict[int, tuple[object, torch.Tensor]] = {}


def heldout_stream(tokenizer) -> torch.Tensor:
    """(N,) int64: the held-out files tokenized and concatenated, each as ``bos text eos`` when the
    tokenizer has those tokens (the layout ``scripts/train_reference.py`` trains on). Cached per tokenizer."""
    hit = _STREAMS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out: list[int] = []
    for text in heldout_texts():
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        out += ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
    stream = torch.tensor(out, dtype=torch.long)
    _STREAMS[id(tokenizer)] = (tokenizer, stream)
    return stream


def heldout_windows(tokenizer, n: int, length: int, offset: int = 0) -> torch.Tensor:
    """(n', length) int64, n' <= n: non-overlapping windows spread evenly over :func:`heldout_stream`,
    starting ``offset`` tokens in (another offset gives other windows, e.g. for another task)."""
    stream = heldout_stream(tokenizer)[offset:]
    total = stream.numel() // length
    if total == 0 or n < 1:
        return stream.new_zeros(0, length)
    idx = torch.linspace(0, total - 1, min(n, total)).long()
    return torch.stack([stream[i * length : (i + 1) * length] for i in idx.tolist()])


#: English prose for real models: the Python documentation's topic pages (``pydoc_data.topics``, in every CPython);
#: a page is calibration text iff the first byte of ``sha256(name)`` is below :data:`PROSE_CALIB_BYTE` (≈25 %), the
#: rest is held out
PROSE_CALIB_BYTE = 64


def prose_pages(split: str = "heldout") -> list[str]:
    """The Python documentation's topic pages (English prose with some code), ``heldout`` or ``calibration``,
    sorted by page name. Every CPython installation carries them, so they need no download."""
    from pydoc_data.topics import topics

    if split not in ("heldout", "calibration"):
        raise ValueError(f"split {split!r} is not heldout or calibration")
    names = sorted(topics)
    calib = {n for n in names if hashlib.sha256(n.encode()).digest()[0] < PROSE_CALIB_BYTE}
    return [topics[n] for n in names if (n in calib) == (split == "calibration")]


def prose_stream(tokenizer, split: str = "heldout") -> torch.Tensor:
    """(N,) int64: :func:`prose_pages` tokenized and concatenated, pages separated by a blank line."""
    key = (id(tokenizer), split)
    hit = _PROSE.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    ids = tokenizer("\n\n".join(prose_pages(split)), add_special_tokens=False, verbose=False)["input_ids"]
    stream = torch.tensor(ids, dtype=torch.long)
    _PROSE[key] = (tokenizer, stream)
    return stream


_PROSE: dict[tuple[int, str], tuple[object, torch.Tensor]] = {}


def prose_windows(tokenizer, n: int, length: int) -> torch.Tensor:
    """(n', length) int64, n' <= n: non-overlapping windows spread evenly over the held-out prose."""
    stream = prose_stream(tokenizer)
    total = stream.numel() // length
    if total == 0 or n < 1:
        return stream.new_zeros(0, length)
    idx = torch.linspace(0, total - 1, min(n, total)).long()
    return torch.stack([stream[i * length : (i + 1) * length] for i in idx.tolist()])


def train_tokens(tokenizer, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """(>= n_tokens,) int64 from the *train* split (for distillation): train files in a seeded random order,
    each as ``bos text eos``, concatenated until ``n_tokens`` are reached (or the split runs out)."""
    import random

    files = corpus_files()[0]
    random.Random(seed).shuffle(files)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out: list[int] = []
    for rel in files:
        text = read_text(rel)
        if text is None:
            continue
        out += ([bos] if bos is not None else []) + tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        out += [eos] if eos is not None else []
        if len(out) >= n_tokens:
            break
    return torch.tensor(out, dtype=torch.long)


def calibration_windows(tokenizer, n: int, length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """(n, length) token ids of bundled calibration text, for fitting a model to (the MLA refit): alternately the
    Python documentation's calibration prose pages and the standard library's train split (neither is read by a
    conversion's fidelity measures, which use the held-out splits); seeded random ids when there is no tokenizer."""
    if tokenizer is None:
        return torch.randint(0, vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))
    prose = prose_stream(tokenizer, "calibration")
    code = train_tokens(tokenizer, ((n + 1) // 2) * length, seed=seed)
    rows = []
    for i in range(n):
        src, k = (prose if i % 2 == 0 else code), i // 2
        m = src.numel() // length
        rows.append(src[(k % m) * length : (k % m + 1) * length] if m else src.new_zeros(length))
    return torch.stack(rows).clamp_(max=vocab_size - 1)
