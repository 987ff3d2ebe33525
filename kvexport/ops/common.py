# SPDX-License-Identifier: Apache-2.0
"""What every kvexport custom op shares: the ONNX domain and its version, the opset of the function bodies, and the
TensorRT plugin attributes a node carries (contracts: docs/custom_ops.md)."""

from __future__ import annotations

from onnx import defs

DOMAIN = "kvexport"
OP_VERSION = 2
OPSET = 18  # default-domain opset of every exported graph and of the function bodies
PLUGIN_NAMESPACE = "kvexport"
#: the ONNX domain of onnxruntime's contrib ops (GroupQueryAttention), used only by ``*.ort.onnx`` graphs
ORT_DOMAIN = "com.microsoft"
#: schemas' float types
FLOATS = ["tensor(float)", "tensor(float16)"]


def plugin_attrs() -> list:
    """The optional attributes TensorRT's parser reads from a kvexport node."""
    A = defs.OpSchema.AttrType
    return [defs.OpSchema.Attribute("plugin_namespace", A.STRING, "TensorRT plugin namespace", required=False),
            defs.OpSchema.Attribute("plugin_version", A.STRING, "TensorRT plugin version", required=False)]


__all__ = ["DOMAIN", "OP_VERSION", "OPSET", "PLUGIN_NAMESPACE", "ORT_DOMAIN", "FLOATS", "plugin_attrs"]
