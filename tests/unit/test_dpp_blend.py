"""A megatron data blend read by DPP as whole documents: each dataset's share of the tokens of
one pass is its weight's, to within one of its documents, counted from the documents the blend
hands out; without weights every document once."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from megatron_ext.dpp.plugin import open_documents
from megatron_ext.dpp.runtime.batch import DocumentBatches
from megatron_ext.dpp.runtime.blend import DocumentBlend

# Dataset k's token ids lie in [1000 k, 1000 k + 1000): a document tells where it came from.
LENGTHS = {
    "short_docs": [3, 5, 2, 8, 4, 6, 3, 7],
    "long_docs": [40, 25, 60, 33],
    "mixed": [1, 90, 12, 7, 30, 2, 18],
}


def build(tmp_path, k: int, lengths: list[int]) -> str:
    prefix = str(tmp_path / f"ds{k}")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(1000 * len(LENGTHS)))
    for d, n in enumerate(lengths):
        # the document's own number in its first token: which one it is, when it repeats
        builder.add_document(np.array([1000 * k + d] + [1000 * k + 999] * (n - 1)), [n])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def prefixes(tmp_path) -> list[str]:
    return [build(tmp_path, k, lengths) for k, lengths in enumerate(LENGTHS.values())]


def handed_out(blend) -> tuple[Counter, Counter]:
    """(tokens per dataset, times each (dataset, document) was handed out), from the items."""
    tokens, seen = Counter(), Counter()
    for i in range(len(blend)):
        doc = np.asarray(blend[i])
        k, d = divmod(int(doc[0]), 1000)
        tokens[k] += len(doc)
        seen[k, d] += 1
    return tokens, seen


WEIGHTS = {
    "even": [1, 1, 1],
    "skewed": [0.1, 0.3, 0.6],
    "one_left_out": [0.5, 0.0, 0.5],
    "unnormalised": [2, 5, 1],
}


@pytest.mark.parametrize("case", WEIGHTS)
def test_each_dataset_gets_its_weights_share_of_the_tokens(prefixes, case):
    weights = WEIGHTS[case]
    blend = DocumentBlend([IndexedDataset(p) for p in prefixes], weights, seed=3)
    tokens, seen = handed_out(blend)
    shares = [w / sum(weights) for w in weights]
    # The pass is as long as the dataset with the most tokens for its weight needs to appear once.
    total = max(sum(n) / s for n, s in zip(LENGTHS.values(), shares) if s > 0)
    for k, (lengths, share) in enumerate(zip(LENGTHS.values(), shares)):
        assert share * total * (1 - 1e-9) <= tokens[k] < share * total + max(lengths) or share == tokens[k] == 0
        counts = [seen[k, d] for d in range(len(lengths))]
        assert max(counts) - min(counts) <= 1  # repeats go round the whole dataset
    assert min(seen[k, d] for k, lengths in enumerate(LENGTHS.values()) for d in range(len(lengths))
               if shares[k] > 0) >= 1  # every weighted document is in every pass


def test_without_weights_every_document_once(prefixes):
    blend = DocumentBlend([IndexedDataset(p) for p in prefixes])
    tokens, seen = handed_out(blend)
    assert len(blend) == sum(len(n) for n in LENGTHS.values())
    assert set(seen.values()) == {1}
    assert [tokens[k] for k in range(len(LENGTHS))] == [sum(n) for n in LENGTHS.values()]


@pytest.mark.parametrize("weights, message", [
    ([1, 2], "3 datasets need as many"),
    ([1, -1, 1], "non-negative"),
    ([0, 0, 0], "positive sum"),
])
def test_bad_weights_are_refused(prefixes, weights, message):
    with pytest.raises(ValueError, match=message):
        DocumentBlend([IndexedDataset(p) for p in prefixes], weights)


def test_the_run_reads_its_blend_as_whole_document_batches(prefixes, tmp_path):
    def run(data_path: list[str]):
        return SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(seed=5)), data_prefixes=lambda: data_path)

    assert isinstance(open_documents(run([prefixes[0]])), IndexedDataset)
    weighted = open_documents(run(["0.25", prefixes[0], "0.75", prefixes[2]]))
    tokens, _ = handed_out(weighted)
    assert set(tokens) == {0, 2} and tokens[2] / (tokens[0] + tokens[2]) == pytest.approx(0.75, abs=0.1)
    batches = DocumentBatches(weighted, docs_per_batch=len(weighted), max_seq_len=1000, seed=5)
    first = next(iter(batches))
    # one batch of a whole pass: every document of the blend, at its own length (the one-token
    # document is too short to train on)
    expected = sorted(len(np.asarray(weighted[i])) for i in range(len(weighted)) if len(weighted[i]) > 1)
    assert sorted(len(doc) for doc in first[: len(expected)]) == expected
