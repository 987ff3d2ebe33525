# SPDX-License-Identifier: Apache-2.0
"""``kvexport profile DIR``: profile the converted model and its uncompressed baseline on one backend.

Reads the settings of DIR (convert.json, else the export's manifest), builds one runner for the
converted model and one for the baseline (full cache: ``DIR/baseline`` on onnxruntime/TensorRT, the
original model without a press on PyTorch), profiles both at each context and writes
``DIR/profile-<backend>.json``: profiles of different backends sit side by side. A bare export's manifest
allows no new files inside it, so its profile goes beside it (``EXPORT.profile-<backend>.json``).
Contexts past the model's position range are skipped and listed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from kvexport import layout
from kvexport.atomic import atomic_write_bytes, rebase_paths
from kvexport.cache.memory import CacheShape, cache_table, full_cache_of
from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.errors import BadArtifact, BadUsage
from kvexport.profile.profiler import DEFAULT_REPEATS, MachineLoad, environment, profile_runner
from kvexport.profile.runners import ProfiledDriver

BACKENDS = ("onnxruntime", "tensorrt", "pytorch")
PROFILE_VERSION = 1


def dir_settings(d: Path) -> dict[str, Any]:
    """Settings of a convert directory (convert.json) or of a plain export directory (manifest.json)."""
    conv = layout.read_convert_json(d)
    if conv is not None:
        return dict(conv["settings"])
    man = layout.read_manifest(d)
    if man is None:
        raise BadArtifact(f"{d} has neither convert.json nor an export manifest.json: give a directory made by "
                          "`kvexport convert` or `kvexport export`")
    return settings_from_manifest(man)


def settings_from_manifest(man: dict[str, Any]) -> dict[str, Any]:
    """An export manifest's settings (``kvexport export``) in convert.json's vocabulary."""
    ms = dict(man.get("settings") or {})
    press = ms.get("press") or None
    params = (press or {}).get("params") or {}
    mla = ms.get("mla") or None
    return {
        "model": ms.get("source"),
        "press": press["name"] if press else "none",
        "budget": params.get("budget") if press else None,
        "window": ms.get("window") if press else None,
        "chunk": ms.get("chunk"),
        "fp16": ms.get("dtype") == "fp16",
        "mla_ranks": list(mla["kv_ranks"]) if mla else None,
        "rope_dim": mla.get("rope_dim") if mla else None,
        "plain_export": True,
    }


def model_spec(model_path: str | Path):
    """ModelSpec of an HF model directory or an MLA directory, from its config only."""
    from kvexport.mla.io import is_mla_dir, read_mla_config
    from kvexport.models.spec import ModelSpec

    p = Path(model_path)
    if is_mla_dir(p):
        return ModelSpec(**read_mla_config(p)["spec"])
    from transformers import AutoConfig

    try:
        return ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(p)))
    except OSError as e:
        raise BadArtifact(f"the model {p} this directory was made from cannot be read: {str(e)[:160]}") from None


def cache_shape_of(d: Path, settings: dict[str, Any], spec) -> CacheShape:
    """The converted cache: MLA ranks from DIR/mla (or the settings), press budget + window, dtype."""
    from kvexport.mla.io import is_mla_dir, read_mla_config

    ranks = None
    rope = 0
    mla_dir = Path(d) / layout.MLA_DIR
    if is_mla_dir(mla_dir):
        cfg = read_mla_config(mla_dir)
        ranks = tuple(int(layer["kv_rank"]) for layer in cfg["layers"])
        rope = 2 * len(cfg["layers"][0].get("rope_pairs", [])) or int(cfg["settings"].get("rope_dim", 0))
    elif settings.get("mla_ranks"):
        ranks = tuple(int(r) for r in settings["mla_ranks"])
        rope = int(settings.get("rope_dim") or 0)
    elif settings.get("mla_rank"):
        ranks = (int(settings["mla_rank"]),) * spec.num_layers
        rope = int(settings.get("rope_dim") or 0)
    press = settings.get("press")
    budget = int(settings["budget"]) if press not in (None, "none") and settings.get("budget") else None
    window = int(settings.get("window") or 0) if budget else 0
    capacity = None
    man = layout.read_manifest(layout.export_dir_of(d))
    if budget is None and man is not None:
        ms = man.get("settings") or {}
        if ms.get("mode") == "static" and ms.get("capacities"):
            capacity = int(max(ms["capacities"]))
    kv_dtype = settings.get("kv_dtype")
    if man is not None and (man.get("settings") or {}).get("kv_dtype"):
        kv_dtype = man["settings"]["kv_dtype"]  # what the export stores (the convert setting, resolved)
    return CacheShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, ranks, rope, budget, window,
                      2 if settings.get("fp16") else 4, capacity, kv_dtype=kv_dtype)


def _pytorch_runners(d: Path, settings: dict[str, Any], shape: CacheShape, with_baseline: bool):
    """-> {variant: () -> runner}: each model is loaded only when its variant is profiled."""
    from kvexport.mla.io import is_mla_dir, load_decoder, load_mla
    from kvexport.presses import make_press
    from kvexport.runtime.torch_driver import TorchDriver

    model = settings.get("model")
    if not model:
        raise BadArtifact(f"{d}: the settings do not name the source model")
    dtype = "fp16" if settings.get("fp16") else "fp32"
    chunk = int(settings.get("chunk") or 512)
    press = None
    if settings.get("press") not in (None, "none"):
        press = make_press(settings["press"], budget=int(settings["budget"]))
    mla_dir = d / layout.MLA_DIR
    weights = sorted(Path(model).glob("*.safetensors"))
    window = int(settings.get("window") or DEFAULT_WINDOW)

    def converted():
        if is_mla_dir(mla_dir):
            dec, files = load_mla(mla_dir, dtype), sorted(mla_dir.glob("*.safetensors"))
        else:
            dec, files = load_decoder(model, dtype)[0], weights
        return ProfiledDriver(TorchDriver(dec, press, window, chunk), "pytorch", files, shape)

    runners = {"converted": converted}
    if with_baseline:
        runners["baseline"] = lambda: ProfiledDriver(TorchDriver(load_decoder(model, dtype)[0], None, chunk=chunk),
                                                     "pytorch", weights, full_cache_of(shape))
    return runners


def _onnx_runners(d: Path, shape: CacheShape, with_baseline: bool, backend: str):
    """-> {variant: () -> runner}: each export's sessions are made only when its variant is profiled."""
    exp = layout.export_dir_of(d)
    base = d / layout.BASELINE_DIR
    man = layout.read_manifest(exp)
    if shape.budget is not None and man is not None and (man.get("settings") or {}).get("read_buckets"):
        # the graph host holds a short sequence's cache in its read bucket (kvexport.cache.plan rule 7b)
        shape = dataclasses.replace(shape, read_buckets=True)
    if backend == "tensorrt":
        engines = d / layout.ENGINE_DIR if (d / layout.ENGINE_DIR).is_dir() else None

        def trt():
            from kvexport.tensorrt.generator import TrtGenerator

            gen = TrtGenerator(exp, engines=engines)
            files = sorted(p for p in gen.engine_dir.rglob("*") if p.is_file() and p.suffix in (".engine", ".plan"))
            return ProfiledDriver(gen, "tensorrt", files, shape, name=str(exp))

        # the growing-past baseline has no static shapes to build engines for, and timing it on another backend
        # would not be a comparison: profile it with --backend onnxruntime
        return {"converted": trt}

    def ort(directory: Path, cache_shape: CacheShape):
        from kvexport.runtime.onnxruntime import open_onnxruntime

        files = sorted(p for p in directory.rglob("*") if p.is_file() and (p.suffix == ".onnx" or
                                                                           p.name.endswith(".data")))
        return ProfiledDriver(open_onnxruntime(directory), "onnxruntime", files, cache_shape, name=str(directory))

    runners = {"converted": lambda: ort(exp, shape)}
    if with_baseline and base.is_dir():
        runners["baseline"] = lambda: ort(base, full_cache_of(shape))
    return runners


