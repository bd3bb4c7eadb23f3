"""RoPE settings of a Hugging Face config.json <-> the model space's RoPE fields.

transformers 5 keeps RoPE settings in `rope_parameters`; configs written by older versions have
`rope_theta` and `rope_scaling` at the top level, and a config may carry both. What counts is
what the installed transformers makes of it (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`
and `standardize_rope_params`):

- a non-empty `rope_scaling` replaces `rope_parameters` as a whole;
- `rope_theta` is the chosen dict's own, else the top-level one, else the family's default;
- the type is `rope_type`, else the legacy `type`, else "default";
- Llama 3's `original_max_position_embeddings` is the dict's, else `max_position_embeddings` (a
  top-level key of that name counts only for families that declare it, none of these).

megatron-core 0.16's RotaryEmbedding has plain RoPE and Llama 3.1's bands with its factor
(low_freq_factor 1, high_freq_factor 4 and an original context of 8192 are fixed in it); every
other setting is refused, naming it.
"""

from __future__ import annotations

from typing import Any, Mapping

# What megatron-core 0.16's RotaryEmbedding._apply_scaling fixes; Llama 3.1, 3.2 and 3.3 use them.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Why each other Hugging Face RoPE type is refused.
REFUSED_TYPES = {
    "linear": "linear scaling (positions divided by `factor`) has no field in the model space "
    "(model.rope_scaling is None or llama3)",
    "dynamic": "dynamic NTK scaling (the base grows with the sequence past max_position_embeddings) "
    "has no counterpart in megatron-core 0.16's RotaryEmbedding",
}


def effective_rope(hf_config: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """The RoPE parameters transformers uses for this config: one dict with `rope_type` and
    `rope_theta` (and the type's own keys)."""
    chosen = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    rope = dict(chosen)
    rope.setdefault("rope_theta", hf_config.get("rope_theta", default_theta))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if hf_config.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", hf_config["partial_rotary_factor"])
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", hf_config.get("max_position_embeddings"))
    return rope


def rope_fields(hf_config: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """The ModelConfig RoPE fields (rotary_base, rope_scaling, rope_scaling_factor) of a config;
    raises, naming the setting, for what megatron-core cannot build."""
    rope = effective_rope(hf_config, default_theta)
    kind = rope["rope_type"]
    where = f"config.json: RoPE type {kind!r}"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"config.json: partial_rotary_factor={rope['partial_rotary_factor']} is not supported "
            "(these families rotate every channel of a head)"
        )
    fields: dict[str, Any] = {"rotary_base": float(rope["rope_theta"])}
    if kind == "default":
        return fields
    if kind in REFUSED_TYPES:
        raise ValueError(f"{where} is not supported: {REFUSED_TYPES[kind]}")
    if kind != "llama3":
        raise ValueError(f"{where} is not supported (plain RoPE or llama3 only)")
    for key, fixed in LLAMA3_FIXED.items():
        if rope.get(key) is None or float(rope[key]) != fixed:
            raise ValueError(
                f"{where} with {key}={rope.get(key)!r} is not supported: megatron-core 0.16's "
                f"RotaryEmbedding fixes {', '.join(f'{k}={v:g}' for k, v in LLAMA3_FIXED.items())}"
            )
    return {**fields, "rope_scaling": "llama3", "rope_scaling_factor": float(rope["factor"])}


def hf_rope(rotary_base: float, rope_scaling: str | None, factor: float) -> dict[str, Any]:
    """config.json's RoPE keys for the model space's settings, in both spellings: transformers 5
    reads `rope_parameters`, older versions `rope_theta` and `rope_scaling`."""
    if rope_scaling is None:
        return {"rope_theta": rotary_base, "rope_parameters": {"rope_type": "default", "rope_theta": rotary_base}}
    if rope_scaling != "llama3":
        raise ValueError(f"model.rope_scaling={rope_scaling!r} has no Hugging Face counterpart here (None or llama3)")
    scaling = {"rope_type": "llama3", "factor": factor, **LLAMA3_FIXED}
    return {"rope_theta": rotary_base, "rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": rotary_base}}
