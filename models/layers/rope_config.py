"""What a config's rope fields say, torch-free: the scaling kind, the positions it reaches, and the
checks that refuse a scaling Baton cannot serve as transformers would (models/layers/rotary.py
builds the tables). Both spellings are read: transformers 4's `rope_scaling` with a top-level
`rope_theta`, and transformers 5's `rope_parameters` that holds both.
"""
from __future__ import annotations

import numbers

SCALINGS = ("linear", "dynamic", "yarn", "llama3", "longrope")
# the fields besides factor that shape YaRN's frequencies or its attention factor (numbers if set)
YARN_NUMBERS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def rope_parameters(config) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from a transformers 4.x or 5.x config."""
    params = getattr(config, "rope_parameters", None)
    scaling = getattr(config, "rope_scaling", None)
    theta = getattr(config, "rope_theta", None)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def scaling_kind(scaling: dict | None) -> str:
    """"default" without scaling, else one of SCALINGS (ValueError naming them for any other)."""
    if scaling is None:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in SCALINGS:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SCALINGS)})")
    return kind


def context_length(max_positions: int, scaling: dict | None) -> int:
    """The positions a scaled rotary reaches, as vLLM derives them: max_position_embeddings times
    `factor` for linear and dynamic NTK, original_max_position_embeddings times `factor` for YaRN
    (never fewer than max_position_embeddings); Llama 3 and LongRoPE configs state the extended length."""
    kind = scaling_kind(scaling)
    if kind in ("linear", "dynamic"):
        return max(max_positions, int(max_positions * scaling_factor(scaling)))
    if kind == "yarn":
        original = original_max_positions(scaling, max_positions)
        return max(max_positions, int(original * yarn_factor(scaling, max_positions)))
    return max_positions


def check_scaling(scaling: dict | None, max_positions: int | None) -> None:
    """ValueError for a scaling whose fields transformers would only warn about and then compute
    nonsense from: a factor below 1 (a context shrunk, not extended), YaRN's betas or attention
    factor not numbers, beta_fast below beta_slow (the ramp runs backwards), an attention factor <= 0."""
    kind = scaling_kind(scaling)
    if kind in ("linear", "dynamic"):
        scaling_factor(scaling)
    if kind != "yarn":
        return
    yarn_factor(scaling, max_positions)
    original_max_positions(scaling, max_positions)
    for name in YARN_NUMBERS:
        value = scaling.get(name)
        if value is not None and not _is_number(value):
            raise ValueError(f"rope_scaling yarn's {name} must be a number, got {value!r}")
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    if fast < slow:
        raise ValueError(f"rope_scaling yarn needs beta_fast >= beta_slow (defaults 32 and 1), got {fast} and {slow}")
    if scaling.get("attention_factor") is not None and scaling["attention_factor"] <= 0:
        raise ValueError(f"rope_scaling yarn's attention_factor must be positive, got {scaling['attention_factor']}")


def check_max_model_len(config, max_model_len: int | None) -> None:
    """ValueError for a rope scaling `check_scaling` refuses, or when --max-model-len asks for
    positions the model's rotary does not reach."""
    text = getattr(config, "text_config", None) or config      # a vision-language model: its decoder's
    _, scaling = rope_parameters(text)
    max_positions = getattr(text, "max_position_embeddings", None)
    check_scaling(scaling, max_positions)
    if max_model_len is None or max_positions is None:
        return
    reach = context_length(max_positions, scaling)
    if max_model_len > reach:
        how = (f"rope_scaling {scaling_kind(scaling)} extends max_position_embeddings {max_positions} to {reach}"
               if reach > max_positions else
               f"max_position_embeddings is {max_positions}; a checkpoint reaches further with a rope_scaling "
               f"({', '.join(SCALINGS[:3])}) in its config.json")
        raise ValueError(f"max_model_len {max_model_len} is past the model's context: {how}")


def check_stated_fields(raw: dict) -> None:
    """ValueError for a config.json (the parsed file, before transformers fills it in) whose YaRN
    leaves out original_max_position_embeddings. transformers then takes max_position_embeddings,
    right only where that is the unscaled length; Qwen3 states 40960 there but was trained on 32768,
    so a guess would shift YaRN's ramp and the reach. vLLM refuses such a config too."""
    for level in (raw, raw.get("text_config") or {}):
        for key in ("rope_scaling", "rope_parameters"):
            scaling = level.get(key)
            if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "yarn":
                continue
            if scaling.get("original_max_position_embeddings") is None and \
                    level.get("original_max_position_embeddings") is None:
                raise ValueError(f"config.json's {key} of type yarn states no original_max_position_embeddings: "
                                 "add the context length the model was trained on, which YaRN multiplies by "
                                 "factor (Qwen3: 32768, for 131072 tokens at factor 4)")


def scaling_factor(scaling: dict) -> float:
    """`factor`, a number >= 1 (ValueError otherwise)."""
    factor = scaling.get("factor")
    if not _is_number(factor) or factor < 1:
        raise ValueError(f"rope_scaling {scaling_kind(scaling)} needs a factor >= 1 (how many times it "
                         f"extends the context), got {factor!r}")
    return factor


def yarn_factor(scaling: dict, max_positions: int | None) -> float:
    """`factor`; transformers takes max_position_embeddings / original_max_position_embeddings
    where the config leaves it null."""
    if scaling.get("factor") is None and max_positions is not None:
        implied = max_positions / original_max_positions(scaling, max_positions)
        if implied < 1:
            raise ValueError(f"rope_scaling yarn without a factor takes max_position_embeddings / "
                             f"original_max_position_embeddings, here {implied:.3g}: it must be >= 1")
        return implied
    return scaling_factor(scaling)


def original_max_positions(scaling: dict, default: int | None = None) -> int:
    """original_max_position_embeddings (YaRN: max_position_embeddings where it is absent, as
    transformers fills it in; a config.json that leaves it out is refused at load, check_stated_fields)."""
    original = scaling.get("original_max_position_embeddings", default)
    if isinstance(original, bool) or not isinstance(original, int) or original < 2:
        raise ValueError(f"{scaling_kind(scaling)} needs original_max_position_embeddings >= 2, got {original!r}")
    return original


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
