# SPDX-License-Identifier: Apache-2.0
"""An export directory on onnxruntime: the step driver of a static-cache export (:class:`OrtGenerator`: the one host
:class:`~kvexport.runtime.host.GraphHost` over :class:`~kvexport.runtime.sessions.OrtSessions`) and
:func:`open_onnxruntime`, which also opens the growing-past baseline (:class:`~kvexport.runtime.growing.GrowingPast`).

Every cache tensor is allocated once by the host; a graph's cache outputs are new rows, which the host writes
where the plan says.
"""

from __future__ import annotations

from pathlib import Path

from kvexport.errors import BadArtifact
from kvexport.manifest import ONNX_EXPORT, read_manifest, verify_manifest
from kvexport.runtime.growing import GrowingPast
from kvexport.runtime.host import GraphHost
from kvexport.runtime.sessions import OrtSessions


class OrtGenerator(GraphHost):
    """A static-cache export on onnxruntime: the step driver (:mod:`kvexport.runtime.protocol`) of its batch, and
    :meth:`generate` (:func:`kvexport.runtime.loop.generate` on it). Arguments: :class:`OrtSessions`."""

    backend = "onnxruntime"

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None,
                 share_weights: bool = True, inplace: bool | None = None, prepack_decode: bool = True):
        man = verify_manifest(Path(path), ONNX_EXPORT)
        if man["settings"]["mode"] != "static":
            raise BadArtifact(f"{path} is a growing-past (--dynamic-cache) export: its memory grows with each sequence; "
                              "open it with kvexport.runtime.open_onnxruntime, or use a static-cache export")
        super().__init__(OrtSessions(path, providers, threads, share_weights, inplace, man, prepack_decode))

    @property
    def sessions(self) -> dict:
        """The export's onnxruntime sessions, by graph."""
        return self.graphs.sessions




def open_onnxruntime(path: str | Path, providers: list[str] | None = None, threads: int | None = None,
                     share_weights: bool = True, inplace: bool | None = None, prepack_decode: bool = True):
    """The step driver of an export directory on onnxruntime: :class:`OrtGenerator` for a static cache,
    :class:`~kvexport.runtime.growing.GrowingPast` for the ``--dynamic-cache`` baseline."""
    if (read_manifest(path).get("settings") or {}).get("mode") == "dynamic":  # verified by the driver
        return GrowingPast(path, providers, threads, share_weights)
    return OrtGenerator(path, providers, threads, share_weights, inplace, prepack_decode)


__all__ = ["OrtGenerator", "open_onnxruntime"]
