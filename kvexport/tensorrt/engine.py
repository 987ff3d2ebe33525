# SPDX-License-Identifier: Apache-2.0
"""Building TensorRT engines from kvexport's ONNX graphs (TensorRT Python API, static shapes; a bucketed full
cache's capacity axis gets one optimization profile, smallest bucket to capacity)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvexport.errors import BadArtifact, BadUsage, MissingBackend
from kvexport.tensorrt.backend import import_tensorrt, parse_version
from kvexport.tensorrt.onnx_prep import prepare_onnx_for_trt
from kvexport.tensorrt.plugins import load_plugins


@dataclass
class EngineReport:
    """One built engine."""

    onnx: str
    engine: str
    tensorrt: str
    fp16: bool
    plugin_nodes: dict[str, int] = field(default_factory=dict)
    stripped_functions: list[str] = field(default_factory=list)
    pinned_fp32_layers: int = 0  # layers computing only TopKGather scores, kept in FP32 under --fp16
    seconds: float = 0.0
    bytes: int = 0

    def to_json(self) -> dict:
        return asdict(self)


class _Logger:
    """A TensorRT logger that keeps the errors for one-line messages."""

    def __init__(self, trt):
        class L(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.errors: list[str] = []

            def log(self, severity, msg):
                if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                    self.errors.append(msg)

        self.logger = L()


def topk_score_tensors(onnx_path: str | Path) -> set[str]:
    """Names of the tensors feeding TopKGather's ``scores`` input (graph only; weights are not loaded)."""
    import onnx

    from kvexport.tensorrt.onnx_prep import KVEXPORT_DOMAIN

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {n.input[0] for n in model.graph.node if n.domain == KVEXPORT_DOMAIN and n.op_type == "TopKGather"}


def pin_scores_fp32(network, score_tensors: set[str], trt) -> int:
    """Keep in FP32 the layers whose results only serve TopKGather's scores (the plugin takes FP32 scores only, and
    FP16 scores could change which slots are kept). Starting at the producers of ``score_tensors``, a layer joins
    when every consumer of every output is already in the set and none is a network output; activations shared with
    the rest of the model keep the builder's choice. Returns the number of layers pinned."""
    layers = [network.get_layer(i) for i in range(getattr(network, "num_layers", 0))]
    if not layers or not score_tensors:
        return 0
    producer, consumers = {}, {}
    for layer in layers:
        for j in range(layer.num_outputs):
            producer[layer.get_output(j).name] = layer
        for j in range(layer.num_inputs):
            t = layer.get_input(j)
            if t is not None:
                consumers.setdefault(t.name, []).append(layer)
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    floats = {trt.float32, trt.float16, getattr(trt, "bfloat16", trt.float16)}
    cone = [producer[t] for t in score_tensors if t in producer]
    inside = {id(layer) for layer in cone}

    def exclusive(layer) -> bool:
        for j in range(layer.num_outputs):
            o = layer.get_output(j)
            if o.name in outputs or any(id(c) not in inside for c in consumers.get(o.name, [])):
                return False
        return True

    grew = True
    while grew:  # to a fixpoint: a layer may qualify only once all its consumers have joined
        grew = False
        for layer in list(cone):
            for j in range(layer.num_inputs):
                t = layer.get_input(j)
                p = producer.get(t.name) if t is not None else None
                if p is not None and id(p) not in inside and exclusive(p):
                    cone.append(p)
                    inside.add(id(p))
                    grew = True
    pinned = 0
    for layer in cone:
        float_outs = [j for j in range(layer.num_outputs) if layer.get_output(j).dtype in floats]
        if float_outs:
            layer.precision = trt.float32
            for j in float_outs:
                layer.set_output_type(j, trt.float32)
            pinned += 1
    return pinned


def capacity_range(onnx_path: Path) -> tuple[int, int] | None:
    """(smallest bucket, capacity) of a bucketed full-cache export's graph, or of a reading graph of an export read
    in buckets (plan rules 7 and 7b; the manifest beside it), else None."""
    from kvexport.cache.plan import bucket_slots

    man = onnx_path.parent / "manifest.json"
    s = json.loads(man.read_text()).get("settings", {}) if man.is_file() else {}
    reads = onnx_path.name in {(s.get("graphs", {}).get(g) or {}).get("file") for g in s.get("read_buckets") or ()}
    if not (s.get("dynamic_capacity") or reads):
        return None
    cap = int(min(s["capacities"]))
    return bucket_slots(1, cap), cap


def column_range(onnx_path: Path) -> tuple[int, int] | None:
    """(2, chunk) for the graph a prompt's last chunk runs at its real width (plan rule 2b; the manifest beside it),
    else None."""
    man = onnx_path.parent / "manifest.json"
    s = json.loads(man.read_text()).get("settings", {}) if man.is_file() else {}
    g = s.get("graphs", {}).get(s.get("ragged_last") or "")
    return (2, int(s["chunk"])) if g and onnx_path.name == g.get("file") else None


