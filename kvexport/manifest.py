# SPDX-License-Identifier: Apache-2.0
"""Artifact directories: a manifest of settings and file hashes, and atomic (all-or-nothing) output.

``DIR/manifest.json`` holds the kvexport version that wrote the directory, what kind of artifact it is,
its settings, the hash of the input model and the sha256 of every other file. :func:`verify_manifest`
refuses (``BadArtifact``, one line) a directory with a missing, altered or foreign file or one written by
another kvexport version. :func:`atomic_output` writes into a temporary sibling and renames it into
place only when everything succeeded, so ``--out`` never holds half an artifact. Both are meant for
every kvexport command that writes a directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from kvexport.errors import BadArtifact, BadUsage

MANIFEST = "manifest.json"
FORMAT = 1
ONNX_EXPORT = "onnx-export"  # kind of the directories `kvexport export` writes
#: an export's graphs for onnxruntime only (onnxruntime contrib ops, e.g. the in-place decode step): TensorRT's
#: engine builder and op checks skip files with this suffix and run the standard graph of the same step
ORT_ONLY_SUFFIX = ".ort.onnx"


def _version() -> str:
    import kvexport

    return kvexport.__version__


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _listing(root: Path) -> list[str]:
    """Relative POSIX paths of every regular file under root except the manifest, sorted."""
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out.append(p.relative_to(root).as_posix())
    return out


def write_manifest(root: str | Path, kind: str, settings: dict[str, Any], model_hash: str | None = None,
                   reports: tuple[str, ...] = ()) -> Path:
    """Hash every file under root and write ``root/manifest.json`` (deterministic: sorted keys, no times).

    ``reports``: names of files that later commands may add at the top level (e.g. ``parity.json``);
    :func:`verify_manifest` does not count them as foreign.
    """
    root = Path(root)
    files = {rel: sha256_file(root / rel) for rel in _listing(root)}
    doc = {"format": FORMAT, "kvexport_version": _version(), "kind": kind, "model_hash": model_hash,
           "settings": settings, "files": files, "reports": sorted(reports)}
    path = root / MANIFEST
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of root (no hash check); BadArtifact when there is none or it is not JSON."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise BadArtifact(f"{root} is not a directory (expected a kvexport artifact with {MANIFEST})")
    if not path.is_file():
        raise BadArtifact(f"{root} has no {MANIFEST}; it is not a kvexport artifact")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadArtifact(f"{path} is not valid JSON") from None
    if not isinstance(doc, dict) or "files" not in doc or "kvexport_version" not in doc:
        raise BadArtifact(f"{path} is not a kvexport manifest")
    return doc


def verify_manifest(root: str | Path, kind: str | None = None, working: tuple[str, ...] = (),
                    check_version: bool = True) -> dict[str, Any]:
    """Check root against its manifest; returns the manifest.

    Raises :class:`BadArtifact` naming the first problem: another kvexport version (unless
    ``check_version`` is off) or artifact kind, a missing file, an altered file (sha256 differs), or a
    foreign file the manifest does not list. Top-level names in ``working`` (files or folders a
    command keeps beside the artifact, e.g. distillation checkpoints) are not foreign.
    """
    root = Path(root)
    doc = read_manifest(root)
    if check_version and doc["kvexport_version"] != _version():
        raise BadArtifact(f"{root} was written by kvexport {doc['kvexport_version']}, this is {_version()}; "
                          f"re-export it with this version")
    if kind is not None and doc.get("kind") != kind:
        raise BadArtifact(f"{root} is a {doc.get('kind')!r} artifact, expected {kind!r}")
    files: dict[str, str] = doc["files"]
    for rel, digest in sorted(files.items()):
        p = root / rel
        if not p.is_file():
            raise BadArtifact(f"{root} is missing {rel} (listed in {MANIFEST})")
        if sha256_file(p) != digest:
            raise BadArtifact(f"{root}/{rel} was altered (sha256 differs from {MANIFEST})")
    reports = set(doc.get("reports", []))
    for rel in _listing(root):
        if rel not in files and rel not in reports and rel.split("/")[0] not in working:
            raise BadArtifact(f"{root}/{rel} is a foreign file ({MANIFEST} does not list it)")
    return doc


def check_out_dir(out: str | Path, force: bool) -> Path:
    """Refuse an --out that exists and is not empty (unless force), is a file, or whose parent is unwritable."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BadUsage(f"--out {out} is a file; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadUsage(f"--out {out} exists and is not empty; pass --force to replace it")
    parent = out.resolve().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise BadUsage(f"--out {out}: {probe} is a file; give a directory path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise BadUsage(f"--out {out}: {probe} is not writable")
    return out


@contextlib.contextmanager
def atomic_output(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; on success rename it onto ``out``, on any error delete it.

    An existing ``out`` is replaced only with ``force`` (and only once the new one is complete).
    """
    out = check_out_dir(out, force)
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise BadUsage(f"--out {out}: cannot create a directory there ({e.strerror})") from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    from kvexport.atomic import user_mode

    user_mode(tmp)  # mkdtemp is 0700 and onnx writes external data 0600: the user's umask instead
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
        os.rename(out, old / "d")
    try:
        os.rename(tmp, out)
    except OSError:
        if old is not None:
            os.rename(old / "d", out)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