def profile_target(d: str | Path, backend: str = "onnxruntime") -> Path:
    """Where ``kvexport profile d --backend B`` writes by default: ``DIR/profile-B.json`` for a conversion (or an
    export whose manifest allows that file), else beside the export: ``EXPORT.profile-B.json``."""
    d = Path(d)
    name = layout.profile_name(backend)
    if layout.read_convert_json(d) is not None:
        return d / name
    man = layout.read_manifest(d)
    if man is not None and name not in (man.get("reports") or []):
        return d.parent / f"{d.name}.{name}"
    return d / name


def profile_dir(d: str | Path, backend: str = "onnxruntime", contexts: list[int] | None = None,
                decode_steps: int = 32, baseline: bool = True, seed: int = 0, write: bool | str | Path = True,
                shown_as: str | Path | None = None,
                repeats: int = DEFAULT_REPEATS, progress=None) -> dict[str, Any]:
    """Profile DIR (see the module docstring); -> the profile dictionary. ``write``: True = the backend's default
    file (:func:`profile_target`), a path = there, False = nowhere. ``repeats``: timed runs per context.
    ``progress(message)``: called at each variant and run ("baseline: context 2048, run 2/3")."""
    d = Path(d)
    if backend not in BACKENDS:
        raise BadUsage(f"--backend {backend!r} is not one of: {', '.join(BACKENDS)}")
    if decode_steps < 1:
        raise BadUsage(f"--decode-steps {decode_steps} must be >= 1")
    if repeats < 1:
        raise BadUsage(f"--repeats {repeats} must be >= 1")
    if not d.is_dir():
        raise BadArtifact(f"{d} is not a directory made by kvexport convert or kvexport export")
    if layout.is_conversion(d):
        layout.verify_conversion(d, (layout.profile_name(backend), *layout.REPORT_OUTPUTS))
    settings = dir_settings(d)
    if settings.get("model"):  # a .gguf source: the HF directory kvexport made of it (its config and weight files)
        from kvexport.models.gguf import model_dir

        settings["model"] = str(model_dir(settings["model"]))
    contexts = sorted(set(contexts or settings.get("contexts") or [512, 2048, 8192]))
    mla_dir = d / layout.MLA_DIR
    if (mla_dir / "kvexport_mla.json").is_file():
        spec = model_spec(mla_dir)
    elif settings.get("plain_export"):
        from kvexport.models.spec import ModelSpec

        spec = ModelSpec(**layout.read_manifest(d)["settings"]["spec"])
    else:
        spec = model_spec(settings["model"])
    max_pos = int(spec.max_position_embeddings)
    keep = [c for c in contexts if c + decode_steps <= max_pos]
    skipped = [{"context": c, "reason": f"past the model's {max_pos} positions"} for c in contexts if c not in keep]
    if not keep:
        raise BadUsage(f"every context in {contexts} (+{decode_steps} decode steps) is past the model's "
                       f"{max_pos} positions")
    shape = cache_shape_of(d, settings, spec)
    if backend == "pytorch" and settings.get("plain_export") and settings.get("mla_ranks"):
        raise BadUsage(f"{d} is a bare MLA export: profile the PyTorch path on the `kvexport convert` directory "
                       "that holds its mla/ model")
    from kvexport.models.release import free_memory

    if backend == "pytorch":
        runners = _pytorch_runners(d, settings, shape, baseline)
    else:
        runners = _onnx_runners(d, shape, baseline, backend)
    t0 = time.perf_counter()
    variants = {}
    with MachineLoad() as load:
        for name, make in runners.items():
            # one variant in memory at a time: each holds a whole model (its weights, its sessions or modules)
            runner = make()
            step = None if progress is None else (lambda m, name=name: progress(f"{name}: {m}"))
            variants[name] = profile_runner(runner, keep, decode_steps, spec.vocab_size, seed, repeats=repeats,
                                            on_step=step)
            runner.close()
            runner = None
            free_memory()
    result = {
        "version": PROFILE_VERSION,
        "backend": backend,
        "decode_steps": decode_steps,
        "repeats": repeats,
        "contexts": keep,
        "skipped_contexts": skipped,
        "cache": cache_table(shape, keep),
        "variants": variants,
        "environment": environment(),
        "machine_load": load.to_dict(),
        "seconds": time.perf_counter() - t0,
    }
    if write:
        target = profile_target(d, backend) if write is True else Path(write)
        # a conversion profiled before it is renamed into place names its final directory, not the temporary one
        result = rebase_paths(result, d, shown_as)
        atomic_write_bytes(target, json.dumps(result, indent=2).encode("utf-8"))
        if target.parent.resolve() == d.resolve() and layout.has_outputs_manifest(d):
            layout.record_outputs(d)
    return result


__all__ = ["profile_dir", "profile_target", "dir_settings", "cache_shape_of", "model_spec", "BACKENDS"]
