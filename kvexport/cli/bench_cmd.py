# SPDX-License-Identifier: Apache-2.0
"""``kvexport bench``: the side-by-side benchmark (``python -m benchmarks``), forwarded with its arguments."""

from __future__ import annotations

import typer

from kvexport.cli.app import app


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                        "help_option_names": []})
def bench_cmd(ctx: typer.Context) -> None:
    """Benchmark kvexport against HF transformers and Optimum's ONNX export.

    Every argument goes to `python -m benchmarks` (its options: `kvexport bench --help`). Needs a source
    checkout (the benchmarks/ folder)."""
    import importlib.util

    from kvexport.errors import BadUsage

    if importlib.util.find_spec("benchmarks") is None:
        raise BadUsage("kvexport bench runs from a source checkout: the benchmarks/ package is not importable "
                       "here (run it from the repository root)")
    from benchmarks.__main__ import main

    rc = main(list(ctx.args))
    if rc:
        raise typer.Exit(rc)
