"""Every ModelConfig field against the Hugging Face export: a setting is written (the exported
folder, loaded by transformers, gives megatron's own logits), refused (one line naming the
setting and the family the model would otherwise be written as), or not part of the network
(the same weights give the same logits with and without it, and the same config.json).

The model is megatron's own GPTModel with random weights (norms and biases too, so that a
dropped or swapped one shows); the export is the one `convert_checkpoint.py megatron-to-hf` and
the elastic plugin run (config.json, tensors, folder)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_ext.config.schema import ModelConfig
from tests.unit._hf_families import hf_logits

LOGITS_ATOL = 1e-5
BASE = ModelConfig(
    name="base", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
    seq_length=32, vocab_size=100, tie_embeddings=False,
)
EXPERTS = {"num_experts": 4, "moe_ffn_hidden_size": 48}
# RoPE scaling moves the logits only over longer sequences (test_convert_families checks it does at 128).
LONG = {"seq_length": 128}

# name -> (changes to BASE, the family written)
EXPORTED: dict[str, tuple[dict[str, Any], str]] = {
    "base": ({}, "llama"),
    "num_layers": ({"num_layers": 3}, "llama"),
    "hidden_size": ({"hidden_size": 96}, "llama"),
    "ffn_hidden_size": ({"ffn_hidden_size": 80}, "llama"),
    "num_attention_heads": ({"num_attention_heads": 8}, "llama"),
    "mha": ({"num_query_groups": None}, "llama"),
    "head_dim": ({"head_dim": 32}, "llama"),
    "vocab": ({"vocab_size": 77, "make_vocab_size_divisible_by": 7}, "llama"),
    "tied": ({"tie_embeddings": True}, "llama"),
    "rotary_base": ({"rotary_base": 500.0}, "llama"),
    "norm_epsilon": ({"norm_epsilon": 0.5}, "llama"),
    "context": ({"seq_length": 48, "max_position_embeddings": 1024}, "llama"),
    "llama3_rope": ({"rotary_base": 5e5, "rope_scaling": "llama3", "rope_scaling_factor": 4.0, **LONG}, "llama"),
    "yarn": (
        {
            "position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 32,
            "yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0, "yarn_mscale": 0.9, "yarn_mscale_all_dim": 0.6, **LONG,
        },
        "llama",
    ),
    "biases": ({"add_bias_linear": True}, "llama"),
    "qkv_bias": ({"add_qkv_bias": True}, "qwen2"),
    "qk_norm": ({"qk_layernorm": True}, "qwen3"),
    "window_covering_the_context": ({"window_size": [31, 0]}, "llama"),
    "window_skipped_on_every_layer": ({"window_size": [4, 0], "window_attn_skip_freq": 1}, "llama"),
    "experts": ({**EXPERTS, "moe_router_topk": 3}, "mixtral"),
    "experts_plain_softmax_dense_layer": (
        {**EXPERTS, "qk_layernorm": True, "moe_router_pre_softmax": True, "moe_layer_freq": "[1,0]"}, "qwen3_moe",
    ),
}

# name -> (changes to BASE, the refusal: the setting, then the family it names)
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "layernorm": ({"normalization": "LayerNorm"}, r"model.normalization='LayerNorm' \(RMSNorm\).*LlamaForCausalLM"),
    "gelu": ({"activation": "gelu"}, r"model.activation='gelu'.*LlamaForCausalLM"),
    "squared_relu": ({"activation": "squared_relu"}, r"model.activation='squared_relu'.*LlamaForCausalLM"),
    "glu_linear_offset": ({"glu_linear_offset": 1.0}, r"model.glu_linear_offset=1.0 \(0\).*LlamaForCausalLM"),
    "clamp": ({"activation_func_clamp_value": 7.0}, r"model.activation_func_clamp_value=7.0 \(None\).*LlamaForCausalLM"),
    "learned_positions": ({"position_embedding_type": "learned_absolute"}, r"'learned_absolute' \(rope or yarn\).*LlamaForCausalLM"),
    "no_positions": ({"position_embedding_type": "none"}, r"model.position_embedding_type='none'.*LlamaForCausalLM"),
    "rotary_percent": ({"rotary_percent": 0.5}, r"model.rotary_percent=0.5.*LlamaForCausalLM"),
    "window": ({"window_size": [8, 0]}, r"model.window_size=\[8, 0\] shorter than the context of 32 \(no window\).*LlamaForCausalLM"),
    "window_every_other_layer": (
        {"window_size": [8, 0], "window_attn_skip_freq": 2, "add_qkv_bias": True}, r"model.window_size=\[8, 0\].*Qwen2ForCausalLM",
    ),
    "window_within_the_declared_context": (
        {"window_size": [31, 0], "max_position_embeddings": 64}, r"shorter than the context of 64.*LlamaForCausalLM",
    ),
    "softmax_off_by_one": ({"softmax_type": "off-by-one"}, r"model.softmax_type='off-by-one' \(vanilla\).*LlamaForCausalLM"),
    "softmax_learnable": ({"softmax_type": "learnable", "qk_layernorm": True}, r"model.softmax_type='learnable'.*Qwen3ForCausalLM"),
    "mtp": ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3}, r"model.mtp_num_layers=1 \(None: no multi-token prediction\).*LlamaForCausalLM"),
    "mla": (
        {
            "multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_head_dim": 16,
            "qk_pos_emb_head_dim": 8, "v_head_dim": 16,
        },
        r"model.multi_latent_attention=true.*LlamaForCausalLM",
    ),
    "shared_expert": ({**EXPERTS, "moe_shared_expert_intermediate_size": 32}, r"moe_shared_expert_intermediate_size.*MixtralForCausalLM"),
    "sigmoid_router": ({**EXPERTS, "moe_router_score_function": "sigmoid"}, r"'sigmoid' \(softmax\).*MixtralForCausalLM"),
    "expert_bias": (
        {**EXPERTS, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
        r"model.moe_router_enable_expert_bias=true.*MixtralForCausalLM",
    ),
    "group_limited": ({**EXPERTS, "moe_router_num_groups": 2, "moe_router_group_topk": 1}, r"moe_router_num_groups.*MixtralForCausalLM"),
    "topk_scaling": ({**EXPERTS, "moe_router_topk_scaling_factor": 2.0}, r"moe_router_topk_scaling_factor.*MixtralForCausalLM"),
    "sinkhorn": ({**EXPERTS, "moe_router_load_balancing_type": "sinkhorn"}, r"'sinkhorn' \(top-k routing\).*MixtralForCausalLM"),
    "random_routing": ({**EXPERTS, "moe_router_force_load_balancing": True}, r"force_load_balancing=true.*MixtralForCausalLM"),
    "mixtral_pre_softmax": ({**EXPERTS, "moe_router_pre_softmax": True}, r"model.moe_router_pre_softmax.*Mixtral renormalises"),
    "mixtral_dense_layer": ({**EXPERTS, "moe_layer_freq": "[1,0]"}, r"model.moe_layer_freq='\[1,0\]': Mixtral has experts in every layer"),
    "qk_norm_qkv_bias": ({"qk_layernorm": True, "add_qkv_bias": True}, r"Qwen3's attention bias covers q, k, v and o"),
    "hybrid": (
        {
            "arch": "hybrid", "hybrid_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 32, "mamba_num_groups": 2,
            "mamba_state_dim": 16, "mamba_chunk_size": 16,
        },
        r"model.arch='hybrid' \(gpt\).*LlamaForCausalLM",
    ),
}

# name -> (changes to a BASE with or without experts, why the network is the same): training,
# initialisation and kernel choices.
UNCHANGED: dict[str, tuple[dict[str, Any], str]] = {
    "name": ({"name": "other"}, "a label"),
    "init_method_std": ({"init_method_std": 0.5}, "initialisation only"),
    "dropout": ({"hidden_dropout": 0.1, "attention_dropout": 0.1}, "training only (eval has no dropout)"),
    "aux_losses": (
        {**EXPERTS, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001, "moe_router_load_balancing_type": "seq_aux_loss"},
        "losses added while training",
    ),
    "expert_kernels": (
        {**EXPERTS, "moe_grouped_gemm": True, "moe_token_dispatcher": "alltoall", "moe_flex_dispatcher_backend": "hybridep"},
        "how the experts are computed and reached, not what",
    ),
}
# name -> (changes, why): settings of the run, not of the weights (the export is fp32 either way).
RUN_SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "precision": ({"precision": "bf16"}, "the weights are written in fp32 whatever precision trained them"),
    "spec": ({"spec": "local"}, "the layer implementation; Transformer Engine's computes the same function"),
    "attention_backend": ({"attention_backend": "unfused"}, "the attention kernel; each computes the same function"),
    "pretrained": ({"pretrained": "elsewhere/"}, "where the starting weights came from"),
    "layout_independent_init": ({"layout_independent_init": True}, "how the starting weights were drawn"),
}


def model(changes: dict[str, Any]) -> ModelConfig:
    return dataclasses.replace(BASE, **changes)


def random_megatron(cfg: ModelConfig, seed: int = 0) -> list:
    """A one-rank megatron GPTModel of `cfg`, every weight drawn from `seed` in parameter order."""
    from megatron_ext.models.convert.world import build_model
    from megatron_ext.models.gpt import padded_vocab_size

    chunks = build_model(cfg, padded_vocab_size(cfg.vocab_size, cfg, 1))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in chunks[0].named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return chunks


def tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (1, cfg.seq_length), generator=torch.Generator().manual_seed(1))


def megatron_logits(chunks: list, cfg: ModelConfig) -> torch.Tensor:
    with torch.no_grad():
        return chunks[0].eval()(tokens(cfg), torch.arange(cfg.seq_length)[None], None)[0, :, : cfg.vocab_size]


def test_every_model_field_is_in_the_table():
    covered = {field for table in (EXPORTED, REFUSED, UNCHANGED, RUN_SETTINGS) for changes, _ in table.values() for field in changes}
    assert covered == {f.name for f in dataclasses.fields(ModelConfig)}
    defaults = {name: (model(changes), BASE) for table in (EXPORTED, REFUSED) for name, (changes, _) in table.items() if changes}
    assert all(changed != base for changed, base in defaults.values())  # no case repeats a default


@pytest.mark.model
@pytest.mark.parametrize("case", list(EXPORTED))
def test_exported_settings_give_megatrons_logits_in_transformers(one_rank_world, tmp_path, case):
    from megatron_ext.models.convert.hf import write_hf
    from megatron_ext.models.convert.hf_config import hf_config_from_model
    from megatron_ext.models.convert.llama import logical_to_hf
    from megatron_ext.models.convert.load import gather_logical

    changes, family = EXPORTED[case]
    cfg = model(changes)
    chunks = random_megatron(cfg)
    expected = megatron_logits(chunks, cfg)
    config = hf_config_from_model(cfg, cfg.vocab_size)
    folder = write_hf(tmp_path / "hf", logical_to_hf(gather_logical(chunks), cfg, cfg.vocab_size), config)
    assert (config["model_type"], config["max_position_embeddings"]) == (family, cfg.max_position_embeddings or cfg.seq_length)
    got = hf_logits(folder, tokens(cfg))
    diff = (got - expected).abs().max().item()
    assert diff < LOGITS_ATOL, diff
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("case", list(REFUSED))
def test_settings_no_family_has_are_refused_naming_the_family(case):
    from megatron_ext.models.convert.hf_config import hf_config_from_model

    changes, message = REFUSED[case]
    with pytest.raises(ValueError, match=message) as info:
        hf_config_from_model(model(changes), BASE.vocab_size)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("case", list(UNCHANGED))
def test_settings_outside_the_network_change_neither_logits_nor_config(one_rank_world, case):
    from megatron_ext.models.convert.hf_config import hf_config_from_model

    changes, _ = UNCHANGED[case]
    base = model({k: v for k, v in changes.items() if k in EXPERTS})
    changed = model(changes)
    assert hf_config_from_model(changed, BASE.vocab_size) == hf_config_from_model(base, BASE.vocab_size)
    assert torch.equal(megatron_logits(random_megatron(changed), changed), megatron_logits(random_megatron(base), base))


@pytest.mark.parametrize("case", list(RUN_SETTINGS))
def test_run_settings_change_no_config(case):
    from megatron_ext.models.convert.hf_config import hf_config_from_model

    changes, _ = RUN_SETTINGS[case]
    assert hf_config_from_model(model(changes), BASE.vocab_size) == hf_config_from_model(BASE, BASE.vocab_size)


def test_convert_script_refuses_an_mtp_checkpoint_with_one_line_before_writing(one_rank_world, tmp_path, capsys):
    from megatron_ext.models.convert.checkpoint import save_model_only
    from megatron_ext.models.gpt import padded_vocab_size

    cfg = model({"mtp_num_layers": 1})
    padded = padded_vocab_size(cfg.vocab_size, cfg, 1)
    save_model_only(tmp_path / "ckpt", random_megatron(cfg), cfg, padded)
    spec = importlib.util.spec_from_file_location("convert_checkpoint", Path(__file__).parents[2] / "scripts" / "convert_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as exit_:
        script.main(["megatron-to-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "model.mtp_num_layers=1" in err and "LlamaForCausalLM" in err
    assert not (tmp_path / "hf").exists()
