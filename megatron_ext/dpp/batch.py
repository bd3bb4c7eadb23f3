"""Global batches of whole documents at their real lengths, and a chunk's model inputs.

A DPP global batch is `docs_per_batch` whole documents read from a Megatron indexed dataset in
a seeded order, never padded: a document of n tokens is a sequence of n - 1 positions (inputs
and next-token labels). A document longer than `max_seq_len` + 1 tokens is truncated or
skipped, as configured, and counted. Data-parallel replicas split each global batch by tokens
and each plans its own share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Sequence

import numpy as np
import torch

from megatron_ext.dpp.plan import Chunk

TooLong = Literal["truncate", "reject"]


@dataclass
class DocumentCounts:
    """What the batch reader did to documents that do not fit, for the log."""

    truncated: int = 0
    rejected: int = 0
    too_short: int = 0

    def line(self) -> str:
        return (
            f"dpp data: {self.truncated} documents truncated, {self.rejected} rejected as longer "
            f"than dpp.max_seq_len, {self.too_short} skipped with fewer than 2 tokens"
        )


@dataclass
class DocumentBatches:
    """Endless global batches of whole documents from `dataset` (anything with `len()` and
    `dataset[i]` -> token ids, such as megatron's `IndexedDataset`), epoch after epoch, each
    epoch in a new seeded order."""

    dataset: object
    docs_per_batch: int
    max_seq_len: int
    too_long: TooLong = "truncate"
    seed: int = 1234
    counts: DocumentCounts = field(default_factory=DocumentCounts)

    def __post_init__(self) -> None:
        if self.too_long not in ("truncate", "reject"):
            raise ValueError(f"dpp.too_long: expected truncate or reject, got {self.too_long!r}")
        if self.max_seq_len < 1 or self.docs_per_batch < 1:
            raise ValueError("dpp: max_seq_len and docs_per_batch must be positive")

    def _documents(self) -> Iterator[torch.Tensor]:
        epoch = 0
        while True:
            order = np.random.default_rng(self.seed + epoch).permutation(len(self.dataset))
            usable = 0
            for i in order:
                doc = self._fit(np.asarray(self.dataset[int(i)]))
                if doc is not None:
                    usable += 1
                    yield doc
            if not usable:
                raise ValueError("dpp data: no document of the dataset is usable (see the counts above)")
            epoch += 1

    def _fit(self, doc: np.ndarray):
        if len(doc) < 2:
            self.counts.too_short += 1
            return None
        if len(doc) > self.max_seq_len + 1:
            if self.too_long == "reject":
                self.counts.rejected += 1
                return None
            self.counts.truncated += 1
            doc = doc[: self.max_seq_len + 1]
        return torch.from_numpy(doc.astype(np.int64))

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        documents = self._documents()
        while True:
            yield [next(documents) for _ in range(self.docs_per_batch)]


def dp_share(lengths: Sequence[int], dp: int, rank: int) -> list[int]:
    """The sequence indices replica `rank` of `dp` trains on: longest first, each to the replica
    with the fewest tokens so far (ties to the lower rank), the same on every rank."""
    load = [0] * dp
    mine = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        if r == rank:
            mine.append(i)
    return sorted(mine)


def chunk_inputs(chunk: Chunk, documents: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model inputs of one chunk, batch size 1: its segments' tokens end to end, next-token
    labels, position ids that continue across slices (start + offset), and the loss mask."""
    tokens, labels, positions = [], [], []
    for seg in chunk.segments:
        doc = documents[seg.seq]
        if seg.start + seg.length + 1 > len(doc):
            raise ValueError(f"dpp: segment {seg} runs past the {len(doc) - 1} positions of its sequence")
        tokens.append(doc[seg.start : seg.start + seg.length])
        labels.append(doc[seg.start + 1 : seg.start + seg.length + 1])
        positions.append(torch.arange(seg.start, seg.start + seg.length))
    tokens_t = torch.cat(tokens)[None]
    return {
        "tokens": tokens_t,
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(positions)[None],
        "loss_mask": torch.ones_like(tokens_t, dtype=torch.float32),
    }
