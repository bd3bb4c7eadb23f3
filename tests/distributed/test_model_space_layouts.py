"""Every option of megatron's GPT model space trains the same at TP=2 and at PP=2 as on one rank.

Each named case is a tiny model with one option (or a few together) changed from the LLaMA-style
default. It trains a few fp32 steps on one rank (the reference), then in one two-rank world at
TP=2 and at PP=2, from the same layout-independent initial weights on the same batches. The
losses of every step and every trained weight, put together whole from the ranks' shards
(sharded-state-dict boxes), must equal the reference's up to fp32 reduction order. A wrong
split (a bias or norm not marked replicated, a QK-norm gradient not reduced over TP, a dense /
MoE layer pattern read at the wrong pipeline offset, an initialisation that depends on the
layout) shows as a different loss or weight. Each case's one-rank losses must also differ from
those of its baseline (the LLaMA default, or plain MoE for router options), so an option the
builder ignored cannot pass; grouped GEMM, which runs megatron's SequentialMLP on CPU, must
equal plain MoE exactly.

MoE layers run at TP=2 with sequence parallelism (megatron's MoE layer needs it), and the cases
with a load-balancing loss at CP=2 too. Two things cannot match by design and are left out:
dropout (megatron draws its masks from per-TP-rank generators: its cases run with dropout 0,
and tests/unit/test_model_space.py checks the dropout modules), sinkhorn balancing under TP/CP
(it balances over the tokens a rank holds; checked at PP=2 and DP=2). MLA runs at TP=2 with and
without sequence parallelism too (its gradients at TP=2 x PP=2 and after one step:
test_mla_tensor_parallel.py). All cases of a world run in one launch; the default suite runs a
few combined cases that together set every option, `-m slow` one case per option.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import _tiny_sgd as tiny_sgd
from _logical_shards import weight_shards, whole
from _tiny_sgd import STEPS

# Plain SGD (_tiny_sgd.py): a weight's change is the learning rate times its gradients, so a
# wrong gradient shows in proportion (Adam's first steps move every weight by about the learning
# rate, whatever the gradient's size: a gradient near zero moves by its rounding noise).
# fp32 runs that differ only in the order of reductions (TP splits the GEMMs, PP the loss sum).
LOSS_RTOL = 1e-5
# Measured up to 6e-7 after 3 steps at LR; the wrong gradients these cases caught moved weights
# by 1e-5 to 1e-3.
WEIGHT_ATOL = 2e-6

MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
MLA = dict(
    multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16
)
GPT3 = dict(
    normalization="LayerNorm",
    activation="gelu",
    ffn_hidden_size=256,
    position_embedding_type="learned_absolute",
    add_bias_linear=True,
)
# name -> ModelConfig fields changed from BASE
CASES = {
    # The default suite: together they set every option once.
    "gpt3": GPT3,
    "qwen3_like": dict(add_qkv_bias=True, qk_layernorm=True, head_dim=32, rope_scaling="llama3", tie_embeddings=False),
    "partial_rotary_squared_relu": dict(rotary_percent=0.5, activation="squared_relu", normalization="LayerNorm"),
    "moe_deepseek_router": dict(
        **MOE,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.0,
        moe_shared_expert_intermediate_size=48,
        moe_layer_freq="[0,1]",
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.01,
    ),
    "mla": dict(**MLA, qk_layernorm=True),
}
SLOW_CASES = {
    "layernorm": dict(normalization="LayerNorm"),
    "gelu": dict(activation="gelu", ffn_hidden_size=256),
    "squared_relu": dict(activation="squared_relu"),
    "learned_absolute": dict(position_embedding_type="learned_absolute"),
    "no_position": dict(position_embedding_type="none"),
    "rotary_percent": dict(rotary_percent=0.5),
    "llama3_scaling": dict(rope_scaling="llama3"),
    "yarn": dict(
        position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16
    ),
    "bias": dict(add_bias_linear=True),
    "qkv_bias": dict(add_qkv_bias=True),
    "qk_layernorm": dict(qk_layernorm=True),
    "qk_layernorm_gqa": dict(qk_layernorm=True, num_query_groups=2),
    "head_dim": dict(head_dim=32),
    "untied": dict(tie_embeddings=False),
    "gpt3_dropout_0": dict(GPT3, hidden_dropout=0.0, attention_dropout=0.0),
    "mla_no_q_lora": dict(MLA, q_lora_rank=None),
    "mla_yarn": dict(MLA, position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0),
    "moe_aux_loss": dict(**MOE, moe_aux_loss_coeff=0.01),
    "moe_seq_aux_loss": dict(**MOE, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01),
    "moe_sinkhorn": dict(**MOE, moe_router_load_balancing_type="sinkhorn"),
    "moe_no_balancing_pre_softmax": dict(**MOE, moe_router_load_balancing_type="none", moe_router_pre_softmax=True),
    "moe_sigmoid_expert_bias": dict(**MOE, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "moe_group_topk": dict(**MOE, moe_router_num_groups=2, moe_router_group_topk=1),
    "moe_topk_scaling": dict(**MOE, moe_router_topk_scaling_factor=2.0),
    "moe_shared_expert": dict(**MOE, moe_shared_expert_intermediate_size=48),
    "moe_layer_freq_2": dict(**MOE, moe_layer_freq="2"),
    "moe_layer_pattern": dict(**MOE, moe_layer_freq="[0,1]"),
    "moe_grouped_gemm": dict(**MOE, moe_grouped_gemm=True),
}
# What the options change from: each case's one-rank run must differ from its baseline's (the
# option reached the model), except grouped GEMM, which on CPU is the same SequentialMLP math.
BASELINES = {"llama_baseline": {}, "moe_baseline": MOE}
SAME_AS_BASELINE = {"moe_grouped_gemm"}
ALL_CASES = {**CASES, **SLOW_CASES, **BASELINES}


def baseline(case: str) -> str:
    return "moe_baseline" if "num_experts" in ALL_CASES[case] else "llama_baseline"


# name -> the two-rank layouts (ParallelConfig fields) every case runs in
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2)}
# megatron's MoE layer needs sequence parallelism under TP.
MOE_LAYOUTS = {"tp2_sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2)}
# The load-balancing loss is summed over the ranks that split a micro-batch's tokens (TP with
# sequence parallelism, CP): models/gpt.py weighs it as one rank would.
AUX_LOSS_LAYOUTS = {**MOE_LAYOUTS, "cp2": dict(cp=2)}
# Sequence parallelism splits the tokens of LayerNorm's weight and bias gradients, and the
# QK-norms' gradients are reduced over TP for it as for the heads.
SP_LAYOUTS = {**LAYOUTS, "tp2_sp": dict(tp=2, sequence_parallel=True)}


# Sinkhorn balances the routing over the tokens a rank holds, as megatron does: TP with
# sequence parallelism (which MoE needs) and CP hand each rank a part of the micro-batch, so it
# routes differently there by design. Pipeline and data parallelism keep whole micro-batches.
SINKHORN_LAYOUTS = {"pp2": dict(pp=2), "dp2": dict(dp=2)}


def layouts(case: str) -> dict:
    fields = ALL_CASES[case]
    if fields.get("moe_router_load_balancing_type") == "sinkhorn":
        return SINKHORN_LAYOUTS
    if fields.get("moe_aux_loss_coeff"):
        return AUX_LOSS_LAYOUTS
    if "num_experts" in fields:
        return MOE_LAYOUTS
    # MLA's latent norms are split by sequence under sequence parallelism, its rotary key is not.
    return SP_LAYOUTS if case in ("gpt3", "qwen3_like") or fields.get("multi_latent_attention") else LAYOUTS


# --- the worker: every case of one world, one after another -------------------------------


def config(case: str, parallel: dict, cache: str):
    return tiny_sgd.config(case, ALL_CASES[case], parallel, cache)


def run(case: str, parallel: dict, cache: str) -> dict:
    from megatron_ext.config.validate import validate
    from megatron_ext.training.trainer import Trainer

    import torch.distributed as dist

    cfg = config(case, parallel, cache)
    validate(cfg, dist.get_world_size(), "cpu")
    trainer = Trainer(cfg)
    trainer.setup()
    losses = [trainer.train_step_with_loss()["loss"] for _ in range(STEPS)]
    report = {"losses": losses, "weights": weight_shards(trainer.model)}
    trainer.close()
    return report


def worker(out_dir: str, *cases: str) -> None:
    import torch.distributed as dist

    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    cache = str(Path(out_dir, "cache"))
    world = dist.get_world_size()
    for case in cases:
        runs = {"reference": {}} if world == 1 else layouts(case)
        report = {layout: run(case, parallel, cache) for layout, parallel in runs.items()}
        torch.save(report, Path(out_dir, f"{case}_world{world}_rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], *sys.argv[2:])


# --- the tests -----------------------------------------------------------------------------------

pytestmark = pytest.mark.distributed


def launch(out: Path, cases: dict) -> Path:
    from _torchrun import torchrun

    torchrun(__file__, 1, str(out), *cases, *BASELINES)
    torchrun(__file__, 2, str(out), *cases)
    return out


def reference_losses(out: Path, case: str) -> list:
    return torch.load(out / f"{case}_world1_rank0.pt")["reference"]["losses"]


def check(out: Path, case: str) -> None:
    reference = torch.load(out / f"{case}_world1_rank0.pt")["reference"]
    ranks = [torch.load(out / f"{case}_world2_rank{r}.pt") for r in range(2)]
    expected = whole([reference["weights"]], "reference")
    for layout in ranks[0]:
        losses = ranks[0][layout]["losses"]
        assert len(set(reference["losses"])) == STEPS, f"{case}: the reference did not train"
        assert losses == pytest.approx(reference["losses"], rel=LOSS_RTOL), f"{case} {layout}: losses"
        weights = whole([rank[layout]["weights"] for rank in ranks], layout)
        assert weights.keys() == expected.keys(), f"{case} {layout}: other tensors"
        differ = {
            k: (weights[k] - expected[k]).abs().max().item()
            for k in expected
            if not torch.allclose(weights[k], expected[k], atol=WEIGHT_ATOL, rtol=0)
        }
        assert not differ, f"{case} {layout}: weights differ {differ}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    return launch(tmp_path_factory.mktemp("model_space"), CASES)


@pytest.fixture(scope="module")
def launched_slow(tmp_path_factory) -> Path:
    return launch(tmp_path_factory.mktemp("model_space_slow"), SLOW_CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_combined_options_equal_one_rank_at_tp2_and_pp2(launched, case):
    check(launched, case)


@pytest.mark.parametrize("case", list(CASES))
def test_combined_options_change_the_model(launched, case):
    assert reference_losses(launched, case) != reference_losses(launched, baseline(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_each_option_equals_one_rank_at_tp2_and_pp2(launched_slow, case):
    check(launched_slow, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_each_option_changes_the_model(launched_slow, case):
    same = reference_losses(launched_slow, case) == reference_losses(launched_slow, baseline(case))
    assert same == (case in SAME_AS_BASELINE)
