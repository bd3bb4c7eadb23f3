"""The pure pieces of the elastic axes under tensor parallelism: the part of a global order each
TP rank applies to its block (attention and Mamba heads, ranked inside groups that lie whole on
one rank) and the runs a rank's block of a fused tensor is joined by."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.elastic.axes import gather_across_tp, rank_block


def test_each_rank_applies_its_block_of_a_global_order_in_local_indices():
    # 8 Mamba heads in 2 groups at TP=2: rank 0 holds group 0 (heads 0-3), rank 1 group 1.
    order = torch.tensor([1, 0, 3, 2, 7, 4, 5, 6])
    assert rank_block(order, 2, 0).tolist() == [1, 0, 3, 2]
    assert rank_block(order, 2, 1).tolist() == [3, 0, 1, 2]
    assert torch.equal(rank_block(order, 1, 0), order)


def test_an_order_that_moves_units_between_ranks_is_refused():
    with pytest.raises(ValueError, match=r"moves units between TP ranks \(rank 0 of 2\)"):
        rank_block(torch.tensor([4, 0, 1, 2, 3, 5, 6, 7]), 2, 0)


def test_one_rank_splits_a_block_into_runs_of_the_given_lengths(one_rank_world):
    rows = torch.arange(10.0)
    assert [r.tolist() for r in gather_across_tp(rows, 0, [3, 3, 2, 2])] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [r.tolist() for r in gather_across_tp(rows, 0, 2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]

