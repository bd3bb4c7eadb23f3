"""The plugin's default choice grid: hidden sizes stay multiples of every head count of the grid
where the parent's hidden size allows it (so every submodel is a LLaMA config transformers
loads), and are the plain half-to-full steps where it does not."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.config.schema import ModelConfig
from megatron_ext.elastic.plugin import default_grid
from megatron_ext.elastic.space import ElasticSpace
from tests.unit.test_elastic_slicing import world  # noqa: F401

BASE = ModelConfig(name="grid", num_layers=1, hidden_size=72, ffn_hidden_size=128, num_attention_heads=9,
                   num_query_groups=3, head_dim=8, seq_length=16, vocab_size=64, spec="local")
CASES = {
    # SmolLM2's shape scaled down: heads 3 / 6 / 9 (lcm 18 divides 72): hidden sizes move down
    # to multiples of 18.
    "heads 3/6/9, hidden 72": (BASE, {"heads": [3, 6, 9], "hidden": [18, 36, 54, 72]}),
    # heads 4 / 6 / 8 (lcm 24 does not divide 64): the plain steps of 8 from half.
    "heads 4/6/8, hidden 64": (dataclasses.replace(BASE, hidden_size=64, num_attention_heads=8, num_query_groups=2),
                               {"heads": [4, 6, 8], "hidden": [32, 40, 48, 56, 64]}),
}


@pytest.mark.parametrize("case", CASES)
def test_default_grid_hidden_sizes(case, world):  # noqa: F811
    from megatron_ext.models.convert.world import build_model

    cfg, expected = CASES[case]
    (model,) = build_model(cfg, 64)
    grid = default_grid(ElasticSpace(model), 8)
    assert {k: grid[k] for k in expected} == expected
    assert all(h % heads == 0 for h in grid["hidden"] for heads in grid["heads"]) == (case == "heads 3/6/9, hidden 72")
