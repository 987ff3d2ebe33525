# SPDX-License-Identifier: Apache-2.0
"""What kvexport needs to know about a decoder-only HF model, read from its config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvexport.errors import BadModel

#: HF ``model_type`` -> family name. Everything else is refused with :class:`BadModel`.
SUPPORTED_FAMILIES: dict[str, str] = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
}


#: RoPE variants whose frequencies are fixed at load time: kvexport rotates with the frequencies transformers computes
FIXED_ROPE = ("default", "linear", "llama3", "yarn")
#: variants whose frequencies transformers recomputes from the sequence length at run time -> when
LENGTH_DEPENDENT_ROPE = {
    "dynamic": "transformers' dynamic NTK rescales them past max_position_embeddings",
    "longrope": "transformers switches to long_factor past original_max_position_embeddings",
}


def supported_families_text() -> str:
    return ", ".join(f"{v} ({k})" for k, v in SUPPORTED_FAMILIES.items())


@dataclass(frozen=True)
class ModelSpec:
    """Shape and family switches of a supported causal LM.

    ``qkv_bias``: Qwen2 (and Llama with ``attention_bias``); ``qk_norm``: Qwen3's per-head RMSNorm
    on queries and keys before RoPE; ``o_bias``: Llama's ``attention_bias`` also biases o_proj.
    ``sliding_windows``: per layer, the attention window (None = full attention), or None when no layer has
    one: Mistral's ``sliding_window`` applies to every layer, Qwen2/Qwen3 window the layers that ``layer_types``
    marks ``sliding_attention`` (transformers derives it from ``use_sliding_window`` / ``max_window_layers``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope: dict[str, Any] = field(default_factory=dict)
    sliding_windows: tuple[int | None, ...] | None = None

    def __post_init__(self):
        if self.sliding_windows is not None:
            object.__setattr__(self, "sliding_windows", tuple(None if w is None else int(w)
                                                               for w in self.sliding_windows))
            if len(self.sliding_windows) != self.num_layers:
                raise BadModel(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")

    def sliding_window_of(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None = full attention)."""
        return None if self.sliding_windows is None else self.sliding_windows[layer]

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def family(self) -> str:
        return SUPPORTED_FAMILIES[self.model_type]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sliding_windows"] = list(self.sliding_windows) if self.sliding_windows is not None else None
        return d

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
        """Read a transformers ``PretrainedConfig``; raises :class:`BadModel` for unsupported ones."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_FAMILIES:
            raise BadModel(
                f"unsupported model family {model_type!r}; supported: {supported_families_text()}"
            )
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
            if getattr(config, k, None) is None
        ]
        if missing:
            raise BadModel(f"model config lacks required field(s) {', '.join(missing)}")
        n_heads = int(config.num_attention_heads)
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        if n_heads % n_kv:
            raise BadModel(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if not rope:
            theta = getattr(config, "rope_theta", None)
            if theta is None:
                raise BadModel("model config has no RoPE parameters; kvexport needs a RoPE model")
            rope = {"rope_type": "default", "rope_theta": float(theta)}
        rope_type = rope.get("rope_type", "default")
        if rope_type in LENGTH_DEPENDENT_ROPE:
            raise BadModel(f"rope_type {rope_type!r} changes its frequencies with the sequence length "
                           f"({LENGTH_DEPENDENT_ROPE[rope_type]}), which a cache of rotated keys cannot follow; "
                           f"accepted: {', '.join(FIXED_ROPE)}")
        if rope_type not in FIXED_ROPE:
            raise BadModel(f"unsupported rope_type {rope_type!r}; accepted: {', '.join(FIXED_ROPE)}")
        # read only where the family's HF modules read them (an extra key in another family's config.json is
        # ignored by transformers, so it is ignored here too)
        attention_bias = model_type in ("llama", "qwen3") and bool(getattr(config, "attention_bias", False))
        mlp_bias = model_type == "llama" and bool(getattr(config, "mlp_bias", False))
        n_layers = int(config.num_hidden_layers)
        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=int(head_dim),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048) or 2048),
            qkv_bias=(model_type == "qwen2") or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=mlp_bias,
            qk_norm=(model_type == "qwen3"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=str(getattr(config, "hidden_act", "silu")),
            rope=rope,
            sliding_windows=_sliding_windows(config, model_type, n_layers),
        )


def _sliding_windows(config: Any, model_type: str, n_layers: int) -> tuple[int | None, ...] | None:
    """Per-layer attention windows as transformers applies them (see :class:`ModelSpec`)."""
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral":  # MistralModel windows every layer when sliding_window is set (layer_types unused)
        out = [window] * n_layers
    elif model_type in ("qwen2", "qwen3"):
        types = getattr(config, "layer_types", None) or ["full_attention"] * n_layers
        if len(types) != n_layers:
            raise BadModel(f"layer_types lists {len(types)} layers, the model has {n_layers}")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise BadModel(f"unsupported layer_types {unknown}; accepted: full_attention, sliding_attention")
        out = [window if t == "sliding_attention" else None for t in types]
    else:
        out = [None] * n_layers
    if any(w is not None and int(w) < 1 for w in out):
        raise BadModel(f"sliding_window {window} must be >= 1")
    return tuple(out) if any(w is not None for w in out) else None
