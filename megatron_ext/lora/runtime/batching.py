"""Each job's micro-batches, and one packed micro-batch out of them.

A job's stream depends only on the job (its dataset and seed), never on what it is packed
with. A packed micro-batch stacks the jobs' samples along the batch axis, grouped by slot (so
each adapter owns a contiguous column range, see layers.Segment), right-padded to the longest
sequence with loss mask 0: causal attention keeps a sample's real tokens blind to the padding
behind them, so every token sees what it would see alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy
import torch
from megatron.core.datasets import helpers
from megatron.core.datasets.utils import normalize

from megatron_ext.data.sft.dataset import Conversations
from megatron_ext.data.sft.packing import build_sample
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.runtime.layers import Segment


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64: the next token
    loss_mask: torch.Tensor  # [b, s] float: 1 where the label counts

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]


class JobData(Protocol):
    def train(self) -> Iterator[MicroBatch]: ...

    def eval(self) -> list[MicroBatch]: ...


class SyntheticData:
    """Seeded random token sequences (tests and benchmarks): a job's stream is fixed by
    (job.seed, `stream`)."""

    def __init__(self, job: LoraJob, vocab_size: int, stream: int = 0) -> None:
        self.job, self.vocab_size, self.stream = job, vocab_size, stream

    def _batches(self, seed: int) -> Iterator[MicroBatch]:
        generator = torch.Generator().manual_seed(seed)
        shape = (self.job.micro_batch_size, self.job.seq_length + 1)
        while True:
            ids = torch.randint(0, self.vocab_size, shape, generator=generator)
            yield MicroBatch(ids[:, :-1], ids[:, 1:], torch.ones(shape[0], shape[1] - 1))

    def train(self) -> Iterator[MicroBatch]:
        return self._batches(self.job.seed * 7919 + self.stream)

    def eval(self) -> list[MicroBatch]:
        stream = self._batches(self.job.seed * 7919 + self.stream + 104729)
        return [next(stream) for _ in range(self.job.eval_iters)]


class ExampleData:
    """(prompt ids, answer ids) examples as fixed-length samples: the loss counts on the answer
    only; examples are shuffled per epoch with the job's seed; the last `eval_examples` are
    held out."""

    def __init__(self, job: LoraJob, examples: Sequence[tuple[list[int], list[int]]], pad_id: int, eval_examples: int) -> None:
        # An example whose prompt fills the sample would train on nothing.
        examples = [(p, a) for p, a in examples if len(p) < job.seq_length]
        if len(examples) <= eval_examples:
            raise ValueError(
                f"lora job {job.name!r}: dataset {job.dataset!r} has {len(examples)} examples with room for an "
                f"answer in seq_length {job.seq_length}; {eval_examples} are held out for evaluation"
            )
        if 0 < eval_examples < job.micro_batch_size:  # eval() would hold no batch: a loss of 0
            raise ValueError(
                f"lora job {job.name!r}: {eval_examples} held-out examples are fewer than one "
                f"micro-batch ({job.micro_batch_size})"
            )
        self.job, self.pad_id = job, pad_id
        self.train_examples = list(examples[:-eval_examples]) if eval_examples else list(examples)
        self.eval_examples = list(examples[-eval_examples:]) if eval_examples else []

    def _sample(self, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.job.seq_length
        ids = (prompt + answer)[: s + 1]
        mask = ([0.0] * len(prompt) + [1.0] * len(answer))[1 : s + 1]
        ids = ids + [self.pad_id] * (s + 1 - len(ids))
        mask = mask + [0.0] * (s - len(mask))
        ids_t = torch.tensor(ids)
        return ids_t[:-1], ids_t[1:], torch.tensor(mask)

    def _batch(self, chosen: list[tuple[list[int], list[int]]]) -> MicroBatch:
        tokens, labels, masks = zip(*(self._sample(p, a) for p, a in chosen))
        return MicroBatch(torch.stack(tokens), torch.stack(labels), torch.stack(masks))

    def train(self) -> Iterator[MicroBatch]:
        generator = torch.Generator().manual_seed(self.job.seed)
        mb, pending = self.job.micro_batch_size, []
        while True:
            order = torch.randperm(len(self.train_examples), generator=generator).tolist()
            pending += [self.train_examples[i] for i in order]
            while len(pending) >= mb:
                yield self._batch(pending[:mb])
                pending = pending[mb:]

    def eval(self) -> list[MicroBatch]:
        mb = self.job.micro_batch_size
        return [self._batch(self.eval_examples[i : i + mb]) for i in range(0, len(self.eval_examples) - mb + 1, mb)]


class ConversationData:
    """SFT conversations (data/sft), one a sample, the loss on the assistant's tokens exactly as
    data/sft/packing.build_sample puts it; each micro-batch padded to its longest sample.

    `train[i]`: the training conversations of part i of a mix, `weights[i]` its share. The job
    trains on `steps x global_batch_size` samples: each part is read in epochs, each epoch a
    shuffle seeded by (job seed, part, epoch), and the parts are blended in megatron's order
    (BlendedDataset's build_blending_indices: sample k comes from the part furthest behind its
    share). Evaluation: the first `job.eval_iters` micro-batches of the conversations `valid`.
    Every conversation is cut to seq_length + 1 tokens."""

    def __init__(
        self,
        job: LoraJob,
        conversations: Conversations,
        train: Sequence[Sequence[int]],
        weights: Sequence[float],
        valid: Sequence[int],
        pad: int,
    ) -> None:
        self.job, self.conversations, self.pad = job, conversations, pad
        samples = job.steps * job.global_batch_size
        part = numpy.zeros(samples, dtype=numpy.int16)
        nth = numpy.zeros(samples, dtype=numpy.int64)
        helpers.build_blending_indices(part, nth, numpy.asarray(normalize(list(weights)), dtype=numpy.float64),
                                       len(weights), samples, False)
        self.order = numpy.zeros(samples, dtype=numpy.int64)
        for i, indices in enumerate(train):
            taken = nth[part == i]
            if len(taken):
                epochs = [numpy.random.default_rng([job.seed, i, e]).permutation(numpy.asarray(indices, dtype=numpy.int64))
                          for e in range(int(taken.max()) // len(indices) + 1)]
                self.order[part == i] = numpy.concatenate(epochs)[taken]
        mb = job.micro_batch_size
        self.valid = list(valid)[: job.eval_iters * mb]
        self.sizes = numpy.minimum(conversations.lengths(), job.seq_length + 1)

    def _batch(self, indices: Sequence[int]) -> MicroBatch:
        length = int(self.sizes[list(indices)].max()) - 1
        built = [build_sample([self.conversations.piece(i, self.job.seq_length + 1)], length, self.pad) for i in indices]
        return MicroBatch(*(torch.stack([b[key] for b in built]) for key in ("tokens", "labels", "loss_mask")))

    def _groups(self, indices: Sequence[int]) -> list[Sequence[int]]:
        mb = self.job.micro_batch_size
        return [indices[i : i + mb] for i in range(0, len(indices), mb)]

    def lengths(self) -> numpy.ndarray:
        """The tokens a sample of each training micro-batch holds (its longest sample's)."""
        return numpy.array([int(self.sizes[group].max()) - 1 for group in self._groups(self.order)])

    def train(self) -> Iterator[MicroBatch]:
        return (self._batch(group) for group in self._groups(self.order))

    def eval(self) -> list[MicroBatch]:
        return [self._batch(group) for group in self._groups(self.valid)]


@dataclass
class PackedBatch:
    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    segments: list[Segment]


def pack(parts: Sequence[tuple[int, MicroBatch]]) -> PackedBatch:
    """One batch of the (slot, micro-batch) parts, in the given order, right-padded."""
    seq = max(mb.tokens.shape[1] for _, mb in parts)

    def padded(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, seq - t.shape[1]), value=value)

    segments, start = [], 0
    for slot, mb in parts:
        segments.append(Segment(slot, start, start + mb.batch_size, mb.tokens.shape[1]))
        start += mb.batch_size
    tokens = torch.cat([padded(mb.tokens, 0) for _, mb in parts])
    return PackedBatch(
        tokens=tokens,
        position_ids=torch.arange(seq).expand_as(tokens),
        labels=torch.cat([padded(mb.labels, 0) for _, mb in parts]),
        loss_mask=torch.cat([padded(mb.loss_mask, 0.0) for _, mb in parts]),
        segments=segments,
    )
