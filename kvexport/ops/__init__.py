# SPDX-License-Identifier: Apache-2.0
"""kvexport's custom ops, one module each (reference, PyTorch op, ONNX schema and function, exporter translation,
plugin contract): :mod:`.topk_gather`, :mod:`.latent_attention`, :mod:`.cache_step_attention`; all of them together
for the exporter: :mod:`.registry` (contracts: docs/custom_ops.md). ``ops.topk_gather`` etc. are the op
modules."""

from kvexport.ops import cache_step_attention, latent_attention, topk_gather
from kvexport.ops.common import DOMAIN, OP_VERSION, OPSET, ORT_DOMAIN, PLUGIN_NAMESPACE
from kvexport.ops.latent_attention import LATENT_FORMATS, latent_attention_reference
from kvexport.ops.registry import (
    PLUGIN_REGISTERED,
    PLUGIN_VERSION,
    PLUGIN_VERSIONS,
    function_protos,
    make_node,
    plugin_version,
    register_schemas,
    translation_table,
)

__all__ = ["DOMAIN", "OP_VERSION", "OPSET", "ORT_DOMAIN", "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "PLUGIN_VERSIONS",
           "PLUGIN_REGISTERED", "LATENT_FORMATS", "latent_attention_reference", "register_schemas", "function_protos",
           "make_node", "plugin_version", "translation_table", "topk_gather", "latent_attention", "cache_step_attention"]
