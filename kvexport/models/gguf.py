# SPDX-License-Identifier: Apache-2.0
"""A GGUF file as a model: read its architecture, refuse what kvexport does not support, and turn it once into a
Hugging Face directory (dequantized fp32 safetensors, tokenizer with its special tokens and chat template) that every
command then uses like any other checkpoint.

The dequantized model is "the original" of every comparison kvexport makes (fidelity, parity of the decoder): the
quantization of the GGUF itself is not undone, and ``gguf_source.json`` in the directory says where it came from
(file, sha256, architecture, quantization type). transformers does the dequantization (``from_pretrained(...,
gguf_file=...)`` with the ``gguf`` package); its ``quantization_config`` is dropped, since the saved weights are
plain floats.

The directory lives in the cache (:func:`cache_root`: ``$KVEXPORT_CACHE`` or ``~/.cache/kvexport``) under
``gguf/<stem>-<sha256[:16]>``, keyed by the file's content, so a second command on the same file loads it in place.
It is built in a temporary sibling and renamed into place (two processes building it at once: the first rename wins
and the other's copy is dropped), with the user's umask."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvexport.errors import BadModel, BadUsage, MissingBackend
from kvexport.models.spec import SUPPORTED_FAMILIES, supported_families_text

#: GGUF ``general.architecture`` -> transformers ``model_type`` for the families kvexport supports (llama.cpp
#: writes Mistral checkpoints as "llama"; "mistral" appears in some converters' output)
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
SOURCE_FILE = "gguf_source.json"
#: bump when the layout of a materialized directory changes, so older caches are rebuilt
LAYOUT = 1


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def cache_root() -> Path:
    """Where kvexport keeps what it derives from downloads: ``$KVEXPORT_CACHE`` or ``~/.cache/kvexport``."""
    env = os.environ.get("KVEXPORT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvexport"


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise MissingBackend("reading a .gguf model needs the 'gguf' package (pip install gguf)") from None
    try:
        return GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - any failure here means a damaged or foreign file
        raise BadModel(f"{path} is not a readable GGUF file ({e.__class__.__name__}: {str(e)[:120]})") from None


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - older gguf: decode the string by hand
        return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")


def inspect_gguf(path: str | os.PathLike) -> dict:
    """{architecture, model_type, name, file_type, tensors} of a GGUF file, or :class:`BadModel` in one line when it is
    missing, damaged or of an architecture kvexport does not support. Reads the header only (memory-mapped)."""
    p = Path(path)
    if not p.is_file():
        raise BadModel(f"GGUF file {str(p)!r} does not exist")
    with p.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise BadModel(f"{p} is not a GGUF file (no GGUF magic at its start)")
    r = _reader(p)
    arch = _field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise BadModel(f"{p.name}: GGUF architecture {arch!r} is not supported; supported: "
                       f"{', '.join(sorted(ARCHITECTURES))} (transformers families {supported_families_text()})")
    assert ARCHITECTURES[arch] in SUPPORTED_FAMILIES
    return {"architecture": arch, "model_type": ARCHITECTURES[arch], "name": _field(r, "general.name"),
            "file_type": _field(r, "general.file_type"), "tensors": len(r.tensors)}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _complete(d: Path) -> bool:
    try:
        return json.loads((d / SOURCE_FILE).read_text()).get("layout") == LAYOUT and (d / "config.json").is_file()
    except (OSError, ValueError):
        return False


def materialize(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """The HF directory of a supported GGUF file (built on first use, then taken from the cache)."""
    p = Path(path).expanduser().resolve()
    info = inspect_gguf(p)  # refuses before anything is written
    digest = sha256_file(p)
    root = Path(cache) if cache is not None else cache_root()
    target = root / "gguf" / f"{p.stem}-{digest[:16]}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_hf_dir(p, tmp, {**info, "file": p.name, "sha256": digest, "layout": LAYOUT})
        from kvexport.atomic import user_mode

        user_mode(tmp)
        if target.exists() and not _complete(target):
            shutil.rmtree(target, ignore_errors=True)  # an older layout or a damaged copy
        try:
            os.rename(tmp, target)
        except OSError:
            if not _complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process was faster
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_hf_dir(src: Path, out: Path, source: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvexport.models.release import free_memory

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise BadModel(f"transformers could not read {src.name}: {str(e).splitlines()[0][:200]}") from None
    # the weights are dequantized floats by now: saved as such, without the GGUF quantizer that refuses to save
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    free_memory()
    tok.save_pretrained(str(out))
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")


def model_dir(model: str | os.PathLike) -> str | os.PathLike:
    """A ``.gguf`` path -> its HF directory (:func:`materialize`); anything else unchanged."""
    if isinstance(model, (str, os.PathLike)) and is_gguf(model):
        return str(materialize(model))
    return model


def gguf_source(model_dir_path: str | os.PathLike) -> dict | None:
    """The record of the GGUF file a directory was made from, or None for a plain HF directory."""
    try:
        return json.loads((Path(model_dir_path) / SOURCE_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return None


def resolve_model(model: str | None) -> str:
    """A command's model argument -> the directory it loads: None -> the bundled reference student; a ``.gguf``
    file -> its HF directory (:func:`kvexport.models.gguf.model_dir`: an unsupported architecture is refused before
    anything is written); a directory unchanged."""
    from kvexport.paths import DEFAULT_MODEL

    if model is None:
        if not DEFAULT_MODEL.exists():
            raise BadUsage(f"no MODEL given and the bundled model {DEFAULT_MODEL} is missing")
        return str(DEFAULT_MODEL)
    return str(model_dir(model))


__all__ = ["ARCHITECTURES", "is_gguf", "cache_root", "inspect_gguf", "materialize", "model_dir", "gguf_source",
           "resolve_model"]
