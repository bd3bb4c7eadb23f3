"""What a LoRA job's `dataset` names, and the job's data made of it.

A job's `dataset` (lora.dataset, or `dataset:` of a lora.jobs / lora.jobs_file entry) is one of:

  synthetic                 seeded random tokens (tests, benchmarks)
  task:<name>               a small instruction task built from the standard library (tasks.py):
                            docstring, module, reverse, upper
  PATH [PATH ...]           the user's SFT data: JSONL / JSON / Parquet files of
                            {"messages": [...]} or {"prompt": ..., "completion": ...} records, or
                            folders of them (data/sft/records.py), read as one dataset
  W1 PATH1 W2 PATH2 ...     a weighted mix, written like data.data_path (Megatron-LM's
                            --data-path): part i gives the share Wi / sum(W) of the training
                            samples; each PATHi a file or a folder

SFT data is rendered with data.sft.prompt_format (null: the tokenizer's chat template), one
conversation a sample, the loss on the assistant's tokens (runtime/batching.ConversationData);
a conversation longer than the job's seq_length + 1 tokens is cut or skipped as
data.sft.overlong says. Each part is split by conversation (data.split over a shuffle seeded by
train.seed, so every job reading a file holds out the same conversations of it); a job
validates on the validation conversations of all its parts. The data is read, and each job's
real tokens per sample measured (`SweepData.jobs`, the planner's lengths), on every rank before
planning: a broken record stops the sweep (a ConfigError naming the job and the file:line)
before anything trains.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy
from megatron.core.datasets.utils import get_blend_from_list

from megatron_ext.config.data_path import is_number
from megatron_ext.config.schema import Config, SFTConfig
from megatron_ext.config.validate import ConfigError
from megatron_ext.data.sft import SFTDataError, sft_files
from megatron_ext.data.sft.dataset import Conversations, fit_to_length, pad_id, split_conversations, tokenize_sft_files
from megatron_ext.lora import tasks
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.runtime.batching import ConversationData, ExampleData, JobData, SyntheticData

SYNTHETIC = "synthetic"
TASK = "task:"
SYNTAX = f"{SYNTHETIC}, task:<{'|'.join(tasks.TASKS)}>, SFT files or folders, or a weighted mix 'W1 PATH1 W2 PATH2 ...'"


@dataclass(frozen=True)
class Dataset:
    """A `dataset` read: `synthetic`, a built-in `task`, or SFT `paths` (with `weights`: a mix,
    one part a path; without: all paths one dataset)."""

    task: Optional[str] = None
    paths: tuple[str, ...] = ()
    weights: Optional[tuple[float, ...]] = None

    @property
    def parts(self) -> list[tuple[str, ...]]:
        """The paths of each part of the mix (one part without weights)."""
        return [(p,) for p in self.paths] if self.weights else [self.paths]


def parse(spec: str) -> Dataset:
    """`spec` read, or ValueError saying what is wrong with it."""
    if spec.strip() == SYNTHETIC:
        return Dataset()
    if spec.startswith(TASK):
        if spec[len(TASK):] not in tasks.TASKS:
            raise ValueError(f"unknown task {spec[len(TASK):]!r}; use {SYNTAX}")
        return Dataset(task=spec[len(TASK):])
    words = spec.split()
    if not words:
        raise ValueError(f"no dataset named; use {SYNTAX}")
    paths, weights = get_blend_from_list(words)
    if any(is_number(p) for p in paths):
        raise ValueError(f"a weighted mix alternates weights and paths ('0.7 a.jsonl 0.3 b.jsonl'); use {SYNTAX}")
    if weights is not None and not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"the weights of a mix must be positive numbers, got {weights}")
    return Dataset(paths=tuple(paths), weights=None if weights is None else tuple(weights))


def problem(spec: str) -> Optional[str]:
    """What makes `spec` unusable before any file is read in full (its syntax, a path that is
    no SFT data), or None."""
    try:
        for path in parse(spec).paths:
            sft_files([path])
    except ValueError as error:  # SFTDataError is one
        return str(error)
    return None


class SweepData:
    """Every job's data, read on this rank: SFT files tokenized once (cached on disk by
    data/sft), each job's parts fitted to its length and split, and its real tokens per sample
    measured. Collective under torch.distributed (rank 0 tokenizes what is not cached): every
    rank builds it, for every job, before planning. `data_for(job)` then gives a job its
    data on the ranks of its pack alone."""

    def __init__(self, cfg: Config, tokenizer, vocab_size: int, jobs: Sequence[LoraJob]) -> None:
        self.cfg, self.tokenizer, self.vocab_size = cfg, tokenizer, vocab_size
        self.conversations = functools.cache(self._tokenized)
        self.task_examples = functools.cache(self._task_examples)
        self.sft: dict[str, ConversationData] = {}
        self.notes: list[str] = []  # one line a job of SFT data: what it trains and validates on
        measured = []
        for job in jobs:
            dataset = parse(job.dataset)
            if dataset.paths:
                try:
                    self.sft[job.name], note = self._conversation_data(job, dataset)
                except ValueError as error:  # SFTDataError names the file:line; bad input, refused as one line
                    raise ConfigError("lora", f"job {job.name!r}, dataset {job.dataset!r}: {error}") from None
                lengths = self.sft[job.name].lengths()
                job = job.replace(mean_tokens=float(lengths.mean()), longest_tokens=int(lengths.max()))
                self.notes.append(f"lora job {job.name!r}: {note}; {job.mean_tokens:.1f} tokens a sample on average, "
                                  f"at most {job.longest_tokens}")
            measured.append(job)
        self.jobs = measured  # with the tokens per sample their data holds

    def _sft(self) -> SFTConfig:
        """How conversations render and fit: data=sft's settings, else their defaults."""
        return self.cfg.data.sft or SFTConfig(path=[])

    def _tokenized(self, paths: tuple[str, ...]) -> Conversations:
        sft = self._sft()
        return tokenize_sft_files(list(paths), self.tokenizer, sft.prompt_format, self.cfg.data.cache_dir)

    def _task_examples(self, task: str) -> list:
        return [tasks.chat_ids(self.tokenizer.tokenize, p, a) for p, a in tasks.examples(task)]

    def _conversation_data(self, job: LoraJob, dataset: Dataset) -> tuple[ConversationData, str]:
        """The job's data, and a line on what it trains and validates on."""
        data, seed = self.cfg.data, self.cfg.train.seed
        parts = [self.conversations(paths) for paths in dataset.parts]
        first = numpy.cumsum([0] + [len(p) for p in parts[:-1]])
        train, valid, truncated, skipped = [], [], 0, 0
        for paths, part, shift in zip(dataset.parts, parts, first):
            kept, counts = fit_to_length(part, job.seq_length + 1, self._sft().overlong)
            part_train, part_valid, _ = split_conversations(kept, data.split, seed)
            if not part_train:
                raise SFTDataError(" ".join(paths), f"data.split={data.split!r} leaves no training conversation "
                                                    f"of the {len(kept)} that fit seq_length {job.seq_length}")
            train.append([i + shift for i in part_train])
            valid += [i + shift for i in part_valid]
            truncated, skipped = truncated + counts["truncated"], skipped + counts["skipped"]
        if job.eval_iters and not valid:
            raise ValueError(f"data.split={data.split!r} leaves no validation conversation "
                             "(lora.eval_iters=0 trains without one)")
        # The first eval_iters micro-batches validate: drawn from every part of a mix alike.
        valid = numpy.random.default_rng(seed).permutation(valid).tolist()
        note = (f"{sum(map(len, parts))} conversations ({truncated} truncated, {skipped} skipped as longer than "
                f"{job.seq_length + 1} tokens), {sum(map(len, train))} to train on, {len(valid)} to validate on")
        conversations = Conversations.join(parts)
        return ConversationData(job, conversations, train, dataset.weights or (1.0,), valid, pad_id(self.tokenizer)), note

    def data_for(self, job: LoraJob) -> JobData:
        if job.name in self.sft:
            return self.sft[job.name]
        dataset = parse(job.dataset)
        if dataset.task is None:
            return SyntheticData(job, self.vocab_size)
        return ExampleData(job, self.task_examples(dataset.task), self.tokenizer.eod, job.eval_iters * job.micro_batch_size)
