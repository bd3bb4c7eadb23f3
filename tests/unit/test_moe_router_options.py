"""Megatron-LM's --moe-z-loss-coeff, --moe-router-force-load-balancing and the flex dispatcher,
checked on a trainer's real training step: the z-loss megatron adds is ST-MoE's
mean(logsumexp(logits)^2), computed here by hand on the logits of the router's own gating; forced
balancing spreads tokens evenly where the router's weights send every token to the same experts;
flex without DeepEP/HybridEP builds the alltoall dispatcher's config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.config import compose_config
from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models.gpt import transformer_config
from megatron_ext.platform.launch import join_world
from megatron_ext.training.trainer import Trainer

EXPERTS, TOPK, MBS, SEQ = 4, 2, 4, 32
COMMON = [
    "experiment=none",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    f"model.seq_length={SEQ}",
    f"model.num_experts={EXPERTS}",
    f"model.moe_router_topk={TOPK}",
    "model.moe_ffn_hidden_size=64",
    f"train.micro_batch_size={MBS}",
    f"train.global_batch_size={MBS}",
    "launcher.nproc=1",
]


def one_step(overrides: list[str], tmp_path, zero_router: bool = False) -> dict:
    """One training step; per router: its gating logits (recomputed from its input) and the
    tokens routed to each expert; and megatron's tracked z-loss per layer."""
    join_world("cpu")
    trainer = Trainer(compose_config([*COMMON, f"data.cache_dir={tmp_path}", *overrides]))
    seen = []

    def capture(router, args, output):
        with torch.no_grad():
            logits = torch.nn.functional.linear(args[0].reshape(-1, args[0].shape[-1]), router.weight)
        seen.append({"logits": logits, "per_expert": output[1].sum(dim=0)})

    try:
        trainer.setup()
        routers = [m for m in trainer.model[0].modules() if isinstance(m, TopKRouter)]
        for r in routers:
            if zero_router:  # equal logits: every token goes to the same TOPK experts
                r.weight.data.zero_()
            r.register_forward_hook(capture)
        clear_aux_losses_tracker()
        trainer.train_step()
        tracked = get_moe_layer_wise_logging_tracker().get("z_loss", {}).get("values")
        return {"routers": seen, "z_loss": None if tracked is None else tracked.clone()}
    finally:
        clear_aux_losses_tracker()
        trainer.close()
        dist.destroy_process_group()


def test_z_loss_is_st_moe_mean_squared_logsumexp_of_the_router_logits(tmp_path):
    step = one_step(["model.moe_z_loss_coeff=1e-3"], tmp_path)
    assert len(step["routers"]) == 2
    by_hand = torch.stack([torch.logsumexp(r["logits"], dim=-1).square().mean() for r in step["routers"]])
    assert step["z_loss"] is not None
    torch.testing.assert_close(step["z_loss"], by_hand, rtol=1e-6, atol=0)


def test_no_z_loss_without_the_coefficient(tmp_path):
    tracked = one_step([], tmp_path)["z_loss"]
    assert tracked is None or not tracked.any()  # megatron's tracker zeroes, not drops, its entries


def test_forced_balancing_spreads_tokens_evenly(tmp_path):
    mean = MBS * SEQ * TOPK / EXPERTS
    skewed = one_step([], tmp_path, zero_router=True)
    for r in skewed["routers"]:  # the reference: equal logits pick the same experts every time
        assert sorted(r["per_expert"].tolist()) == [0, 0, MBS * SEQ, MBS * SEQ]
    forced = one_step(["model.moe_router_force_load_balancing=true"], tmp_path, zero_router=True)
    for r in forced["routers"]:
        counts = r["per_expert"].float()
        assert counts.sum() == MBS * SEQ * TOPK
        assert ((counts - mean).abs() <= 0.25 * mean).all(), counts


def settings(config) -> dict:
    """A TransformerConfig's values; init functions (new partial objects each build) aside."""
    return {k: v for k, v in dataclasses.asdict(config).items() if not callable(v)}


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_flex_dispatcher_without_its_kernels_is_alltoall(backend):
    moe = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_experts=EXPERTS, moe_ffn_hidden_size=64)
    flex = ModelConfig(**moe, moe_token_dispatcher="flex", moe_flex_dispatcher_backend=backend)
    alltoall = ModelConfig(**moe, moe_token_dispatcher="alltoall")
    built = transformer_config(flex, ParallelConfig(), on_cpu=True)
    assert built.moe_token_dispatcher_type == "alltoall"
    assert settings(built) == settings(transformer_config(alltoall, ParallelConfig(), on_cpu=True))
