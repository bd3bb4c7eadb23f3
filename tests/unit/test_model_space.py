"""megatron's GPT model space: what the builder makes of ModelConfig, and the rules before launch.

The GPT-3-style model is compared with the model megatron-core itself builds from its own
defaults (TransformerConfig's and GPTModel's, which are Megatron-LM's: LayerNorm, GeLU, a 4h MLP,
learned absolute positions, biases, dropout 0.1) on its own local layer spec: same modules, same
parameters and shapes, same activation and dropout probabilities. The LLaMA-style default stays
what the presets were built for.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from megatron_ext.config.moe_pattern import moe_layer_pattern
from megatron_ext.config.schema import Config, ModelConfig, ParallelConfig
from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.config.validate import violations
from megatron_ext.models.gpt import DTYPES, build_gpt_model, layer_spec, transformer_config

VOCAB = 256


def build(model: ModelConfig, parallel: Optional[ParallelConfig] = None) -> GPTModel:
    config = transformer_config(model, parallel or ParallelConfig(), on_cpu=True)
    return build_gpt_model(model, config, layer_spec(model, use_te=False), VOCAB, True, True)


def megatron_default_gpt(model: ModelConfig) -> GPTModel:
    """What megatron-core builds given only the sizes: every other choice is its default."""
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        use_cpu_initialization=True,
        # Apex/TE kernels: not the model, only how it is computed.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    # Tied as Megatron-LM ties them unless --untie-embeddings-and-output-weights.
    return GPTModel(
        config, get_gpt_layer_local_spec(), VOCAB, model.seq_length, share_embeddings_and_output_weights=True
    )


def module_tree(model: torch.nn.Module) -> dict:
    """name -> (module class, its own parameters' shapes, dropout p) for every module."""
    return {
        name: (
            type(module).__name__,
            {p: tuple(t.shape) for p, t in module.named_parameters(recurse=False)},
            getattr(module, "p", None),
        )
        for name, module in model.named_modules()
    }


def test_gpt3_preset_builds_the_model_megatron_builds_by_default(one_rank_world):
    gpt3 = MODEL_PRESETS["gpt3_tiny"]
    ours, theirs = build(gpt3), megatron_default_gpt(gpt3)
    # Core attention aside (ours is megatron's DotProductAttention extended to context parallelism).
    rename = {"ContextParallelAttention": "DotProductAttention"}
    tree = {k: (rename.get(c, c), p, d) for k, (c, p, d) in module_tree(ours).items()}
    assert tree == module_tree(theirs)
    assert ours.config.activation_func is theirs.config.activation_func is F.gelu
    assert not ours.config.gated_linear_unit and not theirs.config.gated_linear_unit


def test_gpt3_preset_module_tree(one_rank_world):
    gpt3 = MODEL_PRESETS["gpt3_tiny"]
    model = build(gpt3)
    h, layers = gpt3.hidden_size, model.decoder.layers
    norms = [model.decoder.final_layernorm] + [n for layer in layers for n in (layer.input_layernorm, layer.pre_mlp_layernorm)]
    assert all(type(n) is torch.nn.LayerNorm and n.bias is not None for n in norms)
    for layer in layers:
        assert layer.mlp.linear_fc1.weight.shape == (4 * h, h) and layer.mlp.linear_fc2.weight.shape == (h, 4 * h)
        for linear in (
            layer.self_attention.linear_qkv,
            layer.self_attention.linear_proj,
            layer.mlp.linear_fc1,
            layer.mlp.linear_fc2,
        ):
            assert linear.bias is not None and linear.bias.shape == (linear.weight.shape[0],)
        assert layer.hidden_dropout == 0.1
        assert layer.self_attention.core_attention.attention_dropout.p == 0.1
    assert model.config.activation_func is F.gelu and not model.config.gated_linear_unit
    assert model.embedding.position_embeddings.weight.shape == (gpt3.seq_length, h)
    assert model.embedding.embedding_dropout.p == 0.1
    assert not hasattr(model, "rotary_pos_emb")
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpt3_half_precision_forward_keeps_its_dtype(one_rank_world, precision):
    """The learned position table is a plain torch Embedding that megatron builds in fp32: it
    is cast with the model, so the first layer's input is bf16/fp16 as its weights are."""
    gpt3 = dataclasses.replace(MODEL_PRESETS["gpt3_tiny"], precision=precision)
    model = build(gpt3)
    dtype = DTYPES[precision]
    assert model.embedding.position_embeddings.weight.dtype == dtype
    tokens = torch.randint(0, VOCAB, (1, gpt3.seq_length))
    logits = model(tokens, torch.arange(gpt3.seq_length)[None], None)
    assert logits.dtype == dtype


def test_llama_default_is_unchanged(one_rank_world):
    llama = ModelConfig()
    model = build(llama)
    h, ffn = llama.hidden_size, llama.ffn_hidden_size
    norms = [model.decoder.final_layernorm] + [
        n for layer in model.decoder.layers for n in (layer.input_layernorm, layer.pre_mlp_layernorm)
    ]
    assert all(type(n) is torch.nn.RMSNorm for n in norms)
    assert model.config.activation_func is F.silu and model.config.gated_linear_unit
    for layer in model.decoder.layers:
        assert layer.mlp.linear_fc1.weight.shape == (2 * ffn, h)
        assert layer.self_attention.core_attention.attention_dropout.p == 0.0 and layer.hidden_dropout == 0.0
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert model.position_embedding_type == "rope" and not hasattr(model.embedding, "position_embeddings")
    assert model.rotary_pos_emb.inv_freq.numel() == h // llama.num_attention_heads // 2


# name -> (ModelConfig fields, what the built model must show)
OPTIONS = {
    "qkv_bias_alone": (
        dict(add_qkv_bias=True),
        lambda m: m.decoder.layers[0].self_attention.linear_qkv.bias is not None
        and m.decoder.layers[0].self_attention.linear_proj.bias is None,
    ),
    "qk_layernorm": (
        dict(qk_layernorm=True),
        lambda m: type(m.decoder.layers[0].self_attention.q_layernorm) is torch.nn.RMSNorm
        and m.decoder.layers[0].self_attention.k_layernorm.weight.shape == (32,),
    ),
    "head_dim_64_of_hidden_128_4_heads": (
        dict(head_dim=64),
        lambda m: m.decoder.layers[0].self_attention.linear_qkv.weight.shape == (3 * 4 * 64, 128),
    ),
    "squared_relu": (dict(activation="squared_relu"), lambda m: m.config.activation_func.__name__ == "squared_relu"),
    "no_position_embedding": (
        dict(position_embedding_type="none"),
        lambda m: not hasattr(m, "rotary_pos_emb") and not hasattr(m.embedding, "position_embeddings"),
    ),
    "half_rotary": (dict(rotary_percent=0.5), lambda m: m.rotary_pos_emb.inv_freq.numel() == 8),
    "yarn": (
        dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0),
        lambda m: type(m.rotary_pos_emb).__name__ == "YarnRotaryEmbedding",
    ),
    "untied": (dict(tie_embeddings=False), lambda m: m.output_layer.weight is not None),
    "mla": (
        dict(
            multi_latent_attention=True,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            v_head_dim=16,
        ),
        lambda m: type(m.decoder.layers[0].self_attention).__name__ == "MLASelfAttention",
    ),
    "moe_shared_expert": (
        dict(num_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48),
        lambda m: m.decoder.layers[0].mlp.shared_experts.linear_fc2.weight.shape == (128, 48),
    ),
    "moe_every_second_layer": (
        dict(num_experts=4, moe_ffn_hidden_size=32, moe_layer_freq="2"),
        lambda m: [type(layer.mlp).__name__ for layer in m.decoder.layers] == ["MoELayer", "MLP", "MoELayer", "MLP"],
    ),
    "moe_pattern": (
        dict(num_experts=4, moe_ffn_hidden_size=32, moe_layer_freq="[0]*3+[1]"),
        lambda m: [type(layer.mlp).__name__ for layer in m.decoder.layers] == ["MLP", "MLP", "MLP", "MoELayer"],
    ),
    "moe_expert_bias": (
        dict(
            num_experts=4,
            moe_ffn_hidden_size=32,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        ),
        lambda m: m.decoder.layers[0].mlp.router.expert_bias.shape == (4,),
    ),
    "moe_grouped_gemm_runs_sequential_on_cpu": (
        dict(num_experts=4, moe_ffn_hidden_size=32, moe_grouped_gemm=True),
        lambda m: type(m.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP",
    ),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_reaches_the_built_model(one_rank_world, name):
    fields, shows = OPTIONS[name]
    model = build(dataclasses.replace(ModelConfig(), **fields))
    assert shows(model)
    tokens = torch.randint(0, VOCAB, (2, 16))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
    loss.sum().backward()
    assert torch.isfinite(loss).all()


def test_grouped_gemm_without_te_says_so_once(caplog):
    from megatron_ext.models import gpt

    gpt._notice.cache_clear()
    model = dataclasses.replace(ModelConfig(), num_experts=4, moe_ffn_hidden_size=32, moe_grouped_gemm=True)
    for _ in range(2):
        assert not gpt.uses_grouped_gemm(model, use_te=False)
    notices = [r.getMessage() for r in caplog.records if "moe_grouped_gemm" in r.getMessage()]
    assert len(notices) == 1 and "SequentialMLP" in notices[0] and "\n" not in notices[0]


def test_moe_layer_freq_reads_megatron_expressions():
    model = ModelConfig(num_layers=8)
    assert moe_layer_pattern(dataclasses.replace(model, moe_layer_freq="([0]+[1]*3)*2")) == [0, 1, 1, 1] * 2
    assert moe_layer_pattern(dataclasses.replace(model, moe_layer_freq="3")) == [1, 0, 0, 1, 0, 0, 1, 0]
    with pytest.raises(ValueError, match="list expression"):
        moe_layer_pattern(dataclasses.replace(model, moe_layer_freq="__import__('os')"))


# --- validation ---------------------------------------------------------------------------------

MOE = {"model.num_experts": 4, "model.moe_ffn_hidden_size": 32}
MLA = {
    "model.multi_latent_attention": True,
    "model.q_lora_rank": 32,
    "model.kv_lora_rank": 16,
    "model.qk_head_dim": 16,
    "model.qk_pos_emb_head_dim": 8,
    "model.v_head_dim": 16,
}


def make(**fields) -> Config:
    cfg = Config()
    for path, value in fields.items():
        section, name = path.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


# id -> (fields, world size, blamed field, key phrase)
BAD = {
    "normalization": ({"model.normalization": "ScaleNorm"}, 1, "model.normalization", "one of RMSNorm, LayerNorm"),
    "activation": ({"model.activation": "geglu"}, 1, "model.activation", "one of swiglu, gelu, squared_relu"),
    "position": ({"model.position_embedding_type": "alibi"}, 1, "model.position_embedding_type", "one of rope"),
    "rotary_percent_zero": ({"model.rotary_percent": 0.0}, 1, "model.rotary_percent", "in (0, 1]"),
    "rotary_odd": ({"model.rotary_percent": 0.3}, 1, "model.rotary_percent", "even, non-zero"),
    "hidden_dropout_one": ({"model.hidden_dropout": 1.0}, 1, "model.hidden_dropout", "in [0, 1)"),
    "attention_dropout_negative": ({"model.attention_dropout": -0.1}, 1, "model.attention_dropout", "in [0, 1)"),
    "rope_scaling_unknown": ({"model.rope_scaling": "linear"}, 1, "model.rope_scaling", "null or llama3"),
    "rope_scaling_without_rope": (
        {"model.rope_scaling": "llama3", "model.position_embedding_type": "learned_absolute"},
        1,
        "model.rope_scaling",
        "needs model.position_embedding_type=rope",
    ),
    "position_table_short": (
        {"model.position_embedding_type": "learned_absolute", "model.max_position_embeddings": 64},
        1,
        "model.max_position_embeddings",
        ">= model.seq_length (128)",
    ),
    "head_dim_zero": ({"model.head_dim": 0}, 1, "model.head_dim", "positive integer or null"),
    "mla_learned_positions": (
        {**MLA, "model.position_embedding_type": "learned_absolute"},
        1,
        "model.multi_latent_attention",
        "must be rope or yarn",
    ),
    "mla_gqa": ({**MLA, "model.num_query_groups": 2}, 1, "model.multi_latent_attention", "no grouped-query attention"),
    "mla_cp_on_cpu": ({**MLA, "parallel.cp": 2}, 2, "model.multi_latent_attention", "no context parallelism"),
    "balancing_type": (
        {**MOE, "model.moe_router_load_balancing_type": "global"},
        1,
        "model.moe_router_load_balancing_type",
        "one of aux_loss, seq_aux_loss, sinkhorn, none",
    ),
    "score_function": (
        {**MOE, "model.moe_router_score_function": "relu"},
        1,
        "model.moe_router_score_function",
        "one of softmax, sigmoid",
    ),
    "expert_bias_softmax": (
        {**MOE, "model.moe_router_enable_expert_bias": True},
        1,
        "model.num_experts",
        "score_function=sigmoid",
    ),
    "top1_softmax": ({**MOE, "model.moe_router_topk": 1}, 1, "model.num_experts", "needs model.moe_router_pre_softmax"),
    "sinkhorn_aux_loss": (
        {**MOE, "model.moe_router_load_balancing_type": "sinkhorn", "model.moe_aux_loss_coeff": 0.01},
        1,
        "model.num_experts",
        "sinkhorn takes no aux loss",
    ),
    "groups_alone": ({**MOE, "model.moe_router_num_groups": 2}, 1, "model.num_experts", "go together"),
    "groups_vs_experts": (
        {**MOE, "model.moe_router_num_groups": 3, "model.moe_router_group_topk": 1},
        1,
        "model.num_experts",
        "(3) must divide model.num_experts (4)",
    ),
    "group_topk_vs_groups": (
        {**MOE, "model.moe_router_num_groups": 2, "model.moe_router_group_topk": 4},
        1,
        "model.num_experts",
        "must be <= model.moe_router_num_groups (2)",
    ),
    "topk_vs_groups": (
        {**MOE, "model.moe_router_topk": 3, "model.moe_router_num_groups": 2, "model.moe_router_group_topk": 2},
        1,
        "model.num_experts",
        "must split evenly",
    ),
    "moe_layer_freq_length": (
        {**MOE, "model.moe_layer_freq": "[0,1]"},
        1,
        "model.moe_layer_freq",
        "list expression of 4 0s and 1s",
    ),
    "moe_layer_freq_no_moe": ({**MOE, "model.moe_layer_freq": "[0]*4"}, 1, "model.moe_layer_freq", "at least one 1"),
    "moe_layer_freq_code": (
        {**MOE, "model.moe_layer_freq": "open('x')"},
        1,
        "model.moe_layer_freq",
        "positive integer",
    ),
    "moe_tp_without_sp": (
        {**MOE, "parallel.tp": 2},
        2,
        "parallel.sequence_parallel",
        "needs parallel.sequence_parallel=true",
    ),
    "moe_bias_on_local_layers": (
        {**MOE, "model.add_bias_linear": True},
        1,
        "model.add_bias_linear",
        "needs Transformer Engine",
    ),
    "hybrid_qk_layernorm": (
        {"model.arch": "hybrid", "model.hybrid_pattern": "M*M*", "model.qk_layernorm": True},
        1,
        "model.arch",
        "does not support model.qk_layernorm",
    ),
    "hybrid_learned_positions": (
        {"model.arch": "hybrid", "model.hybrid_pattern": "M*M*", "model.position_embedding_type": "learned_absolute"},
        1,
        "model.arch",
        "it has no position embedding",
    ),
    "topk_scaling_negative": (
        {**MOE, "model.moe_router_topk_scaling_factor": -1.0},
        1,
        "model.moe_router_topk_scaling_factor",
        "> 0",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_model_space_config_is_refused_naming_the_field(name):
    fields, world, field, phrase = BAD[name]
    found = violations(make(**fields), world, "cpu")
    assert any(f == field and phrase in rule for f, rule in found), found


def test_moe_biases_on_transformer_engine_need_tp1():
    fields = {**MOE, "model.add_bias_linear": True, "model.spec": "te", "parallel.tp": 2}
    fields["parallel.sequence_parallel"] = True
    found = violations(make(**fields), 2, "cuda")
    assert ("model.add_bias_linear", "model.add_bias_linear with model.num_experts needs parallel.tp = 1 "
            "(megatron: biases in MoE need expert TP 1)") in found


GOOD = {
    "gpt3_preset": {
        "model.name": "gpt3_tiny",
        **{f"model.{k}": v for k, v in dataclasses.asdict(MODEL_PRESETS["gpt3_tiny"]).items()},
    },
    "mla_pp2": ({**MLA, "parallel.pp": 2}),
    "mla_tp2": ({**MLA, "parallel.tp": 2}),
    "deepseek_router": {
        **MOE,
        "model.moe_router_score_function": "sigmoid",
        "model.moe_router_enable_expert_bias": True,
        "model.moe_router_num_groups": 2,
        "model.moe_router_group_topk": 1,
        "model.moe_shared_expert_intermediate_size": 64,
        "model.moe_layer_freq": "[0]+[1]*3",
    },
    "top1_pre_softmax": {**MOE, "model.moe_router_topk": 1, "model.moe_router_pre_softmax": True},
    "top1_sinkhorn": {**MOE, "model.moe_router_topk": 1, "model.moe_router_load_balancing_type": "sinkhorn"},
    "moe_tp2_sp": {**MOE, "parallel.tp": 2, "parallel.sequence_parallel": True},
    "qwen3_like": {
        "model.qk_layernorm": True,
        "model.add_qkv_bias": True,
        "model.head_dim": 64,
        "model.rope_scaling": "llama3",
    },
}


@pytest.mark.parametrize("name", list(GOOD))
def test_good_model_space_config_passes(name):
    fields = GOOD[name]
    world = 2 if fields.get("parallel.pp") == 2 or fields.get("parallel.tp") == 2 else 1
    assert violations(make(**fields), world, "cpu") == []


# --- plugins: options they are not written for are refused before launch ------------------------

# id -> (plugin, Config fields, blamed field)
PLUGIN_REFUSALS = {
    "dpp_mla": ("dpp", MLA, "model.multi_latent_attention"),
    "dpp_learned_positions": (
        "dpp",
        {"model.position_embedding_type": "learned_absolute"},
        "model.position_embedding_type",
    ),
    "dpp_attention_dropout": ("dpp", {"model.attention_dropout": 0.1}, "model.attention_dropout"),
    "dpp_seq_aux_loss": (
        "dpp",
        {**MOE, "model.moe_router_load_balancing_type": "seq_aux_loss"},
        "model.moe_router_load_balancing_type",
    ),
    "elastic_layernorm": ("elastic", {"model.normalization": "LayerNorm"}, "model.normalization"),
    "elastic_gelu": ("elastic", {"model.activation": "gelu"}, "model.activation"),
    "elastic_biases": ("elastic", {"model.add_qkv_bias": True}, "model.add_bias_linear"),
    "elastic_learned_positions": (
        "elastic",
        {"model.position_embedding_type": "learned_absolute"},
        "model.position_embedding_type",
    ),
    "elastic_mla": ("elastic", MLA, "model.multi_latent_attention"),
    "elastic_shared_expert": (
        "elastic",
        {**MOE, "model.moe_shared_expert_intermediate_size": 32},
        "model.moe_shared_expert_intermediate_size",
    ),
    "elastic_group_routing": (
        "elastic",
        {**MOE, "model.moe_router_num_groups": 2, "model.moe_router_group_topk": 1},
        "model.moe_router_num_groups",
    ),
    "lora_mla": ("lora", MLA, "model.multi_latent_attention"),
    "lora_moe": ("lora", MOE, "model.num_experts"),
}


@pytest.mark.parametrize("name", list(PLUGIN_REFUSALS))
def test_plugin_refuses_what_it_is_not_written_for(name):
    from megatron_ext.config.validate import ConfigError
    from megatron_ext.plugin import registered_plugins

    plugin_name, fields, field = PLUGIN_REFUSALS[name]
    cfg = make(**fields)
    cfg.plugins = [plugin_name]
    plugin = registered_plugins()[plugin_name]()
    with pytest.raises(ConfigError) as refused:
        plugin.check(cfg, 1)
        plugin.check_layout(cfg, 1)
    assert refused.value.field == field and "\n" not in str(refused.value)


@pytest.mark.parametrize("plugin_name", ["dpp", "elastic", "lora"])
def test_plugins_still_take_the_llama_default(plugin_name, tmp_path):
    from megatron_ext.config.validate import ConfigError
    from megatron_ext.plugin import registered_plugins

    cfg = make()
    cfg.plugins = [plugin_name]
    plugin = registered_plugins()[plugin_name]()
    try:
        plugin.check(cfg, 1)
        plugin.check_layout(cfg, 1)
    except ConfigError as refused:  # dpp wants a cost model file: that is not a model-space refusal
        assert refused.field == "dpp.cost_model", refused


INIT_CASES = {"gpt3": dict(dataclasses.asdict(MODEL_PRESETS["gpt3_tiny"]), hidden_dropout=0.0, attention_dropout=0.0)}
INIT_CASES.update({name: fields for name, (fields, _) in OPTIONS.items()})


@pytest.mark.parametrize("name", list(INIT_CASES))
def test_initial_weights_do_not_depend_on_the_process_rng(one_rank_world, name):
    """Every parameter and buffer is drawn from its logical name (models/init.py) or set to a
    constant, never taken from the generator megatron builds with, which differs by layout."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.models.init import init_weights_layout_independent

    model_cfg = dataclasses.replace(ModelConfig(), **INIT_CASES[name])
    states = []
    for process_seed in (1, 2):
        torch.manual_seed(process_seed)
        model_parallel_cuda_manual_seed(process_seed)
        model = build(model_cfg)
        init_weights_layout_independent([model], model.config, seed=1234)
        states.append({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")})
    differ = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
    assert differ == []


# --- RoPE scaling against transformers' ------------------------------------------------------------

# name -> (ModelConfig fields, the same scaling as a transformers LlamaConfig's rope_scaling)
ROPE_SCALINGS = {
    "llama3": (
        dict(rope_scaling="llama3", rope_scaling_factor=8.0, seq_length=256),
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "yarn": (
        dict(
            position_embedding_type="yarn",
            yarn_rotary_scaling_factor=4.0,
            yarn_original_max_position_embeddings=64,
            seq_length=256,
        ),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    # DeepSeek-V3's: its own frequency band and attention scale.
    "yarn_mscale": (
        dict(
            position_embedding_type="yarn",
            yarn_rotary_scaling_factor=40.0,
            yarn_original_max_position_embeddings=16,
            yarn_beta_fast=16.0,
            yarn_beta_slow=2.0,
            yarn_mscale=0.707,
            yarn_mscale_all_dim=1.0,
            seq_length=256,
        ),
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
         "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0},
    ),
}


@pytest.mark.parametrize("name", list(ROPE_SCALINGS))
def test_rope_scaling_equals_transformers(one_rank_world, name):
    """The cos/sin every layer applies (YaRN's with its attention scale) equal transformers'
    for the same scaling."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fields, rope_scaling = ROPE_SCALINGS[name]
    model_cfg = dataclasses.replace(ModelConfig(rotary_base=500000.0), **fields)
    model = build(model_cfg)
    angles = model.rotary_pos_emb(model_cfg.seq_length)
    scale = 1.0
    if isinstance(angles, tuple):  # YaRN: (angles, its attention scale)
        angles, scale = angles[0], _yarn_get_concentration_factor_from_config(model.config)
    head = model_cfg.hidden_size // model_cfg.num_attention_heads
    hf = LlamaConfig(
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        max_position_embeddings=model_cfg.seq_length,
        rope_theta=model_cfg.rotary_base,
        rope_scaling=rope_scaling,
    )
    cos, sin = LlamaRotaryEmbedding(hf)(
        torch.zeros(1, model_cfg.seq_length, head), torch.arange(model_cfg.seq_length)[None]
    )
    angles = angles.reshape(model_cfg.seq_length, head)
    assert torch.allclose(torch.cos(angles) * scale, cos[0], atol=1e-6)
    assert torch.allclose(torch.sin(angles) * scale, sin[0], atol=1e-6)
