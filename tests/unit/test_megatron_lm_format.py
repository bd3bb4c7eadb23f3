"""Checkpoints hold what Megatron-LM 0.16's `save_checkpoint` holds: its top-level keys in
common.pt, an `args` Namespace with the fields Megatron-LM's loaders read, the scheduler in
samples, content metadata; the runtime's own state under one extra key. A checkpoint of the
runtime's earlier layout (everything under `common`) still resumes, bitwise.

The field lists below are what Megatron-LM's megatron/training/checkpointing.py (tag
core_v0.16.1) reads from a checkpoint's args: `check_checkpoint_args`, `load_args_from_checkpoint`
(model, tokenizer, checkpoint and parallel fields) and `load_checkpoint` (counters, layout)."""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron_ext.checkpointing import torch_dist as ckpt
from megatron_ext.checkpointing.megatron_lm import (
    OLD_LAYOUT_METADATA,
    scheduler_from_samples,
    scheduler_to_samples,
)
from megatron_ext.config.moe_pattern import moe_layer_pattern
from megatron_ext.config.mlm_namespace import RunFacts, megatron_lm_args, model_config
from megatron_ext.config.schema import Config, ModelConfig
from megatron_ext.config import compose_config
from megatron_ext.platform.launch import join_world
from megatron_ext.train import run_from_overrides
from megatron_ext.training.trainer import Trainer

CHECKED = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding", "max_position_embeddings",
           "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type", "data_parallel_random_init",
           "phase_transition_iterations", "tensor_model_parallel_size", "pipeline_model_parallel_size")
READ_BY_LOAD_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
    "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
    "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout", "hybrid_override_pattern",
    "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_token_dispatcher_type",
    "moe_router_pre_softmax", "moe_grouped_gemm", "moe_shared_expert_intermediate_size",
    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
    "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "is_hybrid_model",
    "tokenizer_model", "tokenizer_type", "padded_vocab_size", "ckpt_format", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "expert_model_parallel_size",
)
READ_BY_LOAD = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples", "world_size",
                "data_parallel_size", "no_save_rng", "no_save_optim", "ckpt_fully_parallel_save")
TOP_LEVEL = {"args", "checkpoint_version", "iteration", "opt_param_scheduler", "num_floating_point_operations_so_far"}

ITERS = 3
TINY = [
    "experiment=none", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.seq_length=32", "train.micro_batch_size=2",
    "train.global_batch_size=4", "train.eval_interval=0", "logging.progress_bar=false", "launcher.nproc=1",
    "optim.lr_warmup_iters=2",
]


def _facts(gbs: int = 8) -> RunFacts:
    return RunFacts(world_size=4, data_parallel_size=2, padded_vocab_size=512, global_batch_size=gbs,
                    iteration=7, consumed_train_samples=7 * gbs)


MODELS = {
    "llama_tiny": ModelConfig(),
    "gpt3": ModelConfig(normalization="LayerNorm", activation="gelu", position_embedding_type="learned_absolute",
                        add_bias_linear=True, tie_embeddings=True, hidden_dropout=0.1, attention_dropout=0.1),
    "moe": ModelConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_layer_freq="([0]+[1])*2",
                       moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid"),
    "mla": ModelConfig(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                       qk_pos_emb_head_dim=8, v_head_dim=16, position_embedding_type="yarn"),
    "gqa_untied": ModelConfig(num_query_groups=2, tie_embeddings=False, head_dim=64, rotary_base=500000.0),
}


@pytest.mark.parametrize("name", MODELS)
def test_args_name_every_field_megatron_lm_reads_and_give_the_model_back(name):
    model = MODELS[name]
    args = megatron_lm_args(Config(model=model), _facts())
    missing = [f for f in (*CHECKED, *READ_BY_LOAD_ARGS, *READ_BY_LOAD) if not hasattr(args, f)]
    assert not missing, f"args lacks {missing}"
    back = model_config(args, base=dataclasses.replace(ModelConfig(), name=model.name))
    # Megatron-LM keeps a layer-frequency expression as the list it makes: the same layers
    if model.num_experts is not None:
        assert moe_layer_pattern(back) == moe_layer_pattern(model)
        back = dataclasses.replace(back, moe_layer_freq=model.moe_layer_freq)
    assert back == model, {f.name: (getattr(back, f.name), getattr(model, f.name))
                           for f in dataclasses.fields(ModelConfig) if getattr(back, f.name) != getattr(model, f.name)}


def test_megatron_lm_spellings_read_back():
    """What Megatron-LM's own parser leaves in args for a GPT-3 model without GQA: one query group."""
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
                              group_query_attention=False, num_query_groups=1, swiglu=False, squared_relu=False,
                              disable_bias_linear=False, untie_embeddings_and_output_weights=False,
                              moe_layer_freq=1, moe_aux_loss_coeff=[0.0])
    model = model_config(args)
    assert (model.num_query_groups, model.head_dim, model.activation) == (None, None, "gelu")
    assert (model.add_bias_linear, model.tie_embeddings, model.moe_layer_freq, model.moe_aux_loss_coeff) == (True, True, "1", 0.0)


