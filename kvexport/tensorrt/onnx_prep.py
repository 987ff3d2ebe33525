# SPDX-License-Identifier: Apache-2.0
"""ONNX preparation for TensorRT's parser.

kvexport's graphs carry the custom ops TopKGather / LatentAttention as nodes of domain ``kvexport`` backed by
model-local functions of the same name (so onnxruntime runs them). TensorRT's ONNX parser before 10.7 inlines a
local function instead of looking for a plugin; from 10.7 a registered plugin wins (and a ``plugin_namespace``
attribute sends the node to the plugin first). So for TensorRT < 10.7 the functions are stripped from a copy of
the model; for newer versions the copy is unchanged. See ../shared/REFERENCE.md §3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvexport.errors import BadArtifact, BadUsage
from kvexport.tensorrt.backend import parse_version

KVEXPORT_DOMAIN = "kvexport"
PLUGIN_OPS = ("TopKGather", "LatentAttention")
#: first TensorRT whose ONNX parser prefers a registered plugin over a model-local function of the same name
PLUGINS_WIN_FROM = (10, 7, 0)


@dataclass
class PreparedOnnx:
    """What :func:`prepare_onnx_for_trt` did."""

    path: Path
    stripped_functions: list[str] = field(default_factory=list)
    plugin_nodes: dict[str, int] = field(default_factory=dict)  # op_type -> count


def needs_function_strip(trt_version) -> bool:
    return parse_version(trt_version) < PLUGINS_WIN_FROM


def _uses_external_data(model) -> bool:
    from onnx.external_data_helper import uses_external_data

    return any(uses_external_data(t) for t in model.graph.initializer)


def prepare_onnx_for_trt(onnx_path: str | Path, out_path: str | Path, trt_version) -> PreparedOnnx:
    """Copy ``onnx_path`` to ``out_path`` so that TensorRT ``trt_version`` maps the kvexport nodes to plugins.

    TensorRT < 10.7: the model-local functions TopKGather / LatentAttention (domain ``kvexport``) are removed, so
    the parser cannot inline them and imports the nodes as plugins. Every kvexport node gets
    ``plugin_namespace = "kvexport"`` and ``plugin_version = "1"`` if the exporter left them out. Weights stored
    as external data stay where they are when ``out_path`` sits beside ``onnx_path``.
    """
    import onnx

    src, dst = Path(onnx_path), Path(out_path)
    if not src.is_file():
        raise BadUsage(f"ONNX file {src} does not exist")
    strip = needs_function_strip(trt_version)
    try:
        model = onnx.load(str(src), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf raises several kinds
        raise BadArtifact(f"{src} is not a readable ONNX model ({e.__class__.__name__})") from None
    external = _uses_external_data(model)
    if external and dst.resolve().parent != src.resolve().parent:
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(model, str(src.parent))

    res = PreparedOnnx(path=dst)
    for node in model.graph.node:
        if node.domain == KVEXPORT_DOMAIN and node.op_type in PLUGIN_OPS:
            res.plugin_nodes[node.op_type] = res.plugin_nodes.get(node.op_type, 0) + 1
            names = {a.name for a in node.attribute}
            if "plugin_namespace" not in names:
                node.attribute.append(onnx.helper.make_attribute("plugin_namespace", KVEXPORT_DOMAIN))
            if "plugin_version" not in names:
                node.attribute.append(onnx.helper.make_attribute("plugin_version", "1"))
    if strip:
        keep = []
        for f in model.functions:
            if f.domain == KVEXPORT_DOMAIN and f.name in PLUGIN_OPS:
                res.stripped_functions.append(f.name)
            else:
                keep.append(f)
        del model.functions[:]
        model.functions.extend(keep)

    dst.parent.mkdir(parents=True, exist_ok=True)
    if external and dst.resolve().parent != src.resolve().parent:
        onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    else:
        onnx.save(model, str(dst))
    return res
