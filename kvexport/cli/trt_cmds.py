# SPDX-License-Identifier: Apache-2.0
"""``kvexport build-engine``: TensorRT engines for every ONNX graph of an exported directory."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvexport.cli.app import app


@app.command("build-engine")
def build_engine_cmd(
    export_dir: Path = typer.Argument(
        ..., help="Directory written by `kvexport export` (ONNX graphs + manifest.json)."
    ),
    plugins: Optional[Path] = typer.Option(
        None,
        "--plugins",
        help="libkvexport_plugins.so (default: $KVEXPORT_PLUGINS or build/plugins/ of this checkout; build it with "
        "cmake, see docs/tensorrt.md).",
    ),
    fp16: bool = typer.Option(False, "--fp16", help="Let TensorRT use FP16 kernels where the graph allows."),
    out: Optional[Path] = typer.Option(None, "--out", help="Engine folder, written atomically with its own manifest "
                                       "(default: EXPORT_DIR-tensorrt beside EXPORT_DIR)."),
    workspace_gib: Optional[float] = typer.Option(None, "--workspace-gib", help="Builder workspace limit in GiB."),
) -> None:
    """Build one TensorRT engine per .onnx graph in EXPORT_DIR (plugins for TopKGather / LatentAttention)."""
    from rich.console import Console

    from kvexport.errors import BadArtifact, BadUsage
    from kvexport.manifest import MANIFEST, atomic_output, sha256_file, verify_manifest, write_manifest
    from kvexport.tensorrt import build_engine, find_onnx_graphs
    from kvexport.tensorrt.backend import import_tensorrt
    from kvexport.tensorrt.engine import write_build_record
    from kvexport.tensorrt.generator import ENGINE_KIND
    from kvexport.tensorrt.plugins import check_plugin_library_file

    console = Console()
    if not export_dir.exists():
        raise BadUsage(f"export directory {export_dir} does not exist (write one with `kvexport export`)")
    if not export_dir.is_dir():
        raise BadUsage(f"{export_dir} is not a directory; give the folder `kvexport export` wrote")
    # the graphs must be exactly what `kvexport export` wrote: refuse missing, altered or foreign files first
    manifest = verify_manifest(export_dir)
    graphs = find_onnx_graphs(export_dir)
    if not graphs:
        raise BadArtifact(f"{export_dir} holds no .onnx graph; is it a `kvexport export` directory?")
    out_dir = out or export_dir.with_name(export_dir.name + "-tensorrt")
    if out_dir.resolve() == export_dir.resolve() or export_dir.resolve() in out_dir.resolve().parents:
        raise BadUsage(f"--out {out_dir} is inside {export_dir}; engines there would be files its manifest does "
                       "not list (give a folder beside it)")
    if plugins is not None:
        check_plugin_library_file(plugins)
    if workspace_gib is not None and workspace_gib <= 0:
        raise BadUsage(f"--workspace-gib {workspace_gib} must be > 0")
    trt = import_tensorrt()  # MissingBackend (exit 5) with one line when TensorRT is absent
    reports = []
    with atomic_output(out_dir, force=True) as tmp:  # an interrupted build leaves the previous engines as they were
        for g in graphs:
            r = build_engine(g, tmp / (g.stem + ".engine"), plugins=plugins, fp16=fp16, workspace_gib=workspace_gib)
            r.engine = str(out_dir / (g.stem + ".engine"))
            reports.append(r)
            console.print(
                f"{g.name} -> {r.engine} ({r.bytes / 2**20:.1f} MiB, {r.seconds:.1f}s; plugin nodes "
                f"{r.plugin_nodes or 'none'}; stripped functions {r.stripped_functions or 'none'})",
                highlight=False,
            )
        write_build_record(tmp, reports)
        settings = {"tensorrt": trt.__version__, "fp16": fp16, "workspace_gib": workspace_gib,
                    "export": str(export_dir.resolve()), "export_manifest_sha256": sha256_file(export_dir / MANIFEST)}
        write_manifest(tmp, ENGINE_KIND, settings, manifest.get("model_hash"))
    record = out_dir / "engines.json"
    console.print(f"[dim]TensorRT {trt.__version__}, fp16={fp16}: {len(reports)} engine(s); record {record}[/]")
