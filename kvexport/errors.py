# SPDX-License-Identifier: Apache-2.0
"""kvexport's error taxonomy: each kind carries a one-line user message and an exit code.

The CLI prints ``error: <message>`` for every :class:`KVExportError` except :class:`InternalError`
and exits with the kind's code; ``--debug`` adds the traceback.
"""

from __future__ import annotations


class KVExportError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code = 1
    kind = "error"


class BadUsage(KVExportError, ValueError):
    """Options or arguments that make no sense (ranges, combinations)."""

    exit_code = 2
    kind = "bad usage"


class BadModel(KVExportError, ValueError):
    """A model directory or object kvexport cannot use."""

    exit_code = 3
    kind = "bad model"


class BadArtifact(KVExportError):
    """An exported directory that is missing files, altered, or foreign."""

    exit_code = 4
    kind = "bad artifact"


class MissingBackend(KVExportError, RuntimeError):
    """An optional backend (TensorRT, a GPU, onnxruntime-gpu, chromium) is not available."""

    exit_code = 5
    kind = "missing backend"


class ParityFailure(KVExportError):
    """A validated artifact is outside the stated tolerances."""

    exit_code = 6
    kind = "parity failure"


class InternalError(KVExportError, RuntimeError):
    """A bug in kvexport."""

    exit_code = 70
    kind = "internal error"


__all__ = [
    "KVExportError",
    "BadUsage",
    "BadModel",
    "BadArtifact",
    "MissingBackend",
    "ParityFailure",
    "InternalError",
]