def capacity_profile(builder, config, onnx_path: Path, dynamic: dict[str, tuple]) -> None:
    """One optimization profile for a graph's dynamic axes: axis 2 of every cache input from the smallest bucket to
    the capacity (a full cache's graphs, an evicting cache's reads), axis 1 of the ids and positions from 2 columns to
    the chunk (a ragged last chunk); opt: the largest. Any other dynamic input is refused with one line."""
    caps, cols = capacity_range(onnx_path), column_range(onnx_path)
    shapes = {}
    for name, shape in dynamic.items():
        dyn = [k for k, d in enumerate(shape) if d < 0]
        rng = cols if name in ("input_ids", "positions") and dyn == [1] else caps if dyn == [2] else None
        if rng is None:
            raise BadArtifact(f"{onnx_path.name} input {name} has a dynamic shape {shape}; kvexport engines need "
                              "the static shapes `kvexport export` writes (or a cache's capacity axis, or the last "
                              "chunk's columns)")
        shapes[name] = tuple(tuple(n if k == dyn[0] else d for k, d in enumerate(shape)) for n in rng)
    profile = builder.create_optimization_profile()
    for name, (lo, hi) in shapes.items():
        profile.set_shape(name, lo, hi, hi)
    config.add_optimization_profile(profile)


def _require_gpu(trt, logger) -> object:
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # noqa: BLE001 - no driver / no device
        raise MissingBackend(
            f"TensorRT found no usable NVIDIA GPU ({e}); engines are built on the GPU that runs "
            "them (or the same model of GPU)"
        ) from None
    if builder is None:
        raise MissingBackend("TensorRT could not create a builder: no usable NVIDIA GPU or driver on this machine")
    return builder


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    plugins: str | Path | None = None,
    fp16: bool = False,
    workspace_gib: float | None = None,
) -> EngineReport:
    """ONNX (static shapes, kvexport custom ops) -> serialized TensorRT engine at ``engine_path``.

    Loads the plugin library, prepares the ONNX for the installed TensorRT's parser
    (:func:`prepare_onnx_for_trt`), parses it, builds with FP16 enabled when ``fp16`` (weakly typed networks;
    the graph's own types win for strongly typed ones) and saves the plan.
    """
    trt = import_tensorrt()
    load_plugins(plugins)
    version = trt.__version__
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    prepared_path = onnx_path.with_name(
        onnx_path.stem + f".trt{parse_version(version)[0]}{parse_version(version)[1]}.onnx"
    )
    prep = prepare_onnx_for_trt(onnx_path, prepared_path, version)
    t0 = time.perf_counter()
    log = _Logger(trt).logger
    try:
        builder = _require_gpu(trt, log)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, log)
        flag = getattr(getattr(trt, "OnnxParserFlag", None), "ENABLE_PLUGIN_OVERRIDE", None)
        if flag is not None:  # TensorRT >= 10.16: plugins also override ops without plugin_namespace
            parser.set_flag(flag)
        if not parser.parse_from_file(str(prepared_path)):
            errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise BadArtifact(f"TensorRT {version} could not parse {onnx_path.name}: {errs[0] if errs else log.errors}")
        config = builder.create_builder_config()
        dynamic = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)
                   if any(d < 0 for d in network.get_input(i).shape)}
        if dynamic:
            capacity_profile(builder, config, onnx_path, dynamic)
        pinned = 0
        if fp16:
            flag16 = getattr(trt.BuilderFlag, "FP16", None)
            if flag16 is None:  # TensorRT 11: strongly typed networks only
                raise BadUsage(
                    f"TensorRT {version} builds strongly typed networks and has no FP16 flag; export the "
                    "graphs in FP16 instead of passing --fp16"
                )
            config.set_flag(flag16)
            pinned = pin_scores_fp32(network, topk_score_tensors(prepared_path), trt)
            prefer = getattr(trt.BuilderFlag, "PREFER_PRECISION_CONSTRAINTS", None)
            if pinned and prefer is not None:
                config.set_flag(prefer)
        if workspace_gib is not None:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise BadArtifact(
                f"TensorRT {version} failed to build {onnx_path.name}: "
                f"{log.errors[-1] if log.errors else 'no error message'}"
            )
        engine_path.parent.mkdir(parents=True, exist_ok=True)
        engine_path.write_bytes(bytes(plan))
    finally:
        prepared_path.unlink(missing_ok=True)
    return EngineReport(
        onnx=str(onnx_path),
        engine=str(engine_path),
        tensorrt=version,
        fp16=fp16,
        plugin_nodes=prep.plugin_nodes,
        stripped_functions=prep.stripped_functions,
        pinned_fp32_layers=pinned,
        seconds=time.perf_counter() - t0,
        bytes=engine_path.stat().st_size,
    )


def find_onnx_graphs(export_dir: str | Path) -> list[Path]:
    """Every ``*.onnx`` graph of an exported directory (top level first, else any depth), sorted by name.

    Files ending in ``.trt*.onnx`` (our own temporary parser copies) and onnxruntime-only graphs
    (:data:`kvexport.manifest.ORT_ONLY_SUFFIX`: the in-place decode step) are ignored.
    """
    from kvexport.manifest import ORT_ONLY_SUFFIX

    d = Path(export_dir)

    def ours(p: Path) -> bool:
        return ".trt" not in p.name and not p.name.endswith(ORT_ONLY_SUFFIX)

    found = sorted(p for p in d.glob("*.onnx") if ours(p))
    if not found:
        found = sorted(p for p in d.rglob("*.onnx") if ours(p))
    return found


def write_build_record(out_dir: Path, reports: list[EngineReport]) -> Path:
    path = out_dir / "engines.json"
    path.write_text(json.dumps([r.to_json() for r in reports], indent=2) + "\n")
    return path
