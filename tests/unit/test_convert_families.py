"""Hugging Face families in megatron's GPT model space and back: Llama 3.x (llama3 RoPE), Llama
with biases, Qwen2 (QKV bias; also with YaRN), Qwen3 (QK-norm, head_dim 128 over hidden 64), Mistral (a window
no shorter than the sequence), Mixtral and Qwen3-MoE (renormalised and plain top-k softmax, a
dense layer among MoE ones).

Each tiny random model, saved by transformers' `save_pretrained`, goes through `model.pretrained`'s
loader into megatron-core's GPTModel and must give transformers' logits (fp32, max |diff| 1e-5,
same argmax); its export must be the same tensors and reload in transformers with identical
logits. Config reading follows transformers (checked against its own config classes) and every
setting the model space cannot build is refused with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.convert.families import family_of
from megatron_ext.models.convert.hf_config import hf_config_from_model, model_config_from_hf
from megatron_ext.models.convert.rope import effective_rope
from tests.unit._hf_families import FAMILIES, LLAMA3, SIZES, hf_config, hf_logits, save_tiny

LOGITS_ATOL = 1e-5
# Llama 3 scaling only changes frequencies with wavelengths over 2048 positions: their angles
# need some length to move the logits.
SEQ = 128
# The family each one is written back as: Mistral without a window is Llama's network.
EXPORTED_AS = {
    "llama3": "llama", "llama_bias": "llama", "mistral": "llama", "qwen2_yarn": "qwen2", "qwen2_yarn_scaled": "qwen2",
    "qwen3_moe_softmax": "qwen3_moe",
}


def tokens() -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))


def megatron_logits(folder: Path) -> tuple[list, ModelConfig, torch.Tensor]:
    """The folder loaded as `model.pretrained` into a one-rank megatron model; (chunks, config,
    logits)."""
    from megatron_ext.models import pretrained
    from megatron_ext.models.convert.world import build_model
    from megatron_ext.models.gpt import padded_vocab_size

    cfg = dataclasses.replace(pretrained.source_config(str(folder)), pretrained=str(folder))
    padded = padded_vocab_size(cfg.vocab_size, cfg, 1)
    chunks = build_model(cfg, padded)
    pretrained.load_into(chunks, cfg, padded)
    with torch.no_grad():
        logits = chunks[0].eval()(tokens(), torch.arange(SEQ)[None], None)[0, :, : cfg.vocab_size]
    return chunks, cfg, logits


@pytest.mark.model
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_logits_match_transformers_and_export_back(one_rank_world, tmp_path, name):
    from megatron_ext.models.convert.hf import write_hf
    from megatron_ext.models.convert.llama import logical_to_hf
    from megatron_ext.models.convert.load import gather_logical

    source = tmp_path / "hf"
    save_tiny(name, source)
    expected = hf_logits(source, tokens())
    chunks, cfg, got = megatron_logits(source)
    diff = (got - expected).abs().max().item()
    assert diff < LOGITS_ATOL, diff
    assert torch.equal(got.argmax(-1), expected.argmax(-1))

    config = hf_config_from_model(cfg, cfg.vocab_size)
    back = write_hf(tmp_path / "back", logical_to_hf(gather_logical(chunks), cfg, cfg.vocab_size), config)
    assert (config["model_type"], config["max_position_embeddings"]) == (EXPORTED_AS.get(name, name), 256)
    original, exported = load_file(source / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(exported) == set(original) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert all(torch.equal(exported[n], original[n]) for n in exported)
    assert torch.equal(hf_logits(back, tokens()), expected)


@pytest.mark.model
@pytest.mark.parametrize("name", ["llama3", "qwen2_yarn", "qwen2_yarn_scaled"])
def test_rope_scaling_matters_at_this_length(tmp_path, name):
    """The scaled cases check the scaled frequencies: plain RoPE on the same weights gives
    logits far outside the tolerance."""
    scaled, plain = tmp_path / "scaled", tmp_path / "plain"
    save_tiny(name, scaled)
    save_tiny(name, plain)
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(config))
    assert (hf_logits(plain, tokens()) - hf_logits(scaled, tokens())).abs().max() > 100 * LOGITS_ATOL


# --- config.json ------------------------------------------------------------------------------

LINEAR = {"rope_type": "linear", "factor": 2.0}
# name -> a Llama config.json's RoPE keys, including ones where rope_scaling and rope_parameters
# disagree (transformers takes rope_scaling whole, and rope_theta from the top level).
ROPE_CASES = {
    "parameters_only": {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    "legacy_top_level": {"rope_theta": 5e5, "rope_scaling": LLAMA3},
    "scaling_beats_parameters": {
        "rope_theta": 7e4,
        "rope_scaling": LLAMA3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
    },
    "scaling_without_theta_beats_parameters": {
        "rope_scaling": LLAMA3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
    },
    "legacy_type_key": {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}},
    "empty_scaling": {"rope_scaling": {}, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}},
    "top_level_original_context": {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "original_max_position_embeddings": 4096},
    "no_rope_keys": {},
}


@pytest.mark.model
@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_rope_settings_follow_transformers(case, model_type):
    from transformers import AutoConfig

    config = {**{k: v for k, v in SIZES.items()}, **ROPE_CASES[case], "model_type": model_type}
    theirs = AutoConfig.for_model(**json.loads(json.dumps(config))).rope_parameters
    default_theta = {"llama": 1e4, "mixtral": 1e6}[model_type]
    ours = effective_rope(config, default_theta)
    keys = ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    assert {k: ours.get(k) for k in keys} == {k: theirs.get(k) for k in keys}


# name -> (family, config.json changes, the refusal)
REFUSALS = {
    "linear": ("llama3", {"rope_scaling": LINEAR}, r"RoPE type 'linear' is not supported: linear scaling"),
    "dynamic": ("llama3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"'dynamic' is not supported: dynamic NTK"),
    "longrope": ("llama3", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, r"'longrope' is not supported"),
    "yarn_attention_factor": (
        "qwen2_yarn",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3}},
        r"'yarn' with attention_factor=1.3 is not supported",
    ),
    "llama3_bands": (
        "llama3",
        {"rope_scaling": {**LLAMA3, "low_freq_factor": 2.0}},
        r"'llama3' with low_freq_factor=2.0 is not supported: megatron-core 0.16's RotaryEmbedding fixes low_freq_factor=1",
    ),
    "attention_bias_alone": ("llama3", {"attention_bias": True}, r"attention_bias=true with mlp_bias=false is not supported"),
    "mlp_bias_alone": ("llama3", {"mlp_bias": True}, r"attention_bias=false with mlp_bias=true"),
    "qwen3_attention_bias": ("qwen3", {"attention_bias": True}, r"attention_bias=true is not supported for Qwen3"),
    "activation": ("qwen2", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    "partial_rotary": ("llama3", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported"),
    "mistral_window": ("mistral", {"sliding_window": 16}, r"sliding_window=16 is shorter than the sequence \(256\)"),
    "qwen2_window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2, "layer_types": None},
        r"sliding_window=64 is shorter than the sequence \(256\)",
    ),
    "experts_disagree": ("mixtral", {"num_experts": 8}, r"num_local_experts and num_experts disagree \(\[4, 8\]\)"),
    "model_type": ("llama3", {"model_type": "gemma"}, r"model_type='gemma' is not supported"),
}


@pytest.mark.model
@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_the_model_space_cannot_build_is_refused(case):
    name, changes, message = REFUSALS[case]
    config = {**hf_config(name).to_dict(), **changes}
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(config)


@pytest.mark.model
def test_a_window_no_shorter_than_the_sequence_is_accepted():
    config = {**hf_config("mistral").to_dict(), "sliding_window": 64}
    assert model_config_from_hf(config, max_seq_length=64).seq_length == 64
    with pytest.raises(ValueError, match="sliding_window=64"):
        model_config_from_hf(config, max_seq_length=65)


@pytest.mark.model
@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_round_trip(name):
    cfg = model_config_from_hf(hf_config(name).to_dict(), name="m")
    assert model_config_from_hf(hf_config_from_model(cfg, SIZES["vocab_size"]), name="m") == cfg


# ModelConfig changes -> the family it exports as, or the refusal
EXPORT_CASES = {
    "plain": ({}, "llama"),
    "biases": ({"add_bias_linear": True}, "llama"),
    "qkv_bias": ({"add_qkv_bias": True}, "qwen2"),
    "qk_norm": ({"qk_layernorm": True}, "qwen3"),
    "experts": ({"num_experts": 4}, "mixtral"),
    "experts_qk_norm_pre_softmax": ({"num_experts": 4, "qk_layernorm": True, "moe_router_pre_softmax": True}, "qwen3_moe"),
    "experts_pre_softmax": ({"num_experts": 4, "moe_router_pre_softmax": True}, "Mixtral renormalises"),
    "qk_norm_qkv_bias": ({"qk_layernorm": True, "add_qkv_bias": True}, "Qwen3's attention bias covers q, k, v and o"),
    "gpt3": (
        {"normalization": "LayerNorm", "activation": "gelu", "position_embedding_type": "learned_absolute"},
        "no transformers family has model.normalization='LayerNorm' \\(RMSNorm\\); model.activation='gelu'",
    ),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_family_follows_the_model_space(case):
    changes, expected = EXPORT_CASES[case]
    cfg = ModelConfig(**changes)
    if expected.islower():
        assert family_of(cfg).model_type == expected
    else:
        with pytest.raises(ValueError, match=expected):
            family_of(cfg)


@pytest.mark.model
def test_convert_script_refuses_with_one_line_before_writing(tmp_path, capsys):
    import importlib.util

    save_tiny("llama3", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_parameters": {**LINEAR, "rope_theta": 1e4}}))
    spec = importlib.util.spec_from_file_location("convert_checkpoint", Path(__file__).parents[2] / "scripts" / "convert_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()  # transformers' own progress lines
    with pytest.raises(SystemExit) as exit_:
        script.main(["hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "out"), "--tp", "2", "--pp", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"{tmp_path / 'hf'}: config.json: RoPE type 'linear' is not supported" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.model
@pytest.mark.parametrize(
    "name, field, value", [("qwen3", "qk_layernorm", False), ("qwen2", "add_qkv_bias", False), ("mixtral", "moe_router_pre_softmax", True)]
)
def test_model_pretrained_refuses_a_run_of_another_network(tmp_path, name, field, value):
    from megatron_ext.models.pretrained import check_architecture, source_config

    save_tiny(name, tmp_path)
    source = source_config(str(tmp_path))
    run = dataclasses.replace(source, **{field: value})
    with pytest.raises(ValueError, match=f"model.{field}={value!r} but the source has {not value!r}"):
        check_architecture(run, source, str(tmp_path))
