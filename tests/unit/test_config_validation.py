"""Config validation: one named bad config per rule, a table of good ones, and the CLI contract."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.config import Config
from megatron_ext.platform import optional
from megatron_ext.config.validate import (
    ConfigError,
    resolve_dp,
    validate,
    violations,
    world_size_of,
)

REPO = Path(__file__).resolve().parents[2]


def make(**fields) -> Config:
    """A default Config with dotted fields replaced: make(**{"parallel.tp": 2})."""
    cfg = Config()
    for path, value in fields.items():
        *section, name = path.split(".")
        owner = getattr(cfg, section[0]) if section else cfg
        setattr(owner, name, value)
    return cfg


# (id, fields, world size, device,
#  blamed field, key phrase of the rule)
BAD = [
    ("tp_zero", {"parallel.tp": 0}, 1, "cpu",
     "parallel.tp", "positive integer"),
    ("gbs_zero", {"train.global_batch_size": 0}, 1, "cpu",
     "train.global_batch_size", "positive"),
    ("world_zero", {}, 0, "cpu",
     "launcher.nproc", "world size must be a positive"),
    ("heads_vs_tp", {"parallel.tp": 4, "model.num_attention_heads": 6, "model.hidden_size": 48},
     4, "cpu",
     "parallel.tp", "model.num_attention_heads (6) must be divisible by parallel.tp (4)"),
    ("groups_vs_heads", {"model.num_attention_heads": 8, "model.num_query_groups": 3}, 1, "cpu",
     "model.num_query_groups", "must divide model.num_attention_heads (8)"),
    ("groups_vs_tp", {"parallel.tp": 4, "model.num_attention_heads": 8,
                      "model.num_query_groups": 2}, 4, "cpu",
     "model.num_query_groups", "(2) must be divisible by parallel.tp (4)"),
    ("hidden_vs_heads", {"model.hidden_size": 130}, 1, "cpu",
     "model.hidden_size", "divisible by model.num_attention_heads"),
    ("layers_vs_pp", {"model.num_layers": 5, "parallel.pp": 2}, 2, "cpu",
     "model.num_layers", "divisible by parallel.pp (2)"),
    ("layers_vs_vpp", {"model.num_layers": 4, "parallel.pp": 2, "parallel.vpp": 4}, 2, "cpu",
     "model.num_layers", "parallel.pp * parallel.vpp (2 * 4 = 8)"),
    ("vpp_without_pp", {"parallel.vpp": 2}, 1, "cpu",
     "parallel.vpp", "requires parallel.pp > 1"),
    ("vpp_micro_batches", {"parallel.pp": 2, "parallel.vpp": 2, "model.num_layers": 8,
                           "train.global_batch_size": 12}, 2, "cpu",
     "train.global_batch_size", "= 3) must be divisible by parallel.pp (2)"),
    ("last_stage_zero", {"parallel.pp": 2, "parallel.last_stage_layers": 0}, 2, "cpu",
     "parallel.last_stage_layers", "positive integer or null"),
    ("uneven_without_pp", {"parallel.first_stage_layers": 1}, 1, "cpu",
     "parallel.first_stage_layers", "(uneven pipeline stages) requires parallel.pp > 1"),
    ("uneven_rest_vs_stages", {"model.num_layers": 6, "parallel.pp": 3,
                               "parallel.first_stage_layers": 1}, 3, "cpu",
     "model.num_layers", "(6 - 1 = 5) must be a positive multiple of the other pipeline stages"),
    ("uneven_first_takes_all", {"parallel.pp": 2, "parallel.first_stage_layers": 4}, 2, "cpu",
     "model.num_layers", "(4 - 4 = 0) must be a positive multiple"),
    ("uneven_ends_vs_layers", {"parallel.pp": 2, "parallel.first_stage_layers": 1,
                               "parallel.last_stage_layers": 2}, 2, "cpu",
     "model.num_layers", "(4 - 1 - 2 = 1) must be 0: parallel.pp (2) has no stage besides"),
    ("uneven_first_vs_vpp", {"model.num_layers": 9, "parallel.pp": 2, "parallel.vpp": 2,
                             "parallel.first_stage_layers": 1}, 2, "cpu",
     "parallel.first_stage_layers", "(1) must be divisible by parallel.vpp (2)"),
    ("uneven_middle_vs_vpp", {"model.num_layers": 7, "parallel.pp": 3, "parallel.vpp": 2,
                              "parallel.first_stage_layers": 2, "parallel.last_stage_layers": 2},
     3, "cpu",
     "model.num_layers", "/ 1 = 3) must be divisible by parallel.vpp (2)"),
    ("uneven_both_ends_vpp_pp2", {"model.num_layers": 8, "parallel.pp": 2, "parallel.vpp": 2,
                                  "parallel.first_stage_layers": 2,
                                  "parallel.last_stage_layers": 6}, 2, "cpu",
     "parallel.vpp", "needs parallel.pp > 2"),
    ("world_vs_dp", {"parallel.dp": 2}, 4, "cpu",
     "parallel.dp", "(1 * 1 * 2 * 1 = 2) must equal the world size (4)"),
    ("pool_smaller_than_layout", {"parallel.dp": 8, "plugins": ["reshard"]}, 4, "cpu",
     "parallel.dp", "must be at most the world size (4)"),
    ("world_vs_model", {"parallel.tp": 2, "parallel.pp": 2}, 6, "cpu",
     "launcher.nproc", "world size (6"),
    ("experts_vs_ep", {"model.num_experts": 6, "parallel.ep": 4}, 4, "cpu",
     "model.num_experts", "(6) must be divisible by parallel.ep (4)"),
    ("ep_without_experts", {"parallel.ep": 2}, 2, "cpu",
     "parallel.ep", "requires model.num_experts"),
    ("ep_vs_dp_cp", {"model.num_experts": 4, "parallel.ep": 4, "parallel.tp": 2}, 4, "cpu",
     "parallel.ep", "must divide dp * cp (2 * 1 = 2)"),
    ("topk_vs_experts", {"model.num_experts": 2, "model.moe_router_topk": 4}, 1, "cpu",
     "model.moe_router_topk", "must be <= model.num_experts (2)"),
    ("gbs_vs_mbs_dp", {"train.global_batch_size": 30, "train.micro_batch_size": 4}, 2, "cpu",
     "train.global_batch_size", "micro_batch_size * dp (4 * 2 = 8)"),
    ("sp_without_tp", {"parallel.sequence_parallel": True}, 1, "cpu",
     "parallel.sequence_parallel", "requires parallel.tp > 1"),
    ("sp_seq_vs_tp", {"parallel.tp": 2, "parallel.sequence_parallel": True, "model.seq_length": 65},
     2, "cpu",
     "model.seq_length", "divisible by parallel.tp * parallel.cp (2 * 1)"),
    ("warmup_vs_decay", {"optim.lr_warmup_iters": 300}, 1, "cpu",
     "optim.lr_warmup_iters", "< the lr decay iters (200)"),
    ("warmup_init_above_lr", {"optim.lr_warmup_init": 1.0}, 1, "cpu",
     "optim.lr_warmup_init", "must be >= 0 and <= optim.lr (0.003)"),
    ("precision", {"model.precision": "fp8"}, 1, "cpu",
     "model.precision", "one of fp32, bf16, fp16"),
    ("spec", {"model.spec": "mcore"}, 1, "cpu",
     "model.spec", "one of auto, local, te"),
    ("te_on_cpu", {"model.spec": "te"}, 1, "cpu",
     "model.spec", "needs Transformer Engine and a CUDA device"),
    ("device", {"launcher.device": "tpu"}, 1, "cpu",
     "launcher.device", "one of auto, cpu, cuda"),
    ("restarts", {"launcher.max_restarts": -1}, 1, "cpu",
     "launcher.max_restarts", ">= 0"),
    ("manual_gc_interval", {"train.manual_gc_interval": -5}, 1, "cpu",
     "train.manual_gc_interval", ">= 0, got -5"),
    ("decay_style", {"optim.lr_decay_style": "step"}, 1, "cpu",
     "optim.lr_decay_style", "inverse-square-root"),
    ("dispatcher", {"model.moe_token_dispatcher": "sparse"}, 1, "cpu",
     "model.moe_token_dispatcher", "one of allgather, alltoall, flex"),
    ("unknown_plugin", {"plugins": ["nope"]}, 1, "cpu",
     "plugins", "unknown plugin 'nope'"),
    ("two_step_plugins", {"plugins": ["dpp", "elastic"]}, 1, "cpu",
     "plugins", "dpp and elastic each run the training step"),
    ("layout_change_beside_a_teacher", {"plugins": ["reshard", "elastic"]}, 1, "cpu",
     "plugins", "elastic with reshard is not supported: reshard moves the running job to another layout"),
    ("own_loop_beside_another_plugin", {"plugins": ["dpp", "lora"]}, 1, "cpu",
     "plugins", "lora trains in a loop of its own, not the Trainer's: dpp's hooks would be ignored"),
    ("realtime_test_rmsnorm", {"train.test_mode": True, "model.qk_layernorm": True,
                               "model.normalization": "RMSNorm"}, 1, "cpu",
     "train.test_mode", "RMSNorm has no bias"),
]


@pytest.mark.parametrize(
    "fields, world, device, field, phrase", [c[1:] for c in BAD], ids=[c[0] for c in BAD]
)
def test_bad_config_names_field_and_rule(fields, world, device, field, phrase):
    with pytest.raises(ConfigError) as info:
        validate(make(**fields), world, device)
    assert info.value.field == field
    assert phrase in info.value.rule
    assert str(info.value).startswith(f"{field}: ")


# (id, fields, world size, device)
GOOD = [
    ("defaults", {}, 1, "cpu"),
    ("dp4", {}, 4, "cpu"),
    ("tp3_heads6", {"parallel.tp": 3, "model.num_attention_heads": 6, "model.hidden_size": 96},
     3, "cpu"),
    ("pp3_layers3", {"parallel.pp": 3, "model.num_layers": 3}, 3, "cpu"),
    ("tp2pp2dp2", {"parallel.tp": 2, "parallel.pp": 2}, 8, "cpu"),
    ("explicit_dp", {"parallel.tp": 2, "parallel.dp": 2, "train.global_batch_size": 8}, 4, "cpu"),
    ("vpp", {"parallel.pp": 2, "parallel.vpp": 2, "model.num_layers": 8}, 2, "cpu"),
    ("pp2_first1", {"parallel.pp": 2, "parallel.first_stage_layers": 1}, 2, "cpu"),
    ("pp2_both_ends", {"parallel.pp": 2, "parallel.first_stage_layers": 1,
                       "parallel.last_stage_layers": 3}, 2, "cpu"),
    ("pp3_first1_last1", {"parallel.pp": 3, "parallel.first_stage_layers": 1,
                          "parallel.last_stage_layers": 1}, 3, "cpu"),
    ("pp2_vpp2_last2", {"parallel.pp": 2, "parallel.vpp": 2, "model.num_layers": 6,
                        "parallel.last_stage_layers": 2}, 2, "cpu"),
    ("moe_ep2", {"model.num_experts": 4, "parallel.ep": 2}, 2, "cpu"),
    ("sp_on_hybrid", {"model.arch": "hybrid", "model.num_layers": 2, "model.hybrid_pattern": "*-",
                      "parallel.tp": 2, "parallel.sequence_parallel": True}, 2, "cpu"),
    # Sequence parallelism on megatron's local layers (LocalNorm), alone and under MoE / CP.
    ("sp_on_local_layers", {"parallel.tp": 2, "parallel.sequence_parallel": True}, 2, "cpu"),
    ("sp_moe_tp2", {"model.num_experts": 4, "parallel.tp": 2, "parallel.sequence_parallel": True},
     2, "cpu"),
    ("sp_tp2_cp2", {"parallel.tp": 2, "parallel.cp": 2, "parallel.sequence_parallel": True}, 4, "cpu"),
    ("gqa_smollm_like", {"parallel.tp": 3, "model.num_attention_heads": 9,
                         "model.num_query_groups": 3, "model.hidden_size": 576}, 3, "cpu"),
    ("gbs_derived", {"train.global_batch_size": None}, 3, "cpu"),
    ("pool_with_standby", {"parallel.dp": 2, "plugins": ["reshard"]}, 4, "cpu"),
    ("reshard_beside_a_step_plugin", {"plugins": ["reshard", "dpp"]}, 1, "cpu"),
    ("alltoall_on_cuda", {"model.num_experts": 4, "model.moe_token_dispatcher": "alltoall"},
     1, "cuda"),
    # The platform layer maps the all-to-all dispatcher's CUDA uses (cpu_compat.py).
    ("alltoall_on_cpu", {"model.num_experts": 4, "model.moe_token_dispatcher": "alltoall"},
     1, "cpu"),
    ("realtime_test_layernorm", {"train.test_mode": True, "model.qk_layernorm": True,
                                 "model.normalization": "LayerNorm"}, 1, "cpu"),
    # MLA's attention does not run the test.
    ("realtime_test_mla", {"train.test_mode": True, "model.qk_layernorm": True,
                           "model.multi_latent_attention": True, "model.q_lora_rank": 32,
                           "model.kv_lora_rank": 16, "model.qk_head_dim": 16,
                           "model.qk_pos_emb_head_dim": 8, "model.v_head_dim": 16}, 1, "cpu"),
]


@pytest.mark.parametrize(
    "fields, world, device", [case[1:] for case in GOOD], ids=[case[0] for case in GOOD]
)
def test_good_config_passes(fields, world, device):
    validate(make(**fields), world, device)


@pytest.mark.parametrize("spec", ["te", "auto"])
def test_sequence_parallel_on_te_layers(monkeypatch, spec):
    monkeypatch.setattr(optional, "HAVE_TE", True)
    cfg = make(**{"parallel.tp": 2, "parallel.sequence_parallel": True, "model.spec": spec})
    validate(cfg, 2, "cuda")


# Context parallelism runs on Transformer Engine attention (CUDA) and on the local layers.
CP_GOOD = [
    ("cp2", {"parallel.cp": 2}, 2),
    ("moe_ep_over_dp_cp", {"model.num_experts": 4, "parallel.ep": 4, "parallel.cp": 2}, 4),
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("fields, world", [c[1:] for c in CP_GOOD], ids=[c[0] for c in CP_GOOD])
def test_context_parallel(monkeypatch, fields, world, device):
    monkeypatch.setattr(optional, "HAVE_TE", device == "cuda")
    validate(make(**fields), world, device)


def test_seq_length_vs_cp(monkeypatch):
    monkeypatch.setattr(optional, "HAVE_TE", True)
    with pytest.raises(ConfigError) as err:
        validate(make(**{"parallel.cp": 2, "model.seq_length": 130}), 2, "cuda")
    assert err.value.field == "model.seq_length" and "2 * parallel.cp (4)" in err.value.rule


def test_all_violations_reported_one_per_line():
    cfg = make(**{"parallel.vpp": 2, "model.precision": "fp8"})
    found = violations(cfg, 1, "cpu")
    assert [f for f, _ in found] == ["parallel.vpp", "model.precision"]
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1, "cpu")
    assert str(info.value).splitlines() == [f"{f}: {r}" for f, r in found]


def test_resolve_dp():
    assert resolve_dp(make(**{"parallel.tp": 2, "parallel.pp": 2}), 8) == 2
    assert resolve_dp(make(**{"parallel.dp": 3}), 3) == 3
    with pytest.raises(ConfigError, match="launcher.nproc: world size"):
        resolve_dp(make(**{"parallel.tp": 2}), 3)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, 4),
        ({"RANK": "0", "WORLD_SIZE": "8"}, 8),
        ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "16", "MASTER_ADDR": "n1", "MASTER_PORT": "1"}, 16),
        # One Slurm task (python run directly in a batch script) starts its own local workers.
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, 4),
    ],
    ids=["local", "torchrun", "srun", "single_slurm_task"],
)
def test_world_size_of(monkeypatch, env, expected):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert world_size_of(make(**{"launcher.nproc": 4})) == expected


def test_cli_rejects_bad_override_before_writing_anything(tmp_path):
    # The default experiment is TP2 x PP2 on 4 processes: dp = 1, so 6 is not a multiple of 4 * 1.
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE" and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [
            sys.executable, "-m", "megatron_ext.train",
            "train.global_batch_size=6",
            f"hydra.run.dir={tmp_path}/out",
            f"checkpoint.save={tmp_path}/ckpt",
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: train.global_batch_size: train.global_batch_size (6) must be divisible by "
        "train.micro_batch_size * dp (4 * 1 = 4)"
    ]
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "ckpt").exists()


# overrides -> the plugins the composed config switches on: a plugin preset chosen on the
# command line sets them over the experiment's (the default experiment's is reshard)
@pytest.mark.parametrize("overrides, plugins", [
    ([], ["reshard"]),
    (["plugin=elastic"], ["elastic"]),
    (["experiment=none", "plugin=dpp"], ["dpp"]),
    (["experiment=lora_sweep"], ["lora"]),
], ids=["default", "preset_over_default_experiment", "preset_over_none", "lora_sweep"])
def test_a_chosen_plugin_preset_is_not_overridden_by_the_experiment(overrides, plugins):
    from megatron_ext.config import compose_config

    assert compose_config(overrides).plugins == plugins
