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
(low_freq_factor 1, high_freq_factor 4 and an original context of 8192 are fixed in it), and its
YarnRotaryEmbedding YaRN with a factor and an original context (position_embedding_type=yarn);
every other setting is refused, naming it.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_ext.config.schema import ModelConfig

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
    if rope["rope_type"] in ("llama3", "yarn"):
        rope.setdefault("original_max_position_embeddings", hf_config.get("max_position_embeddings"))
    return rope


def rope_fields(hf_config: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """The ModelConfig RoPE fields (rotary_base; rope_scaling and rope_scaling_factor, or
    position_embedding_type=yarn and its yarn_* fields) of a config;
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
    if kind == "yarn":
        return {**fields, **_yarn_fields(rope, hf_config)}
    if kind != "llama3":
        raise ValueError(f"{where} is not supported (plain RoPE, llama3 or yarn only)")
    for key, fixed in LLAMA3_FIXED.items():
        if rope.get(key) is None or float(rope[key]) != fixed:
            raise ValueError(
                f"{where} with {key}={rope.get(key)!r} is not supported: megatron-core 0.16's "
                f"RotaryEmbedding fixes {', '.join(f'{k}={v:g}' for k, v in LLAMA3_FIXED.items())}"
            )
    return {**fields, "rope_scaling": "llama3", "rope_scaling_factor": float(rope["factor"])}


def _yarn_fields(rope: Mapping[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """megatron's YaRN settings for transformers' `yarn` RoPE parameters.

    transformers scales attention by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    when both are set and by mscale(factor) otherwise; megatron always by the ratio, whose
    defaults (1, 0) give mscale(factor). An explicit attention_factor has no megatron setting.
    """
    unsupported = [
        (not rope.get("truncate", True), "truncate=false"),
        (rope.get("attention_factor") is not None, f"attention_factor={rope.get('attention_factor')}"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ValueError(
                f"config.json: RoPE type 'yarn' with {what} is not supported: megatron's YaRN truncates its "
                "correction range and derives the attention scale from mscale and mscale_all_dim"
            )
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf_config["max_position_embeddings"] / original
    scaled = bool(rope.get("mscale") and rope.get("mscale_all_dim"))
    return {
        "position_embedding_type": "yarn",
        "yarn_rotary_scaling_factor": float(factor),
        "yarn_original_max_position_embeddings": original,
        "yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
        "yarn_mscale": float(rope["mscale"]) if scaled else 1.0,
        "yarn_mscale_all_dim": float(rope["mscale_all_dim"]) if scaled else 0.0,
    }


def hf_rope(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's RoPE keys for the model space's settings, in both spellings: transformers 5
    reads `rope_parameters`, older versions `rope_theta` and `rope_scaling`."""
    theta = cfg.rotary_base
    if cfg.position_embedding_type == "yarn" and cfg.rope_scaling is None:
        scaling = {
            "rope_type": "yarn",
            "factor": cfg.yarn_rotary_scaling_factor,
            "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
            "beta_fast": cfg.yarn_beta_fast,
            "beta_slow": cfg.yarn_beta_slow,
            "mscale": cfg.yarn_mscale,
            "mscale_all_dim": cfg.yarn_mscale_all_dim,
        }
    elif cfg.position_embedding_type == "rope" and cfg.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **LLAMA3_FIXED}
    elif cfg.position_embedding_type == "rope" and cfg.rope_scaling is None:
        return {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    else:
        raise ValueError(
            f"model.position_embedding_type={cfg.position_embedding_type!r} with model.rope_scaling={cfg.rope_scaling!r} "
            "has no Hugging Face counterpart here (rope with None or llama3, or yarn)"
        )
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": theta}}
