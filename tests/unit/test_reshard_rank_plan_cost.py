"""What a rank's own plan costs: skeletons that hold no memory, and sends that fill only the
destinations whose sender rule can pick the rank (rank_plan's exactness is
test_reshard_plan.py's property test)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.reshard import plan as planner
from megatron_ext.parallel.layout import ParallelLayout as L
from megatron_ext.reshard.skeleton import build_skeleton, standalone_world
from megatron_ext.reshard.vps import model_key

TINY = dataclasses.replace(MODEL_PRESETS["llama_tiny"], vocab_size=256)
MOE = dataclasses.replace(MODEL_PRESETS["llama_moe_tiny"], vocab_size=256)


@pytest.mark.parametrize("model, layout", [(TINY, L(tp=2, pp=2, dp=2)), (MOE, L(dp=2, ep=2))], ids=["dense", "moe"])
def test_skeletons_hold_their_parameters_and_ddp_buffers_on_the_meta_device(model, layout):
    with standalone_world():
        skeleton = build_skeleton(model, layout, layout.active - 1)
    tensors = [t for chunk in skeleton.chunks for t in [*chunk.parameters(), *chunk.buffers()]]
    buffers = [b for ddp in skeleton.ddp for b in [*ddp.buffers, *ddp.expert_parallel_buffers]]
    tensors += [t for b in buffers for t in (b.param_data, b.grad_data) if t is not None]
    assert tensors and buffers
    assert all(t.is_meta for t in tensors)


# name -> (model, A, B): destinations with many DP replicas drawing on one replicated source.
MOVES = {
    "dp4->dp8": (TINY, L(dp=4), L(dp=8)),
    "tp2·dp2->tp2·dp4": (TINY, L(tp=2, dp=2), L(tp=2, dp=4)),
    "pp2·dp2->dp8": (TINY, L(pp=2, dp=2), L(dp=8)),
}


@pytest.mark.parametrize("name", list(MOVES))
def test_sends_fill_only_the_weight_replicas_that_draw_on_the_rank(name, monkeypatch):
    """A weight held by one source group (its DP replicas) is sent by the group's rank at the
    destination's replica index mod the group's size: every such weight a rank's sends fill
    gets an op from that rank, where filling every replica that meets its pieces would fill
    the others' too. (Weights replicated over TP or tied have several groups to pick from.)"""
    model, a, b = MOVES[name]
    filled = []
    fill = planner._Fills.fill
    monkeypatch.setattr(planner._Fills, "fill", lambda self, target: filled.append(target) or fill(self, target))
    for rank in range(a.active):
        fills = planner._Fills(model_key(model), a, b)
        filled.clear()
        with standalone_world():
            sent = fills.sends(rank)

        weights = {t for t in filled if _one_source_group(fills, t)}
        assert weights, (name, rank)
        assert weights == {op.target for op in sent if _one_source_group(fills, op.target)}, (name, rank)


def _one_source_group(fills, target) -> bool:
    """A weight whose holders in layout A are one group of DP replicas."""
    return target.state == "param" and len(fills.holders(True, target.name, target.state, target.box)) == 1
