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
                                "or pytorch (kvexport's decoder on the export's source model, the decoding slots in one "
                                "batched forward)."),
    max_sequences: Optional[int] = typer.Option(None, "--max-sequences", help="Sequences decoded at once, each in "
                                                "its own fixed cache slot; more wait in a queue. Default: the "
                                                "export's --decode-batch, else 4."),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads of the backend (default: its own)."),
    decode: str = typer.Option("auto", help="With a decode_batch graph: auto (batched from the number of "
                               "sequences where it is faster, timed at start), batched, or rows (one call per "
                               "sequence). With --backend pytorch: rows, else one batched forward."),
    prepack: bool = typer.Option(True, "--prepack/--no-prepack", help="onnxruntime: each decode session ("
                                 "decode, decode_batch) keeps a packed copy of the weights, about their bytes each, "
                                 "for faster steps (1.3x on SmolLM2). --no-prepack: one memory-mapped copy for all."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id of the API (default: the "
                                             "directory's name)."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", help="On SIGTERM/SIGINT, seconds the requests in "
                                        "flight may take to finish before they are cancelled."),
    max_body_bytes: Optional[int] = typer.Option(None, "--max-body-bytes", help="Largest request body (413 beyond, "
                                                 "refused before it is read). Default: 4 x --max-prompt-chars, at "
                                                 "least 1 MiB."),
    max_json_depth: int = typer.Option(32, "--max-json-depth", help="Deepest nesting of a JSON body (400 beyond, "
                                       "refused before it is parsed)."),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", help="Most tokens in one prompt "
                                                    "(400 context_length_exceeded beyond). Default: the context - 1."),
    max_prompt_chars: Optional[int] = typer.Option(None, "--max-prompt-chars", help="Most characters in the prompts "
                                                   "(or message contents) of one request, refused before tokenizing. "
                                                   "Default: 16 x --max-prompt-tokens."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Most tokens one completion may ask for "
                                             "(max_tokens). Default: the context, at most 4096."),
    max_queue: int = typer.Option(1024, "--max-queue", help="Most sequences waiting for a slot (503 beyond)."),
    max_queued_tokens: Optional[int] = typer.Option(None, "--max-queued-tokens", help="Most tokens (prompt + "
                                                    "max_tokens) of the sequences waiting for a slot (503 beyond). "
                                                    "Default: 64 x the context, at least 2**20."),
    max_requests: int = typer.Option(256, "--max-requests", help="Most completion requests in flight at once (being "
                                     "read, waiting, generating or streaming); 503 beyond, before the body is read."),
) -> None:
    """Serve the OpenAI completions and chat API (streaming and not), with in-flight batching over fixed-size
    cache slots; GET /health, /v1/models and /metrics. Every request is held to the limits below before its work
    is done (docs/serve.md "Limits")."""
    import importlib.util

    from kvexport.errors import MissingBackend

    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:  # the optional extra, in one line; a broken kvexport.serve is an error of its own
        raise MissingBackend(f"kvexport serve needs the serve extra ({missing[0]} is missing): "
                             "pip install 'kvexport[serve]'")
    from kvexport.serve import serve
    from kvexport.serve.limits import Limits

    limits = Limits(max_body_bytes=max_body_bytes, max_json_depth=max_json_depth, max_prompt_tokens=max_prompt_tokens,
                    max_prompt_chars=max_prompt_chars, max_tokens=max_tokens, max_queue=max_queue,
                    max_queued_tokens=max_queued_tokens, max_requests=max_requests)
    return serve(directory, host=host, port=port, backend=backend, max_sequences=max_sequences, threads=threads,
                 name=model_name, drain_timeout=drain_timeout, decode=decode, limits=limits,
                 prepack=prepack)
