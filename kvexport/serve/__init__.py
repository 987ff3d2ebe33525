# SPDX-License-Identifier: Apache-2.0
"""``kvexport serve``: an OpenAI-compatible server over an export, with a fixed cache per sequence and
in-flight batching (docs/serve.md). Needs the ``serve`` extra: ``pip install 'kvexport[serve]'``."""

from kvexport.serve.engine import Engine, Event, Sequence
from kvexport.serve.model import ServedModel, open_model
from kvexport.serve.sampling import SamplingParams
from kvexport.serve.server import ServerThread, serve

__all__ = ["Engine", "Event", "Sequence", "ServedModel", "open_model", "SamplingParams", "ServerThread", "serve"]
