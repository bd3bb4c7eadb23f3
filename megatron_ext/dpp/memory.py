"""What a stage really holds for backward, counted exactly, and when each op ran.

`ActivationMeter` counts the bytes autograd saves for backward through
`torch.autograd.graph.saved_tensors_hooks`, by storage (a tensor saved by several ops, or views
of one buffer, count once) and without parameters (they are model state, not activations),
plus the K/V prefix cache of split sequences (`hold`). A saved tensor is released when autograd drops
it (after its backward), so the running total is the stage's activation memory at every
moment, and its maximum is the peak. On CPU there is no allocator to ask; this count is the
analogue of the CUDA allocator's peak for activations.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch


class _Saved:
    """A saved tensor's stand-in in the autograd graph; its death releases the storage count."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "ActivationMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    def __init__(self, model_chunks: list) -> None:
        self._params = {
            p.untyped_storage().data_ptr() for chunk in model_chunks for p in chunk.parameters()
        }
        self._live: dict[int, list] = {}  # storage -> [bytes, references, chunk]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.by_chunk: dict[int, int] = {}  # bytes each chunk holds now
        self.peak_by_chunk: dict[int, int] = {}  # the most each chunk ever held at once
        self._chunk = -1

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_by_chunk = dict(self.by_chunk)

    def _add(self, chunk: int, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        held = self.by_chunk.get(chunk, 0) + nbytes
        self.by_chunk[chunk] = held
        self.peak_by_chunk[chunk] = max(self.peak_by_chunk.get(chunk, 0), held)

    def hold(self, tensor: torch.Tensor):
        """Count a tensor kept outside autograd (the K/V prefix cache) until the returned
        handle is dropped; a storage autograd also saves counts once."""
        return self._pack(tensor)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._params:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1, self._chunk]
            self._add(self._chunk, storage.nbytes())
        else:
            entry[1] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self._add(entry[2], -entry[0])

    @contextlib.contextmanager
    def track(self, chunk: int) -> Iterator[None]:
        """Count what autograd saves while chunk `chunk` runs (its forward, or the recompute
        inside its backward)."""
        previous, self._chunk = self._chunk, chunk
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._chunk = previous


@dataclass
class Timeline:
    """When each op of a stage ran: (stage, kind, chunk, recompute, start, end), times from
    `time.perf_counter()` (a monotonic clock that the processes of one machine share, so the
    stages' records line up once gathered)."""

    records: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)

    def record(self, stage: int, kind: str, chunk: int, recompute: int, start: float, end: float) -> None:
        self.records.append((stage, kind, chunk, recompute, start, end))

    def clear(self) -> None:
        self.records.clear()
