# SPDX-License-Identifier: Apache-2.0
"""The model a server serves: an export or conversion directory, its backend's slots and its tokenizer.

``open_model(DIR)`` accepts what ``kvexport generate/validate`` accept: an export (``kvexport export``, manifest
verified) or a conversion (``kvexport convert``: its outputs verified, then DIR/onnx served; with ``--backend
tensorrt`` its engines in DIR/engine). The backend is opened before the tokenizer, and the server binds its port
only after both: a missing backend (TensorRT, a GPU) is refused with one line and nothing listens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvexport.errors import BadArtifact, BadUsage
from kvexport.serve.backends.base import DECODE_MODES, SlotBackend

BACKENDS = ("onnxruntime", "tensorrt", "pytorch")


@dataclass
class ServedModel:
    """``name`` (the API's model id), ``export_dir``, ``backend`` (its slots), ``tokenizer``, ``limit`` (positions
    per sequence: prompt + completion), ``eos`` (the tokenizer's EOS id or None)."""

    name: str
    export_dir: Path
    backend: SlotBackend
    tokenizer: object
    limit: int
    eos: int | None

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids, the way ``kvexport generate`` encodes a prompt (special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages -> token ids through the tokenizer's chat template, with the assistant's turn opened."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]


def resolve_export(directory: str | Path, backend: str = "onnxruntime") -> tuple[Path, Path | None]:
    """(the export directory, the TensorRT engine folder or None) of an export or conversion directory."""
    from kvexport import layout

    d = Path(directory)
    if not d.is_dir():
        raise BadUsage(f"{d} is not a directory (give an export from `kvexport export` or a conversion from "
                       "`kvexport convert`)")
    if layout.is_conversion(d):
        layout.verify_conversion(d)
        engines = d / layout.ENGINE_DIR if backend == "tensorrt" and (d / layout.ENGINE_DIR).is_dir() else None
        return d / layout.ONNX_DIR, engines
    kind = (layout.read_manifest(d) or {}).get("kind")
    if kind == "tensorrt-engines":
        raise BadUsage(f"{d} holds TensorRT engines; serve the export they were built from with --backend tensorrt")
    if not (d / layout.MANIFEST).is_file():
        raise BadArtifact(f"{d} has no manifest.json: not an export (`kvexport export`) or a conversion "
                          "(`kvexport convert`)")
    return d, None


def open_backend(export_dir: Path, backend: str, max_sequences: int | None, threads: int | None = None,
                 engines: Path | None = None, decode: str = "auto", prepack: bool = True) -> SlotBackend:
    if not prepack and backend != "onnxruntime":
        raise BadUsage(f"--no-prepack applies to --backend onnxruntime (its decode sessions' packed weights), "
                       f"not to {backend}")
    if backend in ("onnxruntime", "tensorrt"):
        from kvexport.serve.backends.graphs import GraphSlots

        kw = {"prepack_decode": False} if not prepack else None
        return GraphSlots(export_dir, backend, max_sequences, threads, engines, decode, runtime_kw=kw)
    if backend == "pytorch":
        from kvexport.serve.backends.torch_slots import TorchSlots

        return TorchSlots(export_dir, max_sequences, threads, decode)
    raise BadUsage(f"--backend {backend!r} is not one of: {', '.join(BACKENDS)}")


def open_model(directory: str | Path, backend: str = "onnxruntime", max_sequences: int | None = None,
               threads: int | None = None, name: str | None = None, decode: str = "auto",
               prepack: bool = True) -> ServedModel:
    """Open ``directory`` for serving on ``backend`` with ``max_sequences`` slots (see the module docstring).
    ``prepack`` (onnxruntime): the decode sessions keep a packed copy of the weights each (faster steps); False:
    every session reads the one memory-mapped copy (kvexport.runtime.sessions.OrtSessions)."""
    from kvexport.models.loading import load_tokenizer

    if backend not in BACKENDS:
        raise BadUsage(f"--backend {backend!r} is not one of: {', '.join(BACKENDS)}")
    if decode not in DECODE_MODES:
        raise BadUsage(f"--decode {decode!r} is not one of: {', '.join(DECODE_MODES)}")
    if max_sequences is not None and int(max_sequences) < 1:
        raise BadUsage(f"--max-sequences {max_sequences} must be >= 1")
    export_dir, engines = resolve_export(directory, backend)
    slots = open_backend(export_dir, backend, max_sequences, threads, engines, decode, prepack)
    s = slots.settings
    tok = load_tokenizer(export_dir / s["tokenizer"]) if s.get("tokenizer") else None
    if tok is None:
        raise BadArtifact(f"{export_dir} has no tokenizer/; export from a model directory that has tokenizer.json")
    return ServedModel(name or Path(directory).resolve().name, export_dir, slots, tok, slots.limit, tok.eos_token_id)


__all__ = ["ServedModel", "open_model", "resolve_export", "BACKENDS"]
