"""Conversations packed into fixed-length samples, each keeping to itself.

A sample holds `seq_length + 1` tokens (inputs and their next-token labels) of one or more whole
conversations, then padding. In the sample:
  - positions restart at 0 with each conversation (Megatron's `reset_position_ids`);
  - `document_ids` numbers the conversations, so attention can be kept within each one (the
    block-diagonal causal mask of `document_mask`, Megatron's `reset_attention_mask`); the
    padding is a document of its own, so no row of the mask is empty;
  - the loss falls on a label that is an assistant token of the same conversation as its input
    (`loss_mask`); `conversation_mask` marks every label that is a token of the same conversation
    as its input (all a conversation predicts of itself: no padding, no next conversation's first
    token), of which `loss_mask` is the assistant's part. (The last input's label lies beyond
    `document_ids`, so which conversation it belongs to is written down here, where it is known.)
So a packed sample's loss is the sum of its conversations' losses trained one by one.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy
import torch

# First-fit looks for room among the newest open samples only, so packing stays linear.
OPEN_SAMPLES = 64


def first_fit(lengths: Sequence[int], order: Sequence[int], capacity: int) -> list[list[int]]:
    """Conversations (indices into `lengths`, taken in `order`) grouped into samples of at most
    `capacity` tokens: each goes to the first of the newest open samples with room, else a new one."""
    samples: list[list[int]] = []
    room: list[int] = []
    for index in order:
        length = lengths[index]
        if length > capacity:
            raise ValueError(f"conversation {index} has {length} tokens, more than a sample's {capacity}")
        first_open = max(0, len(samples) - OPEN_SAMPLES)
        target = next((s for s in range(first_open, len(samples)) if room[s] >= length), None)
        if target is None:
            samples.append([])
            room.append(capacity)
            target = len(samples) - 1
        samples[target].append(index)
        room[target] -= length
    return samples


def build_sample(
    pieces: Sequence[tuple[numpy.ndarray, numpy.ndarray]], seq_length: int, pad: int
) -> dict[str, torch.Tensor]:
    """The training sample of conversations `pieces` ((ids, assistant mask) each, at most
    `seq_length + 1` tokens in all): tokens, labels, loss_mask, conversation_mask, position_ids,
    document_ids, each of `seq_length`."""
    total = seq_length + 1
    ids = numpy.full(total, pad, dtype=numpy.int64)
    assistant = numpy.zeros(total, dtype=bool)
    positions = numpy.zeros(total, dtype=numpy.int64)
    documents = numpy.full(total, len(pieces), dtype=numpy.int64)  # the padding's own document
    at = 0
    for number, (piece_ids, piece_assistant) in enumerate(pieces):
        n = len(piece_ids)
        ids[at : at + n] = piece_ids
        assistant[at : at + n] = piece_assistant
        positions[at : at + n] = numpy.arange(n)
        documents[at : at + n] = number
        at += n
    if at > total:
        raise ValueError(f"{at} tokens do not fit a sample of {total}")
    positions[at:] = numpy.arange(total - at)
    same_document = documents[1:] == documents[:-1]
    conversation = documents[:-1] < len(pieces)  # not the padding
    return {
        "tokens": torch.from_numpy(ids[:-1].copy()),
        "labels": torch.from_numpy(ids[1:].copy()),
        "loss_mask": torch.from_numpy((assistant[1:] & same_document).astype(numpy.float32)),
        "conversation_mask": torch.from_numpy((conversation & same_document).astype(numpy.float32)),
        "position_ids": torch.from_numpy(positions[:-1].copy()),
        "document_ids": torch.from_numpy(documents[:-1].copy()),
    }


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's attention mask ([b, 1, s, s], True where attention is not allowed) that keeps
    each token to the earlier tokens of its own document."""
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return ~(same & causal).unsqueeze(1)


def attention_mask_of(batch: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """The attention mask a model takes for `batch`: its documents' (`document_mask`) when the
    batch numbers them, else None (the model's own causal mask)."""
    return document_mask(batch["document_ids"]) if "document_ids" in batch else None
