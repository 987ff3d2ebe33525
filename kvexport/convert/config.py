# SPDX-License-Identifier: Apache-2.0
"""Settings of one ``kvexport convert`` run: read from flags and/or a YAML/JSON file, checked, saved.

Rules (checked before any work, each refusal is a :class:`~kvexport.errors.BadUsage` naming the
reason):

- Compression: when no compression setting is given at all (no press, budget, window, neighbours, lookahead,
  MLA rank or energy), the defaults chosen on SmolLM2-135M-Instruct by the real-model sweep apply (docs/sweep.md):
  SnapKV with a lookahead of 64 columns and 3 neighbours, budget 2048 (a quarter of the model's positions when
  that is less), window 32, prefill chunk 512, an int8 cache (unless ``--kv-dtype`` says otherwise), no MLA
  (undistilled MLA loses a real model: docs/sweep.md). As soon as one compression setting is given, only what is
  given is applied (``--press snapkv --budget 256`` = kvpress's SnapKV, no neighbours or lookahead, the model's
  cache dtype; ``--mla-rank 64`` = MLA only), with one exception: ``--budget`` / ``--window`` without ``--press``
  (and without ``--neighbors`` / ``--lookahead``) size the default press, neighbours and lookahead included, with
  the int8 cache unless ``--kv-dtype`` or MLA is given (``--budget 512`` = the default conversion at 512).
- ``--press none`` keeps every token (no eviction); ``--budget``/``--window`` then make no sense.
- ``--mla-rank`` and ``--mla-energy`` exclude each other; ``--rope-dim`` needs one of them.
- Distillation needs a teacher, data and MLA (it repairs the MLA rewrite).
- ``--allow-partial`` only means something with ``--target tensorrt``.
- ``--kv-dtype`` is one of kvexport.cache.formats' names (fp32, fp16, bf16, int8, fp8).
- ``--weights`` is fp32, fp16, int4, int4-a8 or int4-qdq (kvexport.quant), and only for an fp32 export (not with ``--fp16``).

The resolved settings are saved as ``DIR/convert.json``; ``--config DIR/convert.json`` reads them
back, so ``kvexport convert --config A/convert.json --out B`` redoes the conversion of A.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvexport.cache.plan import DEFAULT_WINDOW
from kvexport.errors import BadUsage

TARGETS = ("onnx", "tensorrt")
BACKENDS = ("onnxruntime", "tensorrt", "pytorch")
DEFAULT_PRESS = "snapkv"
#: the default budget: 2048 tokens per layer, or a quarter of the model's positions when that is less
DEFAULT_BUDGET = 2048
DEFAULT_CHUNK = 512
#: the defaults' cache format, lookahead (kvexport.cache.plan rule 3b) and neighbours (ScorerPress.neighbors)
DEFAULT_KV_DTYPE = "int8"
DEFAULT_LOOKAHEAD = 64
DEFAULT_NEIGHBORS = 3
#: default profile contexts; contexts past the model's position range are dropped at run time
DEFAULT_CONTEXTS = (512, 2048, 8192)
#: a conversion's export also decodes this many sequences in one call (decode_batch.onnx): what `kvexport serve`
#: batches its slots with (docs/serve.md)
DEFAULT_DECODE_BATCH = 16
DEFAULT_DECODE_STEPS = 32
#: timed runs per profile context (the report shows their p10-p90 spread)
DEFAULT_REPEATS = 3
#: per-token cache compression the default MLA rank aims at: about 2x keeps the model without distillation
#: (docs/studies.md: 1.9x undistilled scores 0.179 of the original's 0.180, span recall equal; 3.6x 0.123)
DEFAULT_MLA_TARGET_RATIO = 2.0

#: settings that count as "the user chose a compression"
_COMPRESSION_KEYS = ("press", "budget", "window", "neighbors", "lookahead", "mla_rank", "mla_energy", "rope_dim")


@dataclass
class ConvertConfig:
    """Every setting of a conversion. ``None`` = not given (defaults are filled by :meth:`resolve`)."""

    model: str | None = None
    mla_rank: int | None = None
    mla_energy: float | None = None
    rope_dim: int | None = None
    press: str | None = None
    budget: int | None = None
    window: int | None = None
    #: a kept token keeps r neighbours on each side (ScorerPress.neighbors); None: 0, or the default's 3
    neighbors: int | None = None
    #: the prompt's last L columns observe every earlier prefill chunk (kvexport.cache.plan rule 3b); None: 0, or
    #: the default's 64 for a press that observes
    lookahead: int | None = None
    chunk: int | None = None
    #: capacity of a static full cache (no press): the longest context the export takes (default: the model's)
    max_positions: int | None = None
    #: rows of the export's decode_batch graph (the server's slots decoded in one call); 0: none
    decode_batch: int = DEFAULT_DECODE_BATCH
    distill_teacher: str | None = None
    distill_data: str | None = None
    distill_tokens: int | None = None
    #: Adam steps per layer of the layer-wise MLA refit (kvexport.mla.refit); None / 0: no refit
    refit_steps: int | None = None
    target: str = "onnx"
    fp16: bool = False
    #: how the exported cache stores K/V (or the MLA latent): fp32, fp16, bf16, int8, fp8 (docs/quantized.md);
    #: None = the export's dtype
    kv_dtype: str | None = None
    #: how DIR/onnx stores the model's MatMul weights: fp32, fp16, int4, int4-a8, int4-qdq (kvexport.quant, docs/quantized.md);
    #: None = as traced (fp32). The baseline keeps the model's weights.
    weights: str | None = None
    validate: bool = True
    profile: bool = True
    baseline: bool = True
    allow_partial: bool = False
    contexts: list[int] = field(default_factory=lambda: list(DEFAULT_CONTEXTS))
    decode_steps: int = DEFAULT_DECODE_STEPS
    #: decode steps per prompt in the parity check (kvexport validate's default is 64)
    validate_steps: int = 64
    #: timed runs per profile context
    repeats: int = DEFAULT_REPEATS
    #: the fidelity check of validate (converted vs the original model): on/off, held-out text (a UTF-8 file
    #: or bundled:NAME; None = the validator's default) and the gates that fail the validate stage
    fidelity: bool = True
    eval_data: str | None = None
    min_agreement: float | None = None
    max_ppl_increase: float | None = None
    #: --choose: pick press, budget, cache format and MLA rank by measured fidelity (kvexport.convert.choose), with these
    #: targets (the agreement / perplexity ones above, and passkey recall as a fraction of the original's)
    choose: bool = False
    min_recall: float | None = None
    #: the context (tokens) --choose measures at; None: 4096, or half the model's positions when that is less
    choose_context: int | None = None
    seed: int = 0
    #: filled by resolve(): True when the showcase defaults were applied
    showcase_defaults: bool = False

    # ------------------------------------------------------------------ building
    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "config") -> "ConvertConfig":
        """A dict (flat, or convert.json's ``{"settings": {...}}``) -> config. Unknown keys are refused."""
        if not isinstance(data, dict):
            raise BadUsage(f"{source} must be a mapping of setting names to values")
        if "settings" in data and isinstance(data["settings"], dict):
            data = data["settings"]
        data = {str(k).replace("-", "_"): v for k, v in data.items()}
        data.pop("out", None)  # the output directory always comes from --out
        unknown = sorted(set(data) - set(cls.keys()))
        if unknown:
            raise BadUsage(f"{source}: unknown setting(s) {', '.join(unknown)}; accepted: {', '.join(cls.keys())}")
        cfg = cls()
        for k, v in data.items():
            setattr(cfg, k, v)
        cfg._coerce(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ConvertConfig":
        """Read a ``.json``, ``.yaml`` or ``.yml`` file."""
        p = Path(path)
        if not p.is_file():
            raise BadUsage(f"config file {p} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise BadUsage(f"config file {p} is not UTF-8 text") from None
        try:
            if p.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as e:  # noqa: BLE001 - JSON or YAML syntax error
            raise BadUsage(f"config file {p} cannot be parsed: {str(e).splitlines()[0][:160]}") from None
        if data is None:
            data = {}
        return cls.from_mapping(data, source=f"config file {p}")

    def merged(self, overrides: dict[str, Any]) -> "ConvertConfig":
        """A copy with the non-None ``overrides`` (CLI flags given explicitly) applied on top."""
        d = asdict(self)
        d.update({k: v for k, v in overrides.items() if v is not None})
        return ConvertConfig.from_mapping(d, source="options")

    def _coerce(self, source: str) -> None:
        def as_int(name):
            v = getattr(self, name)
            if v is None:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise BadUsage(f"{source}: {name} must be an integer, got {v!r}")
            try:
                iv = int(v)
            except ValueError:
                raise BadUsage(f"{source}: {name} must be an integer, got {v!r}") from None
            if isinstance(v, float) and iv != v:
                raise BadUsage(f"{source}: {name} must be an integer, got {v!r}")
            setattr(self, name, iv)

        for name in ("mla_rank", "rope_dim", "budget", "window", "neighbors", "lookahead", "chunk", "max_positions",
                     "choose_context", "decode_batch", "distill_tokens", "refit_steps",
                     "decode_steps", "validate_steps", "repeats", "seed"):
            as_int(name)
        for name in ("min_agreement", "max_ppl_increase", "min_recall"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool):
                raise BadUsage(f"{source}: {name} must be a number, got {v!r}")
            try:
                setattr(self, name, float(v))
            except (TypeError, ValueError):
                raise BadUsage(f"{source}: {name} must be a number, got {v!r}") from None
        if self.mla_energy is not None:
            try:
                self.mla_energy = float(self.mla_energy)
            except (TypeError, ValueError):
                raise BadUsage(f"{source}: mla_energy must be a number in (0, 1], got {self.mla_energy!r}") from None
        for name in ("fp16", "validate", "profile", "baseline", "allow_partial", "showcase_defaults", "fidelity",
                     "choose"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise BadUsage(f"{source}: {name} must be true or false, got {v!r}")
        self.contexts = parse_contexts(self.contexts, source)
        for name in ("model", "press", "distill_teacher", "distill_data", "target", "eval_data", "kv_dtype",
                     "weights"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                setattr(self, name, str(v))

    # ------------------------------------------------------------------ checking
    @property
    def uses_mla(self) -> bool:
        return self.mla_rank is not None or self.mla_energy is not None

    @property
    def uses_press(self) -> bool:
        return self.press not in (None, "none")

    @property
    def distills(self) -> bool:
        return self.distill_teacher is not None

    def check(self) -> None:
        """Refuse combinations and values that make no sense, before any work starts."""
        if self.choose:
            given = [k for k in _COMPRESSION_KEYS + ("kv_dtype",) if getattr(self, k) is not None]
            if given:
                raise BadUsage(f"--choose picks the press, budget, cache format and MLA rank itself; drop "
                               f"{', '.join('--' + k.replace('_', '-') for k in given)}")
            if not self.fidelity:
                raise BadUsage("--choose measures fidelity; drop --no-fidelity")
        elif self.min_recall is not None or self.choose_context is not None:
            raise BadUsage("--min-recall and --choose-context are settings of --choose; add --choose")
        if self.choose_context is not None and self.choose_context < 64:
            raise BadUsage(f"--choose-context {self.choose_context} must be >= 64 tokens")
        if self.mla_rank is not None and self.mla_energy is not None:
            raise BadUsage("--mla-rank and --mla-energy exclude each other: give a fixed rank or an energy "
                           "threshold, not both")
        if self.mla_rank is not None and self.mla_rank < 1:
            raise BadUsage(f"--mla-rank {self.mla_rank} must be >= 1")
        if self.mla_energy is not None and not (0.0 < self.mla_energy <= 1.0):
            raise BadUsage(f"--mla-energy {self.mla_energy} must be in (0, 1] (e.g. 0.95)")
        if self.rope_dim is not None and not self.uses_mla:
            raise BadUsage("--rope-dim only applies to the MLA rewrite: add --mla-rank R or --mla-energy δ")
        if self.rope_dim is not None and (self.rope_dim < 2 or self.rope_dim % 2):
            raise BadUsage(f"--rope-dim {self.rope_dim} must be a positive even number")
        if self.press is not None:
            from kvexport.presses import PRESSES

            if self.press != "none" and self.press not in PRESSES:
                raise BadUsage(f"unknown press {self.press!r}; accepted: none, {', '.join(PRESSES)}")
        if not self.uses_press:
            for name in ("neighbors", "lookahead"):
                if getattr(self, name):
                    raise BadUsage(f"--{name} refines an eviction press (--press P); without one every token is kept")
            # without --press, --budget / --window size the default press (resolve); --press none keeps every token
            if self.press == "none" or self.neighbors is not None or self.lookahead is not None:
                if self.budget is not None:
                    raise BadUsage("--budget needs an eviction press (--press P); without one every token is kept")
                if self.window is not None:
                    raise BadUsage("--window needs an eviction press (--press P); it sizes the decode slots "
                                   "between compactions")
        if self.neighbors is not None and self.neighbors < 0:
            raise BadUsage(f"--neighbors {self.neighbors} must be >= 0 (0: kvpress's scoring)")
        if self.lookahead is not None and self.lookahead < 0:
            raise BadUsage(f"--lookahead {self.lookahead} must be >= 0 (0: each chunk observes itself)")
        if self.lookahead and self.press not in (None, "none"):
            from kvexport.presses import PRESSES

            if self.press in PRESSES and not PRESSES[self.press].observes:
                raise BadUsage(f"--lookahead: {self.press} scores without observation queries, so a lookahead tail "
                               "changes nothing; drop --lookahead or choose a press that observes (snapkv, tova, ...)")
        if self.min_recall is not None and not 0 <= self.min_recall <= 1:
            raise BadUsage(f"--min-recall {self.min_recall} must be in [0, 1] (a fraction of the original's recall)")
        if self.budget is not None and self.budget < 1:
            raise BadUsage(f"--budget {self.budget} must be >= 1 token")
        if self.window is not None and self.window < 1:
            raise BadUsage(f"--window {self.window} must be >= 1 token")
        if self.chunk is not None and self.chunk < 1:
            raise BadUsage(f"--chunk {self.chunk} must be >= 1 token")
        if self.decode_batch is None or self.decode_batch < 0:
            raise BadUsage(f"--decode-batch {self.decode_batch} must be >= 0 (0: no batched decode graph)")
        if self.max_positions is not None and self.max_positions < 1:
            raise BadUsage(f"--max-positions {self.max_positions} must be >= 1 token")
        if self.refit_steps is not None:
            if self.refit_steps < 0:
                raise BadUsage(f"--refit-steps {self.refit_steps} must be >= 0 (0: no refit)")
            if self.refit_steps and not self.uses_mla:
                raise BadUsage("--refit-steps repairs the MLA rewrite: add --mla-rank R or --mla-energy δ")
        if self.distill_teacher is None and (self.distill_data is not None or self.distill_tokens is not None):
            raise BadUsage("--distill-data/--distill-tokens need a teacher: add --distill-teacher MODEL")
        if self.distill_teacher is not None:
            if not self.uses_mla:
                raise BadUsage("distillation repairs the MLA rewrite: add --mla-rank R or --mla-energy δ "
                               "(eviction alone has no weights to train)")
            if self.distill_data is None:
                raise BadUsage("--distill-teacher needs --distill-data PATH (a UTF-8 text file)")
            if not Path(self.distill_data).is_file():
                raise BadUsage(f"distillation data {self.distill_data} does not exist")
            if self.distill_tokens is not None and self.distill_tokens < 1:
                raise BadUsage(f"--distill-tokens {self.distill_tokens} must be >= 1")
        if self.kv_dtype is not None:
            from kvexport.cache.formats import kv_format

            kv_format(self.kv_dtype)  # one line for an unknown name (kvexport.cache.formats' own message)
        if self.weights is not None:
            from kvexport.quant.weights import check_weights

            check_weights(self.weights, "fp16" if self.fp16 else "fp32")  # one line: an unknown name, or with --fp16
            if self.weights in ("int4", "int4-a8") and self.target == "tensorrt":
                raise BadUsage(f"--weights {self.weights} is onnxruntime's MatMulNBits, which TensorRT does not take; use "
                               "--weights int4-qdq (INT4 DequantizeLinear) with --target tensorrt")
        if self.target not in TARGETS:
            raise BadUsage(f"--target {self.target!r} is not one of: {', '.join(TARGETS)}")
        if self.allow_partial and self.target != "tensorrt":
            raise BadUsage("--allow-partial only applies to --target tensorrt (it keeps the ONNX result when "
                           "TensorRT is missing)")
        if self.decode_steps < 1:
            raise BadUsage(f"--decode-steps {self.decode_steps} must be >= 1")
        if self.validate_steps < 1:
            raise BadUsage(f"--validate-steps {self.validate_steps} must be >= 1")
        if self.repeats < 1:
            raise BadUsage(f"--repeats {self.repeats} must be >= 1")
        kw = fidelity_kwargs(self.eval_data, self.min_agreement, self.max_ppl_increase, self.fidelity)
        if set(kw) - {"fidelity"} and not self.validate and not (self.choose and "eval_data" not in kw):
            raise BadUsage("--eval-data/--min-agreement/--max-ppl-increase are checked by the validate stage; "
                           "drop --no-validate")
        if self.model is not None and not Path(self.model).exists():
            from kvexport.models.gguf import is_gguf

            what = "GGUF file" if is_gguf(self.model) else "model directory"
            raise BadUsage(f"{what} {self.model} does not exist")

    def resolve(self) -> "ConvertConfig":
        """Check, then fill defaults: the showcase compression when none was asked for, else the
        window/budget of a given press. MLA ranks that depend on the model are filled later
        (:func:`resolve_mla_rank`)."""
        self.check()
        if self.choose:  # the choose stage fills press, budget, neighbours, lookahead and the cache format
            self.window = DEFAULT_WINDOW
        elif all(getattr(self, k) is None for k in _COMPRESSION_KEYS):
            self.showcase_defaults = True
            self.press = DEFAULT_PRESS
            self.neighbors, self.lookahead = DEFAULT_NEIGHBORS, DEFAULT_LOOKAHEAD
            if self.kv_dtype is None:
                self.kv_dtype = DEFAULT_KV_DTYPE
        elif self.press is None and (self.budget is not None or self.window is not None):
            # a size without a press: the default press and its refinements at that size (the int8 cache too,
            # unless MLA or --kv-dtype was asked for)
            self.press = DEFAULT_PRESS
            self.neighbors, self.lookahead = DEFAULT_NEIGHBORS, DEFAULT_LOOKAHEAD
            if self.kv_dtype is None and not self.uses_mla:
                self.kv_dtype = DEFAULT_KV_DTYPE
        if self.uses_press:
            self.budget = DEFAULT_BUDGET if self.budget is None else self.budget
            self.window = DEFAULT_WINDOW if self.window is None else self.window
            self.neighbors = 0 if self.neighbors is None else self.neighbors
            self.lookahead = 0 if self.lookahead is None else self.lookahead
        elif not self.choose:
            self.press = "none"
            self.neighbors = self.lookahead = None
        if self.chunk is None:
            self.chunk = DEFAULT_CHUNK
        if self.model is not None:
            self.model = str(Path(self.model).resolve())
        if self.distill_data is not None:
            self.distill_data = str(Path(self.distill_data).resolve())
        if self.eval_data is not None and not self.eval_data.startswith("bundled:"):
            self.eval_data = str(Path(self.eval_data).resolve())
        if self.distill_teacher is not None and Path(self.distill_teacher).exists():
            self.distill_teacher = str(Path(self.distill_teacher).resolve())
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fidelity_kwargs(eval_data: str | None, min_agreement: float | None, max_ppl_increase: float | None,
                    fidelity: bool = True) -> dict[str, Any]:
    """The fidelity settings that were given, checked, as keyword arguments of
    :func:`kvexport.export.validation.validate` (``kvexport validate`` flags and the convert keys alike).
    Only what was given is passed: nothing at all with the defaults."""
    kw: dict[str, Any] = {}
    if eval_data is not None:
        if not str(eval_data).startswith("bundled:") and not Path(eval_data).is_file():
            raise BadUsage(f"--eval-data {eval_data} does not exist (give a UTF-8 text file or bundled:NAME)")
        kw["eval_data"] = str(eval_data)
    if min_agreement is not None:
        if not 0.0 <= float(min_agreement) <= 1.0:
            raise BadUsage(f"--min-agreement {min_agreement} must be in [0, 1] (e.g. 0.9)")
        kw["min_agreement"] = float(min_agreement)
    if max_ppl_increase is not None:
        if float(max_ppl_increase) < 0:
            raise BadUsage(f"--max-ppl-increase {max_ppl_increase} must be >= 0 (0.05 = +5 %)")
        kw["max_ppl_increase"] = float(max_ppl_increase)
    if not fidelity:
        if kw:
            raise BadUsage("--no-fidelity drops the fidelity check; --eval-data/--min-agreement/--max-ppl-increase "
                           "need it")
        kw["fidelity"] = False
    return kw


def parse_contexts(value: Any, source: str = "options") -> list[int]:
    """``"512,2048"`` or ``[512, 2048]`` -> sorted unique positive ints."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise BadUsage(f"{source}: contexts must be a list like 512,2048,8192, got {value!r}")
    out = []
    for p in parts:
        try:
            c = int(p)
        except (TypeError, ValueError):
            raise BadUsage(f"{source}: context {p!r} is not an integer (give e.g. 512,2048,8192)") from None
        if c < 1:
            raise BadUsage(f"{source}: context {c} must be >= 1")
        out.append(c)
    if not out:
        raise BadUsage(f"{source}: give at least one context length")
    return sorted(set(out))


def default_budget(max_positions: int) -> int:
    """The default budget for a model of ``max_positions`` positions: :data:`DEFAULT_BUDGET`, or a quarter of its
    positions when that is less (at least 1)."""
    return max(1, min(DEFAULT_BUDGET, int(max_positions) // 4))


def default_mla_rank(num_kv_heads: int, head_dim: int, rope_dim: int, target_ratio: float = DEFAULT_MLA_TARGET_RATIO,
                     max_rank: int | None = None) -> int:
    """Rank r_kv, a multiple of 8, whose cache ``r_kv + d_rope`` is about ``1/target_ratio`` of ``2 n_kv d_h``."""
    full = 2 * num_kv_heads * head_dim
    r = max(8, int(round((full / target_ratio - rope_dim) / 8.0)) * 8)
    if max_rank is not None:
        r = min(r, max_rank)
    return r


def showcase_mla(spec) -> tuple[int, int]:
    """(r_kv, d_rope) of convert's default MLA for a model spec (``hidden_size``, ``num_kv_heads``, ``head_dim``):
    :func:`default_rope_dim`, and :func:`default_mla_rank` capped by what the rewrite can hold."""
    from kvexport.mla.config import max_kv_rank

    rope = default_rope_dim(spec.head_dim)
    return default_mla_rank(spec.num_kv_heads, spec.head_dim, rope,
                            max_rank=max_kv_rank(spec.hidden_size, spec.num_kv_heads, spec.head_dim, rope)), rope


def default_rope_dim(head_dim: int) -> int:
    """d_rope = head_dim (even): one head's worth of RoPE components, concentrated by RoRoPE; TransMLA's choice and
    the split the measured search (kvexport.mla.split) picks on the student at ~2x (docs/mla.md)."""
    return max(2, head_dim // 2 * 2)


__all__ = ["ConvertConfig", "parse_contexts", "fidelity_kwargs", "default_mla_rank", "default_rope_dim", "showcase_mla",
           "default_budget", "TARGETS", "BACKENDS", "DEFAULT_PRESS", "DEFAULT_BUDGET", "DEFAULT_WINDOW", "DEFAULT_CHUNK",
           "DEFAULT_KV_DTYPE", "DEFAULT_LOOKAHEAD", "DEFAULT_NEIGHBORS", "DEFAULT_CONTEXTS"]
