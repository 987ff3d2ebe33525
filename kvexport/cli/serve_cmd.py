# SPDX-License-Identifier: Apache-2.0
"""``kvexport serve``: an OpenAI-compatible HTTP server over an export or conversion directory."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvexport.cli.app import app

#: what ``pip install kvexport[serve]`` adds (pyproject.toml)
SERVE_EXTRA = ("starlette", "uvicorn", "pydantic")


@app.command("serve")
def serve_cmd(
    directory: Path = typer.Argument(..., help="An export (`kvexport export --batch 1 --decode-batch N` for batched "
                                     "decoding) or a conversion (`kvexport convert`: serves DIR/onnx)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="TCP port (0: any free port, printed at start)."),
    backend: str = typer.Option("onnxruntime", help="onnxruntime, tensorrt (engines from `kvexport build-engine`) "
                                "or pytorch (the reference decoder, one slot at a time)."),
    max_sequences: Optional[int] = typer.Option(None, "--max-sequences", help="Sequences decoded at once, each in "
                                                "its own fixed cache slot; more wait in a queue. Default: the "
                                                "export's --decode-batch, else 4."),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads of the backend (default: its own)."),
    decode: str = typer.Option("auto", help="With a decode_batch graph: auto (batched from the number of "
                               "sequences where it is faster, timed at start), batched, or rows (one call per "
                               "sequence)."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id of the API (default: the "
                                             "directory's name)."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", help="On SIGTERM/SIGINT, seconds the requests in "
                                        "flight may take to finish before they are cancelled."),
) -> None:
    """Serve the OpenAI completions and chat API (streaming and not), with in-flight batching over fixed-size
    cache slots; GET /health, /v1/models and /metrics."""
    import importlib.util

    from kvexport.errors import MissingBackend

    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:  # the optional extra, in one line; a broken kvexport.serve is an error of its own
        raise MissingBackend(f"kvexport serve needs the serve extra ({missing[0]} is missing): "
                             "pip install 'kvexport[serve]'")
    from kvexport.serve import serve

    return serve(directory, host=host, port=port, backend=backend, max_sequences=max_sequences, threads=threads,
                 name=model_name, drain_timeout=drain_timeout, decode=decode)
