"""A pretrained model as read from a file: its ModelConfig and its Hugging Face-named tensors.

A pretrained file (safetensors, GGUF) says every tensor's shape in its header, so a whole model
is checked against its config before any weight is read or written; afterwards each process
reads only the tensors its pipeline stage holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch

from megatron_ext.config.schema import ModelConfig


class LazyTensors(Mapping[str, torch.Tensor]):
    """A read-only mapping name -> tensor that reads a tensor each time it is looked up."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], read: Callable[[str], torch.Tensor], origin: str) -> None:
        self.shapes = dict(shapes)
        self.origin = origin
        self._read = read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(f"{self.origin} has no tensor {name}")
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@dataclass(frozen=True)
class Pretrained:
    """A checked pretrained model: `tensors` has exactly the tensors `config` implies, in
    Hugging Face names, layout and RoPE convention (rotate_half)."""

    config: ModelConfig
    tensors: LazyTensors
    path: str
    # Token ids for an exported config.json (bos_token_id, eos_token_id, pad_token_id).
    token_ids: dict = field(default_factory=dict)
