"""ParallelLayout: a value with megatron's rank order and the runtime's validation rules."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_ext.config.validate import ConfigError
from megatron_ext.parallel.layout import ParallelLayout

SIX_HEADS = ModelConfig(num_attention_heads=6, hidden_size=192, ffn_hidden_size=384, vocab_size=384)


def test_rank_order_is_tp_cp_ep_dp_pp():
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    assert [layout.rank_coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [layout.rank_coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [layout.rank_coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    assert layout.ranks_of(pp=1, tp=0) == [4, 6]
    assert layout.group(5, "dp") == [5, 7] and layout.group(5, "pp") == [1, 5]


def test_cp_folds_into_the_optimizer_dp_index_and_experts_have_their_own_grid():
    cp = ParallelLayout(tp=1, cp=2, dp=2)
    assert [cp.rank_coords(r)["dp_cp"] for r in range(4)] == [0, 1, 2, 3]
    moe = ParallelLayout(dp=4, ep=2)
    expert = [(moe.rank_coords(r)["ep"], moe.rank_coords(r)["edp"]) for r in range(4)]
    assert expert == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_standby_ranks_hold_no_coordinates():
    layout = ParallelLayout(tp=2, world=4)
    assert layout.active == 2 and layout.rank_coords(3) == {}
    assert str(layout) == "tp2·pp1·dp1·+2 standby"
    with pytest.raises(ValueError, match="smaller than"):
        ParallelLayout(tp=4, world=2)


def test_from_config_derives_dp_from_the_world():
    layout = ParallelLayout.from_config(ParallelConfig(tp=2, vpp=None), world=8)
    assert (layout.tp, layout.dp, layout.world) == (2, 4, 8)
    assert layout.to_config().dp == 4


def test_from_config_leaves_ranks_standing_by_only_for_a_plugin_that_keeps_standby_workers():
    # An explicit dp=1 at tp2 on a world of 4: the reshard plugin's pool keeps 2 workers on standby.
    pooled = ParallelLayout.from_config(ParallelConfig(tp=2, dp=1), world=4, plugins=["reshard"])
    assert (pooled.active, pooled.world) == (2, 4) and pooled.rank_coords(2) == {}
    with pytest.raises(ConfigError, match=r"must equal the world size \(4\)"):
        ParallelLayout.from_config(ParallelConfig(tp=2, dp=1), world=4)


def test_non_power_of_two_sizes_follow_the_runtime_rules():
    assert ParallelLayout(tp=3, dp=2).violations(SIX_HEADS) == []
    errors = ParallelLayout(tp=4).violations(SIX_HEADS)
    rule = "model.num_attention_heads (6) must be divisible by parallel.tp (4)"
    assert ("parallel.tp", rule) in errors


def test_padded_vocabulary_must_split_over_tp():
    odd_vocab = dataclasses.replace(SIX_HEADS, vocab_size=256)
    with pytest.raises(ConfigError, match=r"vocabulary \(256\) must be divisible by tp \(3\)"):
        ParallelLayout(tp=3).check(odd_vocab)


def test_batch_rules_apply_when_the_run_config_is_given():
    cfg = Config(model=SIX_HEADS, train=TrainConfig(micro_batch_size=4, global_batch_size=16))
    assert ParallelLayout(dp=8).violations(SIX_HEADS) == []
    fields = [field for field, _ in ParallelLayout(dp=8).violations(cfg)]
    assert fields == ["train.global_batch_size"]


GRIDS = {
    "tp2·pp2·dp2": ParallelLayout(tp=2, pp=2, dp=2),
    "tp2·cp2·dp3": ParallelLayout(tp=2, cp=2, dp=3),
    "tp2·pp3·dp4·ep2": ParallelLayout(tp=2, pp=3, dp=4, ep=2),
    "cp2·dp4·ep4": ParallelLayout(cp=2, dp=4, ep=4),
    "tp4·pp2·dp2·cp2·ep2": ParallelLayout(tp=4, pp=2, dp=2, cp=2, ep=2),
}
TOKENS = ["tp", "pp", "cp", "dp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp", "ep", "tp-ep", "tp-ep-pp"]


@pytest.mark.parametrize("name", list(GRIDS))
def test_coordinates_and_groups_are_megatrons_rank_generator(name):
    """The arithmetic numbering against megatron's RankGenerator, which lists every group."""
    from megatron.core.parallel_state import RankGenerator

    layout = GRIDS[name]
    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=layout.tp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")
    for is_expert, generator in ((False, dense), (True, expert)):
        for token in TOKENS:
            if ("ep" in token) != is_expert and token not in ("tp", "pp", "dp"):
                continue
            for ranks in generator.get_ranks(token):
                members = sorted(ranks)
                for index, rank in enumerate(members):
                    assert layout.group(rank, token, is_expert) == members
                    assert layout.group_position(rank, token, is_expert) == (index, len(members))
    coords = {"tp": ("tp", dense), "cp": ("cp", dense), "dp": ("dp", dense), "pp": ("pp", dense),
              "dp_cp": ("dp-cp", dense), "ep": ("ep", expert), "edp": ("dp", expert)}
    for coord, (token, generator) in coords.items():
        for ranks in generator.get_ranks(token):
            for index, rank in enumerate(sorted(ranks)):
                assert layout.rank_coords(rank)[coord] == index, (coord, rank)


@pytest.mark.parametrize("name", list(GRIDS))
def test_replica_index_and_position_ranks_are_the_coordinates(name):
    from megatron_ext.reshard.vps import position_ranks, replica_index

    layout = GRIDS[name]
    for rank in range(layout.active):
        c = layout.rank_coords(rank)
        assert replica_index(layout, rank, False) == c["dp_cp"]
        assert replica_index(layout, rank, True) == c["edp"]
        ranks = position_ranks(layout, (c["pp"], c["tp"], c["ep"]))
        assert list(ranks) == layout.ranks_of(pp=c["pp"], tp=c["tp"], ep=c["ep"])
        assert ranks.index(rank) == c["edp"]
