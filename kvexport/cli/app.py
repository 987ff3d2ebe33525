# SPDX-License-Identifier: Apache-2.0
"""The ``kvexport`` typer app every subcommand module registers on (:mod:`kvexport.cli` imports them all)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvexport",
    help="Turn a Hugging Face causal LM into a model with a small, fixed-size KV cache, exported for "
    "NVIDIA GPUs and Jetson (static-budget eviction, MLA latent caches, ONNX + TensorRT plugins).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain click help: flags show no value placeholder (rich help printed `--force <bool>`), and --help
    # imports nothing beyond typer
    rich_markup_mode=None,
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks instead of one-line errors."),
) -> None:
    """kvexport: static-budget and latent KV caches, exported."""
