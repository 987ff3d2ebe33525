# SPDX-License-Identifier: Apache-2.0
"""One graph from a module to an ONNX file: ``torch.onnx.export(dynamo=True)`` with the custom ops' translation table
(:func:`kvexport.ops.translation_table`), constant folding and clean-up on the IR, the graph's large weights written
once into the export's shared weights file (:class:`SharedWeights`), the kvexport functions attached (``--ops
custom``) or inlined (``--ops standard``), and onnx's full check of the saved file."""

from __future__ import annotations

import contextlib
import hashlib
import operator
import sys
import warnings
from pathlib import Path

import torch

from kvexport import ops

_REGISTRIES: dict = {}
#: ONNX element types whose raw bytes are the NumPy array's bytes (little-endian), so a tensor can be written from
#: a view of its own memory; any other type goes through the tensor's ``tobytes`` (packed 4-bit types, strings)
_VIEWABLE = {"FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE", "INT8", "UINT8", "INT16", "UINT16", "INT32", "UINT32",
             "INT64", "UINT64", "BOOL"}


WEIGHTS_FILE = "weights.data"  # every graph's initializers of at least EXTERNAL_MIN_BYTES, each stored once


EXTERNAL_MIN_BYTES = 1024


WEIGHT_ALIGN = 64  # byte alignment of each tensor in WEIGHTS_FILE

#: Python arithmetic and comparisons on symbolic sizes that torch.export records (``C + 288`` slots, ``2 * C``
#: rows, a shape assertion's ``==``): torchlib translates each (``operator_add`` ...)
_SIZE_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
                    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge}


def _finish_proto(model, custom: bool):
    """Attach (custom) or inline (standard) the kvexport functions, strip per-node metadata. The graph's weights
    are external by now (:class:`SharedWeights`), so the proto is small; it is checked once saved (:func:`_check`)."""
    from onnx import inliner

    uses = {n.op_type for n in model.graph.node if n.domain == ops.DOMAIN}
    del model.functions[:]
    if uses:
        model.functions.extend(f for f in ops.function_protos(model) if f.name in uses)
    if not custom and uses:
        model = inliner.inline_local_functions(model)
        keep = [o for o in model.opset_import if o.domain != ops.DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep)
    if not uses:
        keep = [o for o in model.opset_import if o.domain != ops.DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep)
    for n in model.graph.node:
        del n.metadata_props[:]
    del model.metadata_props[:]
    model.graph.doc_string = ""
    model.doc_string = ""
    model.producer_name = "kvexport"
    import kvexport

    model.producer_version = kvexport.__version__
    return model


def _check(path: Path) -> None:
    """onnx's full check (schemas, shape inference) of a saved graph; by path, so that it finds the external
    weights beside it without loading them."""
    import onnx

    ops.register_schemas()
    onnx.checker.check_model(str(path), full_check=True)


