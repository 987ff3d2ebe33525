# SPDX-License-Identifier: Apache-2.0
"""The custom ops together, for the exporter and the checks: every op's schemas registered with onnx, the
translation table of the dynamo exporter, the function bodies a graph needs, and a node with the plugin attributes
TensorRT's parser reads. Each op's own module holds its part (:mod:`.topk_gather`, :mod:`.latent_attention`,
:mod:`.cache_step_attention`)."""

from __future__ import annotations

import onnx
import torch
from onnx import defs, helper

from kvexport.ops import cache_step_attention, latent_attention, topk_gather
from kvexport.ops.common import DOMAIN, OP_VERSION, ORT_DOMAIN, PLUGIN_NAMESPACE

#: the kvexport-domain ops, by node name
OPS = {topk_gather.NAME: topk_gather, latent_attention.NAME: latent_attention}
#: TensorRT plugin version each op's nodes ask for by default, and the versions the plugin library registers
PLUGIN_VERSIONS = {name: m.PLUGIN_VERSION for name, m in OPS.items()}
PLUGIN_REGISTERED = {name: m.PLUGIN_REGISTERED for name, m in OPS.items()}
PLUGIN_VERSION = "1"


def register_schemas() -> None:
    """Register the ``kvexport`` domain's schemas with onnx, versions 1 and 2, and the onnxruntime contrib op the
    in-place decode graph uses (idempotent)."""
    made = [m.schema(version) for version in (1, OP_VERSION) for m in OPS.values()]
    for s in [*made, cache_step_attention.schema()]:
        try:
            if defs.get_schema(s.name, s.since_version, s.domain).since_version == s.since_version:
                continue
        except defs.SchemaError:
            pass
        defs.register_schema(s)


def function_protos(model: onnx.ModelProto | None = None) -> list[onnx.FunctionProto]:
    """The model-local functions backing the kvexport nodes: for ``model``, the bodies its nodes use (see each op's
    ``function_for``), else the float TopKGather and one-part float LatentAttention bodies."""
    return [m.function_for(model) for m in OPS.values()]


def plugin_version(op: str, n_inputs: int = 4, latent_format: int = 0) -> str:
    """The ``plugin_version`` of a node of ``op`` (each op's rule)."""
    return OPS[op].plugin_version(n_inputs, latent_format)


def make_node(op: str, inputs: list[str], outputs: list[str], name: str | None = None, **attrs) -> onnx.NodeProto:
    """A ``kvexport`` node with the plugin attributes TensorRT's parser reads."""
    version = plugin_version(op, len(inputs), int(attrs.get("latent_format", 0)))
    return helper.make_node(op, inputs, outputs, name=name, domain=DOMAIN, plugin_namespace=PLUGIN_NAMESPACE,
                            plugin_version=version, **attrs)


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``: the kvexport-domain nodes, onnxruntime's
    GroupQueryAttention, and full reductions (``x.max()``) that onnxscript's torch_lib refuses."""
    import onnxscript
    from onnxscript import opset18 as op

    register_schemas()
    kvx = onnxscript.values.Opset(DOMAIN, OP_VERSION)
    msft = onnxscript.values.Opset(ORT_DOMAIN, 1)

    def amax_onnx(self, dim=(), keepdim: bool = False):
        # torch's full reduction ``x.max()`` lowers to aten.amax with no dim; ReduceMax without axes reduces all
        if dim is None or len(dim) == 0:
            return op.ReduceMax(self, keepdims=int(keepdim))
        return op.ReduceMax(self, op.Constant(value_ints=list(dim)), keepdims=int(keepdim))

    def amin_onnx(self, dim=(), keepdim: bool = False):
        if dim is None or len(dim) == 0:
            return op.ReduceMin(self, keepdims=int(keepdim))
        return op.ReduceMin(self, op.Constant(value_ints=list(dim)), keepdims=int(keepdim))

    return {**topk_gather.translation(kvx), **latent_attention.translation(kvx),
            **cache_step_attention.translation(op, msft),
            torch.ops.aten.amax.default: amax_onnx, torch.ops.aten.amin.default: amin_onnx}


__all__ = ["OPS", "PLUGIN_VERSIONS", "PLUGIN_REGISTERED", "PLUGIN_VERSION", "register_schemas", "function_protos",
           "plugin_version", "make_node", "translation_table"]
