"""DPP runtime inputs, one process: whole-document batches from a megatron indexed dataset,
data-parallel shares, a chunk's model inputs, and the plan checks that run before a step."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from megatron_ext.dpp.planning.plan import Chunk, Group, Op, Segment as S, StepPlan, padded
from megatron_ext.dpp.runtime.batch import DocumentBatches, chunk_inputs, dp_share
from megatron_ext.dpp.runtime.loop import validate_plan

DOC_LENGTHS = [5, 1, 40, 12, 3, 25, 2, 9]  # tokens per document


@pytest.fixture
def dataset(tmp_path):
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(1000))
    rng = np.random.default_rng(0)
    for n in DOC_LENGTHS:
        ids = rng.integers(0, 1000, n)
        builder.add_document(ids, [n])
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


@pytest.mark.parametrize(
    "too_long,expect_lengths,truncated,rejected",
    [
        ("truncate", {4, 20, 11, 2, 1, 8}, 2, 0),
        ("reject", {4, 11, 2, 1, 8}, 0, 2),
    ],
)
def test_batches_are_whole_documents_up_to_max_seq_len(dataset, too_long, expect_lengths, truncated, rejected):
    batches = DocumentBatches(dataset, docs_per_batch=len(DOC_LENGTHS), max_seq_len=20, too_long=too_long, seed=3)
    docs = next(iter(batches))
    originals = {tuple(np.asarray(dataset[i])[:21].tolist()) for i in range(len(dataset))}
    for doc in docs:
        assert 2 <= len(doc) <= 21  # positions = len - 1, never padded
        assert tuple(doc.tolist()) in originals
    first_epoch = docs[: len(DOC_LENGTHS) - 1 - rejected]
    assert {len(d) - 1 for d in first_epoch} == expect_lengths
    assert batches.counts.truncated >= truncated and batches.counts.rejected >= rejected
    assert batches.counts.too_short >= 1


def test_bad_too_long_is_refused(dataset):
    with pytest.raises(ValueError, match="too_long"):
        DocumentBatches(dataset, 4, 20, too_long="drop")


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_dp_shares_partition_the_batch_and_balance_tokens(dp):
    lengths = [37, 9, 14, 6, 5, 3, 11, 30, 2]
    shares = [dp_share(lengths, dp, r) for r in range(dp)]
    assert sorted(itertools.chain(*shares)) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shares]
    # Greedy longest-first: no replica exceeds the mean by more than the longest sequence.
    assert max(loads) <= sum(lengths) / dp + max(lengths)


def test_chunk_inputs_continue_positions_and_shift_labels():
    docs = [torch.arange(100, 121), torch.arange(200, 205)]
    chunk = Chunk(0, "hybrid", (S(0, 12, 8), S(1, 0, 4)))
    got = chunk_inputs(chunk, docs)
    assert got["tokens"].tolist() == [list(range(112, 120)) + [200, 201, 202, 203]]
    assert got["labels"].tolist() == [list(range(113, 121)) + [201, 202, 203, 204]]
    assert got["position_ids"].tolist() == [list(range(12, 20)) + [0, 1, 2, 3]]
    assert got["loss_mask"].sum().item() == 12


def test_chunk_inputs_pad_to_the_chunk_size_outside_the_loss():
    docs = [torch.arange(100, 121), torch.arange(200, 205)]
    chunk = padded((Chunk(0, "hybrid", (S(0, 12, 8), S(1, 0, 3))),), 4)[0]
    got = chunk_inputs(chunk, docs)
    assert chunk.padding == 1 and chunk.tokens == 12
    assert got["tokens"].tolist() == [list(range(112, 120)) + [200, 201, 202, 0]]
    assert got["position_ids"].tolist() == [list(range(12, 20)) + [0, 1, 2, 0]]
    assert got["loss_mask"].tolist() == [[1.0] * 11 + [0.0]]


def test_bad_padding_is_refused():
    with pytest.raises(ValueError, match="multiple must be positive"):
        padded(CHUNKS, 0)
    with pytest.raises(ValueError, match="padding must not be negative"):
        validate_plan(plan((F0, F1, B1, B0), (F0, F1, B1, B0), chunks=(CHUNKS[0], dataclasses.replace(CHUNKS[1], padding=-1))))


# --- plan checks ------------------------------------------------------------------------------

CHUNKS = (Chunk(0, "split", (S(0, 0, 4),)), Chunk(1, "hybrid", (S(0, 4, 3), S(1, 0, 2))))
F0, F1, B0, B1 = Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1)


def plan(*stage_ops, chunks=CHUNKS, lengths=(7, 2)) -> StepPlan:
    return StepPlan(len(stage_ops), lengths, chunks, (Group(tuple(stage_ops)),))


PLANS = {
    "slices_backward_in_order": ((F0, F1, B0, B1), (F0, F1, B0, B1)),
    "stages_disagree_on_order": ((F0, F1, B1, B0), (F1, F0, B1, B0)),
    "backward_before_forward": ((F0, B1, F1, B0), (F0, B1, F1, B0)),
}
ERRORS = {
    "slices_backward_in_order": "do not run backward in reverse",
    "stages_disagree_on_order": "orders its chunks differently",
    "backward_before_forward": "B of chunk 1 before its F",
}


def test_a_valid_plan_passes():
    validate_plan(plan((F0, F1, B1, B0), (F0, F1, B1, B0)))


@pytest.mark.parametrize("name", list(PLANS))
def test_bad_plans_are_refused_before_running(name):
    with pytest.raises(ValueError, match=ERRORS[name]):
        validate_plan(plan(*PLANS[name]))


def test_a_cyclic_wait_between_stages_is_refused():
    chunks = (Chunk(0, "packed", (S(0, 0, 3),)), Chunk(1, "packed", (S(1, 0, 2),)))
    # Stage 0 waits for B0 from stage 1, which first waits for F1 from stage 0.
    bad = plan((F0, B0, F1, B1), (F0, F1, B0, B1), chunks=chunks, lengths=(3, 2))
    with pytest.raises(ValueError, match="deadlocks"):
        validate_plan(bad)


def test_untiled_sequences_and_excess_recompute_are_refused():
    gap = (Chunk(0, "split", (S(0, 0, 4),)), Chunk(1, "split", (S(0, 5, 2),)))
    with pytest.raises(ValueError, match="do not tile"):
        validate_plan(plan((F0, F1, B1, B0), chunks=gap, lengths=(7,)))
    with pytest.raises(ValueError, match="recomputes 3 layers"):
        validate_plan(plan((Op("F", 0, 3), F1, B1, B0)), num_layers_per_stage=[2])
