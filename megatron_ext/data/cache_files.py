"""Cached data files that are trusted only when whole.

Every cache file is written to a temporary name and renamed (the corpus in preprocess.py,
megatron's dataset indices through megatron_ext.platform.atomic_index_writes), but a file left
by an older version, or cut by a full disk before that, may be truncated. Such a file is found
by its size against its own header (a .npy's shape and dtype, an indexed dataset's .idx) and
removed, so that the build that follows writes it again. A build that runs out of space ends
in one line naming the file and the space left.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import struct
from typing import Iterator

import numpy
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

from megatron_ext.config.validate import ConfigError
from megatron_ext.platform.disk_space import disk_full

_log = logging.getLogger(__name__)


def npy_is_whole(path: str) -> bool:
    """Whether the .npy file at `path` holds every byte its header promises (numpy's memory
    map checks the size against the header's shape and dtype)."""
    try:
        numpy.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError):  # "mmap length is greater than file size", a cut header
        return False
    return True


def drop_truncated_indices(cache_dir: str) -> list[str]:
    """Remove every truncated .npy index in `cache_dir` (megatron then finds the cache
    incomplete and builds it again). Returns the paths removed."""
    removed = []
    for path in sorted(glob.glob(os.path.join(glob.escape(cache_dir), "*.npy"))):
        if not npy_is_whole(path):
            _log.warning("%s is truncated (an interrupted write): removed, it is built again", path)
            os.remove(path)
            removed.append(path)
    return removed


def indexed_dataset_is_whole(prefix: str) -> bool:
    """Whether `<prefix>.bin/.idx` exist and the .bin is as long as the .idx says."""
    if not IndexedDataset.exists(prefix):
        return False
    try:
        index = IndexedDataset(prefix).index
        last = len(index) - 1
        expected = int(index.sequence_pointers[last]) + int(index.sequence_lengths[last]) * index.dtype_size
    except (OSError, ValueError, IndexError, AssertionError, struct.error):  # a cut .idx, an empty file
        return False
    return os.path.getsize(get_bin_path(prefix)) == expected and os.path.getsize(get_idx_path(prefix)) > 0


@contextlib.contextmanager
def full_disk_named(cache_dir: str) -> Iterator[None]:
    """A write under `cache_dir` that runs out of space: one line (data.cache_dir) naming the
    file, where the error names it, and the space left."""
    try:
        yield
    except OSError as e:
        reason = disk_full(e, e.filename or cache_dir)
        if reason is None:
            raise
        raise ConfigError("data.cache_dir", reason) from e
