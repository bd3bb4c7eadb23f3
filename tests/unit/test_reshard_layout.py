"""ParallelLayout: a value with megatron's rank order and the runtime's validation rules."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_ext.config.validate import ConfigError
from megatron_ext.reshard.layout import ParallelLayout

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