@contextlib.contextmanager
def _torchlib_registry_once():
    """Build torch.onnx's torchlib registry once per process instead of once per graph (about a second each).

    ``torch.onnx.export`` makes a fresh ``ONNXRegistry.from_torchlib()`` on every call and then registers the
    custom translations on it; the registry only depends on the opset, and registering our translations again
    puts the same functions first, so one registry per opset serves every graph. Falls back to torch's own path
    if its private layout differs."""
    try:
        from torch.onnx._internal.exporter import _registration as reg

        original = reg.ONNXRegistry.__dict__["from_torchlib"]
    except (ImportError, KeyError):  # pragma: no cover - another torch layout: no caching
        yield
        return

    def cached(cls, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in _REGISTRIES:
            _REGISTRIES[key] = original.__func__(cls, *args, **kwargs)
        return _REGISTRIES[key]

    reg.ONNXRegistry.from_torchlib = classmethod(cached)
    try:
        yield
    finally:
        reg.ONNXRegistry.from_torchlib = original


def _rewrite_to_registered(ep, registered: set) -> bool:
    """Rewrite, in place, the few ATen ops of ``ep``'s graph that torchlib does not translate into ones it does,
    each the op's own decomposition in torch (``torch._refs`` / ``torch._decomp``): ``to.dtype`` is
    ``_to_copy(dtype=)``, ``__and__`` is ``bitwise_and``, ``rsub.Scalar(x, c)`` (alpha 1) is ``add(neg(x), c)``.
    -> True when every op is then translatable (assertions aside, which torch.onnx removes), else False with the
    graph unchanged. Python arithmetic and comparisons on symbolic sizes (:data:`_SIZE_ARITHMETIC`: a dynamic
    capacity's ``C + 288`` columns, a ragged chunk's ``2 * n`` rows) are translated as they are; any other symbolic
    function (``pow``, ``sym_not``: the growing past's mask checks; translated as they are, onnxruntime refuses one
    of that graph's Reshapes) leaves the graph to torch's pass."""
    aten = torch.ops.aten
    asserts = {aten._assert_scalar.default, aten._assert_tensor_metadata.default, aten._assert_async.default,
               aten._assert_async.msg, aten.sym_constrain_range_for_size.default}
    rewrites = {aten.to.dtype, aten.__and__.Tensor, aten.rsub.Scalar}
    todo = []
    for gm in ep.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            return False
        for node in gm.graph.nodes:
            t = node.target
            if node.op != "call_function" or t is operator.getitem:
                continue
            if not isinstance(t, torch._ops.OpOverload):
                if t in _SIZE_ARITHMETIC:  # a size computed from symbolic sizes: translated as it is
                    continue
                return False  # other symbolic functions (``pow``, ``sym_not``: the growing past): torch's pass
            if t in registered:
                continue
            if t in asserts:
                continue
            alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
            if t not in rewrites or (t is aten.rsub.Scalar and alpha != 1):
                return False
            if t is aten.to.dtype and (len(node.args) < 2 or set(node.kwargs) - {"non_blocking", "copy"}):
                return False
            todo.append((gm, node))
    for gm, node in todo:
        t = node.target
        if t is aten.to.dtype:
            node.target, node.args, node.kwargs = aten._to_copy.default, (node.args[0],), {"dtype": node.args[1]}
        elif t is aten.__and__.Tensor:
            node.target = aten.bitwise_and.Tensor
        else:  # rsub.Scalar(x, c) = c - x
            with gm.graph.inserting_before(node):
                neg = gm.graph.call_function(aten.neg.default, (node.args[0],))
            neg.meta.update({k: v for k, v in node.args[0].meta.items() if k in ("val", "tensor_meta")})
            neg.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
            node.target, node.args, node.kwargs = aten.add.Tensor, (neg, node.args[1]), {}
    for gm in {gm for gm, _ in todo}:
        gm.recompile()
    return True


@contextlib.contextmanager
def _decompose_only_what_is_not_translated():
    """torch.onnx decomposes every exported program through ``run_decompositions``: a second and third full trace of
    the graph (functionalization and metadata collection, then make_fx) that is 40 % of a graph's export time,
    for graphs in which nothing but ``.to(dtype)``, ``&`` and ``1 - x`` lacks a translation. The pass is replaced
    by :func:`_rewrite_to_registered` when that covers every op of the graph (sizes computed from symbolic sizes by
    plain arithmetic included), and runs as before otherwise (any other op or symbolic function, or another torch
    layout).
    Timings and the equality check: docs/export.md, "Export time"."""
    try:
        from torch.onnx._internal.exporter import _decomp, _fx_passes

        original = _fx_passes.decompose_with_registry
    except (ImportError, AttributeError):  # pragma: no cover - another torch layout: torch's own pass
        yield
        return
    registered: dict[int, set] = {}

    def light(exported_program, registry):
        ops_ = registered.get(id(registry))
        if ops_ is None:
            ops_ = registered[id(registry)] = set(_decomp.get_onnx_implemented_overloads(registry))
        if _rewrite_to_registered(exported_program, ops_):
            return exported_program
        return original(exported_program, registry)

    _fx_passes.decompose_with_registry = light
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry = original


def _export_graph(module, args: tuple, input_names: list[str], output_names: list[str], custom: bool,
                  weights: "SharedWeights", dynamic_shapes=None):
    """Trace ``module`` and translate it to ONNX; -> (ModelProto without weight bytes, whether it uses
    ``weights``' file). The exporter's initializers wrap the module's own tensors (no copy); after the clean-up
    passes each large one is written to ``weights`` and replaced by a reference, one tensor at a time, before the
    graph becomes a proto, so the weights are never serialized into memory."""
    table = ops.translation_table()
    with torch.no_grad(), warnings.catch_warnings(), _torchlib_registry_once(), _decompose_only_what_is_not_translated():
        warnings.simplefilter("ignore")
        import io
        from contextlib import redirect_stdout

        buf = io.StringIO()
        with redirect_stdout(buf):
            prog = torch.onnx.export(module, args, dynamo=True, custom_translation_table=table, opset_version=ops.OPSET,
                                     input_names=input_names, output_names=output_names, optimize=False,
                                     dynamic_shapes=dynamic_shapes, verbose=False)
        _optimize(prog.model)
        used = weights.externalize(prog.model)
        import onnx_ir as ir

        proto = ir.serde.serialize_model(prog.model)
    del prog
    return _finish_proto(proto, custom), used


def _optimize(model) -> None:
    """Constant folding and clean-up on the exported IR, in place.

    onnxscript's full optimizer (what ``optimize=True`` runs) adds its pattern-rewrite rules and fusions; on
    kvexport's graphs they change a handful of nodes of several hundred (a few scalar Mul/Unsqueeze) and cost
    about 40 % of the export time, so only the folding, dead-node, initializer and naming passes run here."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import _constant_folding

    fold = _constant_folding.FoldConstantsPass(shape_inference=True,
                                               input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                                               output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                                               should_fold=lambda node: None)
    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager([fold, common.RemoveUnusedNodesPass()], steps=2, early_stop=True),
        common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.DeduplicateInitializersPass(), common.CommonSubexpressionEliminationPass(), common.OutputFixPass(),
        common.NameFixPass(),
    )(model)
    if _fold_weight_reshapes(model):
        common.RemoveUnusedNodesPass()(model)


def _fold_weight_reshapes(model) -> int:
    """Replace ``Reshape(weight, constant shape)``, ``Slice(weight, constant starts / ends / axes / steps)`` and
    ``Transpose(weight)`` by the weight itself in the new shape, the slice of it or its transpose (views of the same
    memory; a transposed one is written contiguous, one tensor at a time, by :class:`SharedWeights`);
    -> how many. onnxscript's folding leaves them (its input size limit), and onnxruntime would fold each one in
    every session into a copy of its own: MLA's ``kv_b_proj``, reshaped per head and sliced into its key and value
    halves, is 27 % of a Qwen3 MLA model's weights, copied twice (prefill and decode) into anonymous memory. A
    sliced weight whose whole is no longer read is dropped, so the file holds the same bytes once."""
    import numpy as np
    import onnx_ir as ir

    graph = model.graph
    done = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Reshape", "Slice", "Transpose"):
            continue
        if node.op_type != "Transpose" and len(node.inputs) < 2:
            continue
        data = node.inputs[0]
        t = data.const_value if data is not None and data.is_initializer() else None
        if t is None or t.nbytes < EXTERNAL_MIN_BYTES or node.outputs[0].is_graph_output():
            continue
        consts = [None if v is None or v.const_value is None else v.const_value.numpy().reshape(-1).tolist()
                  for v in node.inputs[1:]]
        if any(c is None for c in consts):
            continue
        arr = t.numpy()
        if node.op_type == "Transpose":
            perm = node.attributes.get("perm")
            view = arr.transpose(perm.as_ints() if perm is not None else None)
        elif node.op_type == "Reshape":
            view = _reshape_view(arr, consts[0], node)
        else:
            view = _slice_view(arr, *consts)
        if view is None or (view.size and not np.shares_memory(view, arr)):  # never a copy
            continue
        kind = {"Reshape": "reshaped", "Slice": "sliced", "Transpose": "transposed"}[node.op_type]
        name = f"{data.name}_{kind}_{done}"
        value = ir.Value(name=name, shape=ir.Shape(view.shape), type=data.type,
                         const_value=ir.Tensor(view, dtype=t.dtype, name=name))
        graph.register_initializer(value)
        node.outputs[0].replace_all_uses_with(value)
        graph.remove(node, safe=True)
        done += 1
    return done


def _reshape_view(arr, dims: list[int], node):
    allowzero = node.attributes.get("allowzero")
    if not (allowzero is not None and allowzero.as_int()):
        dims = [arr.shape[i] if d == 0 else d for i, d in enumerate(dims)]  # 0: copy the input's dimension
    try:
        return arr.reshape(dims)
    except ValueError:
        return None


def _slice_view(arr, starts: list[int], ends: list[int], axes: list[int] | None = None,
                steps: list[int] | None = None):
    """ONNX Slice with positive steps as a NumPy view (its clamping of starts / ends is Python's); None otherwise."""
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not (len(starts) == len(ends) == len(axes) == len(steps)) or any(st < 1 for st in steps):
        return None
    index = [slice(None)] * arr.ndim
    for a, b, e, st in zip(axes, starts, ends, steps, strict=True):
        if not -arr.ndim <= a < arr.ndim:
            return None
        index[a] = slice(int(b), int(e), int(st))
    return arr[tuple(index)]


class SharedWeights:
    """One ``weights.data`` for all graphs of an export: each initializer of at least ``EXTERNAL_MIN_BYTES`` is
    written once (identical bytes, dtype and shape are stored once however many graphs use them, under whatever
    name the exporter gave them) and every graph's tensor points at it by offset.

    :meth:`externalize` works on the exporter's IR before any proto exists: each tensor's bytes are viewed (or,
    for a folded transpose, made contiguous: one tensor at a time), hashed, appended when new, and the
    initializer is replaced by a reference into the file. So an export holds the model's weights once (the
    module's) plus at most one tensor, however large the model."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.path = self.dir / WEIGHTS_FILE
        self.offsets: dict[tuple, tuple[int, int]] = {}
        self.size = 0

    def _append(self, f, data: memoryview, key: tuple) -> tuple[int, int]:
        if key not in self.offsets:
            pad = -self.size % WEIGHT_ALIGN
            f.write(b"\0" * pad)
            self.size += pad
            f.write(data)
            self.offsets[key] = (self.size, data.nbytes)
            self.size += data.nbytes
        return self.offsets[key]

    def externalize(self, model) -> bool:
        """Move every large initializer of the onnx_ir ``model`` (main graph) into the shared file; -> whether
        the graph now uses it."""
        import onnx_ir as ir

        used = False
        with open(self.path, "ab") as f:
            for value in list(model.graph.initializers.values()):
                t = value.const_value
                if t is None or isinstance(t, ir.ExternalTensor) or t.nbytes < EXTERNAL_MIN_BYTES:
                    continue
                data = _tensor_bytes(t)
                key = (hashlib.sha256(data).digest(), int(t.dtype), tuple(t.shape.numpy()))
                offset, length = self._append(f, data, key)
                del data
                value.const_value = ir.ExternalTensor(WEIGHTS_FILE, offset, length, t.dtype, shape=t.shape,
                                                      name=value.name, base_dir=str(self.dir))
                used = True
        if not used and self.size == 0:
            self.path.unlink(missing_ok=True)
        return used

    def save(self, model, path: Path, used: bool = True) -> bool:
        """Write the graph proto ``model`` (weights already external) to ``path`` and check it; -> ``used``."""
        import onnx

        onnx.save_model(model, str(path))
        _check(path)
        return used


def _tensor_bytes(t) -> memoryview:
    """The bytes ONNX stores for the onnx_ir tensor ``t`` (what ``t.tobytes()`` returns), as a view of the tensor's
    memory where it is contiguous: a module parameter is not copied."""
    import numpy as np

    if t.dtype.name in _VIEWABLE and sys.byteorder == "little":
        a = np.ascontiguousarray(t.numpy())
        return memoryview(a.reshape(-1).view(np.uint8))
    return memoryview(t.tobytes())
