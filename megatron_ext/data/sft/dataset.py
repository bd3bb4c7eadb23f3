"""SFT datasets: the user's conversations tokenized once (cached by file content, tokenizer and
prompt format), split by conversation, and served as packed or single-conversation samples.

Splits follow `data.split` (Megatron-LM's --split) over a seeded shuffle of the conversations, so
a conversation is in one split only. A split is read in epochs: each epoch shuffles its
conversations again (seeded) and packs them, until the samples asked for are there; so the
samples are a pure function of the data, the seed and the sizes, and a resumed run reads on
exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy
import torch
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)

from megatron_ext.config.schema import SFTConfig
from megatron_ext.data.sft.packing import build_sample, first_fit
from megatron_ext.data.sft.records import SFTDataError, read_conversations, sft_files
from megatron_ext.data.sft.render import prompt_renderer, tokenize_conversation

# Bump when what a cached file holds changes.
FORMAT_VERSION = 1
OVERLONG = ("truncate", "skip", "error")
_log = logging.getLogger(__name__)


@dataclass
class Conversations:
    """Tokenized conversations, concatenated: conversation i is ids[offsets[i]:offsets[i+1]]."""

    ids: numpy.ndarray
    assistant: numpy.ndarray
    offsets: numpy.ndarray
    where: list[str]

    def __len__(self) -> int:
        return len(self.where)

    def lengths(self) -> numpy.ndarray:
        return numpy.diff(self.offsets)

    def piece(self, i: int, limit: Optional[int] = None) -> tuple[numpy.ndarray, numpy.ndarray]:
        begin, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if limit is not None:
            end = min(end, begin + limit)
        return self.ids[begin:end], self.assistant[begin:end]

    @staticmethod
    def join(parts: Sequence["Conversations"]) -> "Conversations":
        shifts = numpy.cumsum([0] + [len(p.ids) for p in parts[:-1]])
        offsets = [parts[0].offsets[:1]] + [p.offsets[1:] + shift for p, shift in zip(parts, shifts)]
        return Conversations(
            numpy.concatenate([p.ids for p in parts]),
            numpy.concatenate([p.assistant for p in parts]),
            numpy.concatenate(offsets),
            [w for p in parts for w in p.where],
        )


def _tokenize_file(path: Path, tokenizer, render) -> Conversations:
    ids, assistant, offsets, where = [], [], [0], []
    for conversation in read_conversations(path):
        try:
            conversation_ids, conversation_assistant = tokenize_conversation(tokenizer, render, conversation.messages)
        except Exception as e:  # the template's own raise_exception, an unknown role for it, ...
            raise SFTDataError(conversation.where, f"cannot be rendered: {e}") from None
        if not any(conversation_assistant):
            raise SFTDataError(conversation.where, "its assistant turns hold no token")
        ids += conversation_ids
        assistant += conversation_assistant
        offsets.append(len(ids))
        where.append(conversation.where)
    return Conversations(
        numpy.asarray(ids, dtype=numpy.int64), numpy.asarray(assistant, dtype=bool), numpy.asarray(offsets), where
    )


def _cache_path(cache_dir: str, path: Path, tokenizer, prompt_format: Optional[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    key = json.dumps(
        {
            "version": FORMAT_VERSION,
            "file": digest.hexdigest(),
            "tokenizer": dict(tokenizer.unique_identifiers),
            "format": prompt_format,
            "template": getattr(tokenizer, "chat_template", None) if prompt_format is None else None,
        },
        sort_keys=True,
        default=str,
    )
    name = f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    return os.path.join(cache_dir, "sft", name)


def _load_or_tokenize(path: Path, tokenizer, prompt_format: Optional[str], cache_dir: str, render) -> Conversations:
    cached = _cache_path(cache_dir, path, tokenizer, prompt_format)
    if os.path.isfile(cached):
        with numpy.load(cached) as data:
            return Conversations(
                data["ids"], data["assistant"], data["offsets"], [f"{path}:{w}" for w in data["where"].tolist()]
            )
    conversations = _tokenize_file(path, tokenizer, render)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    tmp = f"{cached}.tmp{os.getpid()}.npz"
    # the line part only: the file is named by the path it is read by, which may differ next time
    lines = numpy.asarray([w[len(str(path)) + 1 :] for w in conversations.where])
    numpy.savez(tmp, ids=conversations.ids, assistant=conversations.assistant, offsets=conversations.offsets, where=lines)
    os.replace(tmp, cached)
    return conversations


def tokenize_sft_files(
    paths: Sequence[str], tokenizer, prompt_format: Optional[str], cache_dir: str
) -> Conversations:
    """Every conversation of the files of `paths`, tokenized with `tokenizer` and the prompt
    format (None: its chat template), from the cache when the same file was read before. With
    torch.distributed initialized, all ranks call this: rank 0 tokenizes, the others read."""
    files = sft_files(paths)
    render = prompt_renderer(tokenizer, prompt_format)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_rank() != 0:
        dist.barrier()
    parts = [_load_or_tokenize(f, tokenizer, prompt_format, os.path.expanduser(cache_dir), render) for f in files]
    if distributed and dist.get_rank() == 0:
        dist.barrier()
    return Conversations.join(parts)


def fit_to_length(conversations: Conversations, capacity: int, overlong: str) -> tuple[list[int], dict[str, int]]:
    """The conversations kept (indices) under the `overlong` policy, and the counts of what it did."""
    if overlong not in OVERLONG:
        raise ValueError(f"data.sft.overlong={overlong!r}: use one of {list(OVERLONG)}")
    lengths = conversations.lengths()
    kept, truncated, skipped = [], 0, 0
    for i, length in enumerate(lengths):
        if length <= capacity:
            kept.append(i)
        elif overlong == "error":
            raise SFTDataError(
                conversations.where[i],
                f"the conversation has {length} tokens, more than a sample's {capacity} (model.seq_length + 1); "
                "set data.sft.overlong=truncate or skip",
            )
        elif overlong == "truncate" and conversations.piece(i, capacity)[1][1:].any():
            kept.append(i)
            truncated += 1
        else:
            skipped += 1
    return kept, {"conversations": len(lengths), "truncated": truncated, "skipped": skipped}


def pad_id(tokenizer) -> int:
    """The id that pads samples: the tokenizer's pad token, else its end of document."""
    pad = getattr(tokenizer, "pad", None)
    return tokenizer.eod if pad is None or pad < 0 else pad


