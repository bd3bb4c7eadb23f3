"""Global batches of whole documents at their real lengths, and a chunk's model inputs.

A DPP global batch is `docs_per_batch` whole documents read from a Megatron indexed dataset in
a seeded order, never padded: a document of n tokens is a sequence of n - 1 positions (inputs
and next-token labels). A document longer than `max_seq_len` + 1 tokens is truncated or
skipped, as configured, and counted. Data-parallel replicas split each global batch by tokens
and each plans its own share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from megatron_ext.dpp.planning.lengths import Overflow, check_overflow, limit_length
from megatron_ext.dpp.planning.plan import Chunk


@dataclass
class DocumentCounts:
    """What the batch reader did to documents that do not fit, for the log."""

    truncated: int = 0
    rejected: int = 0
    too_short: int = 0

    def copy(self) -> "DocumentCounts":
        return dataclasses.replace(self)

    def line(self) -> str:
        return (
            f"dpp data: {self.truncated} documents truncated, {self.rejected} rejected as longer "
            f"than dpp.max_seq_len, {self.too_short} skipped with fewer than 2 tokens"
        )


@dataclass(frozen=True)
class StreamPosition:
    """Where a document stream stands: the next document is number `index` of epoch `epoch`'s
    seeded order of a dataset of `documents` documents, and `counts` is what the stream did
    to the documents before it. Plain values, saved in checkpoints (`to_dict`)."""

    documents: int
    seed: int
    epoch: int = 0
    index: int = 0
    counts: DocumentCounts = field(default_factory=DocumentCounts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, state: dict) -> "StreamPosition":
        return cls(**{**state, "counts": DocumentCounts(**state["counts"])})


@dataclass
class DocumentBatches:
    """Endless global batches of whole documents from `dataset` (anything with `len()` and
    `dataset[i]` -> token ids, such as megatron's `IndexedDataset`), epoch after epoch, each
    epoch in a new seeded order; from the beginning, or from `start` (a resumed run)."""

    dataset: object
    docs_per_batch: int
    max_seq_len: int
    too_long: Overflow = "truncate"
    seed: int = 1234
    counts: DocumentCounts = field(default_factory=DocumentCounts)
    start: Optional[StreamPosition] = None

    def __post_init__(self) -> None:
        check_overflow(self.too_long, "dpp.too_long")
        if self.max_seq_len < 1 or self.docs_per_batch < 1:
            raise ValueError("dpp: max_seq_len and docs_per_batch must be positive")
        if self.start is None:
            self.start = StreamPosition(len(self.dataset), self.seed)
        elif (self.start.documents, self.start.seed) != (len(self.dataset), self.seed):
            raise ValueError(
                f"dpp: the checkpoint's document stream is over {self.start.documents} documents in the order "
                f"of seed {self.start.seed}; this run reads {len(self.dataset)} documents with seed "
                f"{self.seed} (train.seed), so it cannot continue where the checkpoint stopped"
            )
        self.counts = self.start.counts.copy()
        self._epoch, self._index = self.start.epoch, self.start.index

    def position(self) -> StreamPosition:
        """Where the next document would be read from."""
        return StreamPosition(len(self.dataset), self.seed, self._epoch, self._index, self.counts.copy())

    def _documents(self) -> Iterator[torch.Tensor]:
        while True:
            order = np.random.default_rng(self.seed + self._epoch).permutation(len(self.dataset))
            whole_epoch, usable = self._index == 0, 0
            while self._index < len(order):
                doc = self._fit(np.asarray(self.dataset[int(order[self._index])]))
                self._index += 1
                if doc is not None:
                    usable += 1
                    yield doc
            if whole_epoch and not usable:
                raise ValueError("dpp data: no document of the dataset is usable (see the counts above)")
            self._epoch, self._index = self._epoch + 1, 0

    def _fit(self, doc: np.ndarray):
        if len(doc) < 2:
            self.counts.too_short += 1
            return None
        positions = limit_length(len(doc) - 1, self.max_seq_len, self.too_long)
        if positions is None:
            self.counts.rejected += 1
            return None
        if positions < len(doc) - 1:
            self.counts.truncated += 1
        return torch.from_numpy(doc[: positions + 1].astype(np.int64))

    def positioned(self) -> Iterator[tuple[list[torch.Tensor], StreamPosition]]:
        """Each global batch with the stream's position after it (where the next one starts)."""
        documents = self._documents()
        while True:
            yield [next(documents) for _ in range(self.docs_per_batch)], self.position()

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        return (batch for batch, _ in self.positioned())


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
    labels, position ids that continue across slices (start + offset), and the loss mask; then
    the chunk's padding (token 0, masked out of the loss)."""
    tokens, labels, positions = [], [], []
    for seg in chunk.segments:
        doc = documents[seg.seq]
        if seg.start + seg.length + 1 > len(doc):
            raise ValueError(f"dpp: segment {seg} runs past the {len(doc) - 1} positions of its sequence")
        tokens.append(doc[seg.start : seg.start + seg.length])
        labels.append(doc[seg.start + 1 : seg.start + seg.length + 1])
        positions.append(torch.arange(seg.start, seg.start + seg.length))
    pad = torch.zeros(chunk.padding, dtype=tokens[0].dtype)
    loss_mask = torch.ones(chunk.tokens, dtype=torch.float32)
    loss_mask[chunk.tokens - chunk.padding :] = 0.0
    return {
        "tokens": torch.cat([*tokens, pad])[None],
        "labels": torch.cat([*labels, pad])[None],
        "position_ids": torch.cat([*positions, torch.arange(chunk.padding)])[None],
        "loss_mask": loss_mask[None],
    }
