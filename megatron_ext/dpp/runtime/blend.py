"""A megatron data blend (`data.data_path: [w1, prefix1, w2, prefix2, ...]`) read as one source
of whole documents for DocumentBatches.

Megatron's weights are shares of samples of equal length, so shares of tokens; a blend of
whole documents keeps them shares of tokens. One pass of the blend holds every document of
the dataset with the most tokens for its weight, and from each other dataset documents in a
seeded order, cycled, until its tokens reach its share (an under-weighted dataset's documents
repeat; its share is met to within one document). Without weights the datasets are simply
concatenated, each document once.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np


class DocumentBlend:
    """Documents of several datasets as one: `len()` and `[i]` -> token ids, as DocumentBatches
    reads them. Each dataset needs `len()`, `[i]` and `sequence_lengths` (megatron's
    IndexedDataset), one sequence per document."""

    def __init__(self, datasets: Sequence, weights: Optional[Sequence[float]] = None, seed: int = 0) -> None:
        if not datasets:
            raise ValueError("dpp data blend: no dataset")
        if weights is not None and (len(weights) != len(datasets) or min(weights) < 0 or sum(weights) <= 0):
            raise ValueError(f"dpp data blend: {len(datasets)} datasets need as many non-negative weights with a "
                             f"positive sum, got {list(weights)}")
        lengths = [np.asarray(d.sequence_lengths, dtype=np.int64) for d in datasets]
        if weights is None:
            picks = [np.arange(len(n)) for n in lengths]
        else:
            tokens = [int(n.sum()) for n in lengths]
            if any(t == 0 for t, w in zip(tokens, weights) if w > 0):
                raise ValueError("dpp data blend: a dataset with a positive weight has no tokens")
            share = [w / sum(weights) for w in weights]
            total = max(t / s for t, s in zip(tokens, share) if s > 0)  # the blend's tokens per pass
            rng = np.random.default_rng(seed)
            picks = [_documents_for(n, s * total, rng) for n, s in zip(lengths, share)]
        self.datasets = list(datasets)
        self.source = np.concatenate([np.full(len(p), i, dtype=np.int32) for i, p in enumerate(picks)])
        self.document = np.concatenate(picks).astype(np.int64)

    def __len__(self) -> int:
        return len(self.document)

    def __getitem__(self, i: int):
        return self.datasets[self.source[i]][int(self.document[i])]


def _documents_for(lengths: np.ndarray, tokens: float, rng: np.random.Generator) -> np.ndarray:
    """Document ids of one dataset in a seeded order, cycled, until their tokens reach
    `tokens` (the dataset's whole order when that is what its share holds)."""
    if tokens <= 0:
        return np.zeros(0, dtype=np.int64)
    order = rng.permutation(len(lengths))
    cycles = math.ceil(tokens / lengths.sum())
    cycled = np.tile(order, cycles)
    # the first position whose running total reaches the share, with float slack for a share
    # that is a dataset's exact total
    reached = np.cumsum(lengths[cycled]) >= tokens * (1 - 1e-12)
    return cycled[: int(np.argmax(reached)) + 1]