def split_conversations(kept: Sequence[int], split: str, seed: int) -> list[list[int]]:
    """[train, valid, test] conversation indices: `split`'s shares of a seeded shuffle."""
    order = numpy.random.default_rng(seed).permutation(numpy.asarray(kept, dtype=numpy.int64))
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    n = len(order)
    return [[] if b is None else sorted(order[round(b[0] * n) : round(b[1] * n)].tolist()) for b in bounds]


class SFTDataset(torch.utils.data.Dataset):
    """At least `num_samples` samples of the conversations `indices`, epoch after epoch."""

    def __init__(
        self,
        conversations: Conversations,
        indices: Sequence[int],
        seq_length: int,
        num_samples: int,
        seed: int,
        pack: bool,
        pad: int,
    ) -> None:
        if not indices:
            raise ValueError("no conversations to make samples of")
        self.conversations = conversations
        self.seq_length = seq_length
        self.pack = pack
        self.pad = pad
        capacity = seq_length + 1
        lengths = numpy.minimum(conversations.lengths(), capacity)
        indices = numpy.asarray(indices)
        self.samples: list[list[int]] = []
        self.epochs = 0
        while len(self.samples) < num_samples:
            order = numpy.random.default_rng([seed, self.epochs]).permutation(indices)
            if pack:
                self.samples += first_fit(lengths, order, capacity)
            else:
                self.samples += [[int(i)] for i in order]
            self.epochs += 1
        used = sum(int(lengths[i]) for sample in self.samples for i in sample)
        self.padding = 1.0 - used / (len(self.samples) * capacity)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pieces = [self.conversations.piece(i, self.seq_length + 1) for i in self.samples[index]]
        sample = build_sample(pieces, self.seq_length, self.pad)
        if not self.pack:
            del sample["document_ids"]  # padding only follows the one conversation: the causal mask is enough
        return sample


def build_sft_datasets(
    sft: SFTConfig,
    tokenizer,
    seq_length: int,
    split: str,
    num_samples: Sequence[int],
    seed: int,
    cache_dir: str,
) -> tuple[Optional[SFTDataset], Optional[SFTDataset], Optional[SFTDataset]]:
    """(train, valid, test) SFT datasets of at least `num_samples` samples each: None where 0
    are asked, and a test split that `split` leaves no conversation. Collective when
    torch.distributed is initialized."""
    conversations = tokenize_sft_files(sft.path, tokenizer, sft.prompt_format, cache_dir)
    kept, counts = fit_to_length(conversations, seq_length + 1, sft.overlong)
    splits = split_conversations(kept, split, seed)
    pad = pad_id(tokenizer)
    datasets = []
    for name, indices, samples in zip(("train", "valid", "test"), splits, num_samples):
        if samples == 0:
            datasets.append(None)
            continue
        if not indices and name == "test":  # as Megatron-LM: the test set is evaluated where the split has one
            datasets.append(None)
            continue
        if not indices:
            raise ValueError(
                f"data.split={split!r} leaves the {name} split none of the {len(kept)} conversations of "
                f"data.sft.path, but {samples} {name} samples were asked for"
            )
        datasets.append(SFTDataset(conversations, indices, seq_length, samples, seed, sft.pack, pad))
    train = datasets[0]
    _log.info(
        "SFT data: %d conversations (%d truncated, %d skipped as longer than %d tokens); splits %s",
        counts["conversations"], counts["truncated"], counts["skipped"], seq_length + 1,
        "/".join(str(len(s)) for s in splits),
    )
    if train is not None:
        _log.info("SFT training samples: %d in %d epochs, %.1f%% padding", len(train), train.epochs, 100 * train.padding)
    return datasets[0], datasets[1], datasets[2]