def test_the_scheduler_converts_to_samples_and_back_exactly():
    state = {"max_lr": 3e-4, "lr_warmup_steps": 5, "num_steps": 37, "lr_decay_style": "cosine",
             "lr_decay_steps": 100, "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
             "wd_incr_steps": 100}
    samples = scheduler_to_samples(state, 48)
    assert (samples["num_steps"], samples["lr_warmup_steps"], samples["lr_decay_steps"]) == (37 * 48, 5 * 48, 100 * 48)
    back = scheduler_from_samples(samples, 48)
    assert back == state and all(type(back[k]) is type(state[k]) for k in state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("format")
    base = [*TINY, f"data.cache_dir={tmp / 'cache'}"]
    run_from_overrides([*base, f"train.iters={ITERS}", f"checkpoint.save={tmp / 'run'}"])
    return tmp, base


def test_a_save_holds_megatron_lms_top_level_keys_and_metadata(saved):
    tmp, _ = saved
    folder = ckpt.iteration_dir(tmp / "run", ITERS)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    assert TOP_LEVEL <= set(common) and "megatron_ext" in set(common)
    assert "common" not in common  # the earlier layout's single key
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == ITERS
    args = common["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.consumed_train_samples, args.global_batch_size, args.train_iters) == (ITERS * 4, 4, ITERS)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size) == (1, 1, 1)
    assert common["opt_param_scheduler"]["num_steps"] == ITERS * 4  # samples, as Megatron-LM counts
    assert common["opt_param_scheduler"]["lr_warmup_steps"] == 2 * 4
    assert common["num_floating_point_operations_so_far"] > 0
    metadata = dist_checkpointing.load_content_metadata(str(folder))
    assert metadata == {"distrib_optim_sharding_type": "fully_reshardable",
                        "distrib_optim_fully_reshardable_mem_efficient": False,
                        "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    assert {"optimizer", "rng_state", "decoder", "embedding"} <= ckpt.held_states(tmp / "run", ITERS)


def _resumed(overrides: list[str], then=None) -> dict:
    """Weights, Adam moments, counters, lr-schedule steps and torch's RNG state of a trainer set
    up from `overrides` (before any step); `then(trainer)` runs on it before it is closed."""
    join_world("cpu")
    trainer = Trainer(compose_config(overrides))
    try:
        trainer.setup()
        state = trainer.optimizer.optimizer.state.values()
        result = {
            "weights": [p.detach().clone() for m in trainer.model for p in m.parameters()],
            "moments": [s[k].clone() for s in state for k in ("exp_avg", "exp_avg_sq") if k in s],
            "counters": (trainer.state.iteration, trainer.state.consumed_samples),
            "scheduler": trainer.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }
        if then is not None:
            result["written"] = then(trainer)
        return result
    finally:
        trainer.close()
        dist.destroy_process_group()


def _write_in_the_earlier_layout(root):
    """What the runtime wrote before: the plain state as one `common` dictionary (scheduler in
    iterations), the RNG as one dict of its own names per (pp, tp), no content metadata."""

    def write(trainer) -> torch.Tensor:
        state = ckpt.sharded_state_dict(trainer.model, trainer.optimizer, OLD_LAYOUT_METADATA)
        state["rng_state"] = ShardedObject(
            "rng_state",
            {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": None, "tracker": get_cuda_rng_tracker().get_states()},
            (1, 1), (0, 0), replica_id=0,
        )
        state["common"] = trainer.common_state()
        ckpt.write_staged(root, ITERS, lambda folder: dist_checkpointing.save(state, str(folder)))
        return torch.get_rng_state()

    return write


def test_a_checkpoint_of_the_earlier_layout_resumes_to_the_same_state(saved, tmp_path):
    tmp, base = saved
    resume = [*base, f"train.iters={2 * ITERS}"]
    new = _resumed([*resume, f"checkpoint.load={tmp / 'run'}"], then=_write_in_the_earlier_layout(tmp_path / "old"))
    assert dist_checkpointing.load_content_metadata(str(ckpt.iteration_dir(tmp_path / "old", ITERS))) is None
    old = _resumed([*resume, f"checkpoint.load={tmp_path / 'old'}"])
    assert all(torch.equal(a, b) for a, b in zip(old["weights"], new["weights"])) and old["weights"]
    assert all(torch.equal(a, b) for a, b in zip(old["moments"], new["moments"])) and old["moments"]
    assert old["counters"] == new["counters"] == (ITERS, ITERS * 4)
    assert old["scheduler"] == new["scheduler"]
    assert torch.equal(old["rng"], new["written"])


MEGATRON_LM_FIXTURE = Path(__file__).parents[1] / "fixtures" / "megatron_lm" / "gpt3_tp2pp2_dp_reshardable" / "iter_0000003"


def test_a_save_has_the_keys_metadata_and_args_fields_megatron_lms_own_save_has(saved):
    """Against a checkpoint Megatron-LM's own save_checkpoint wrote: the same top-level keys and
    content-metadata keys, and every args field its loaders read, of the same type."""
    tmp, _ = saved
    ours = dist_checkpointing.load_common_state_dict(str(ckpt.iteration_dir(tmp / "run", ITERS)))
    theirs = dist_checkpointing.load_common_state_dict(str(MEGATRON_LM_FIXTURE))
    plain = {k for k in theirs if k not in ("optimizer", "model")}  # non-tensor parts of sharded entries
    assert plain <= set(ours), plain - set(ours)
    assert set(theirs["content_metadata"]) <= set(ours["content_metadata"])
    wrong = {
        field: (type(getattr(ours["args"], field)).__name__, type(getattr(theirs["args"], field)).__name__)
        for field in (*CHECKED, *READ_BY_LOAD_ARGS, *READ_BY_LOAD)
        if None not in (getattr(ours["args"], field), getattr(theirs["args"], field, None))
        and type(getattr(ours["args"], field)) is not type(getattr(theirs["args"], field))
    }
    assert not wrong, wrong
