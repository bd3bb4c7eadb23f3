"""Held-out text kept apart by file: a corpus's files split into training and held-out sets, and
either set packed into fixed-length token windows.

A file is held out when the SHA-1 of its path relative to the files' common folder is 0 modulo
`every`, so the split depends on neither the other files nor their order (a file added to the
corpus never moves another across). Held-out perplexity measured on windows cut from random
tokens of the same files would share documents with training; by file it cannot.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Sequence

import torch


def split_by_file(files: Sequence[Path], every: int = 10) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), each in the order given; about 1 in `every` held out."""
    if every < 2:
        raise ValueError(f"every={every}: must be at least 2 (1 would hold out every file)")
    root = Path(os.path.commonpath([str(f) for f in files])) if len(files) > 1 else Path(files[0]).parent
    held = {f for f in files if _digest(Path(f).relative_to(root).as_posix()) % every == 0}
    train, heldout = [f for f in files if f not in held], [f for f in files if f in held]
    check_disjoint(train, heldout)
    return train, heldout


def _digest(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest(), 16)


def check_disjoint(train: Sequence[Path], heldout: Sequence[Path]) -> None:
    """Refuse training and held-out sets that share a file (compared after resolving links)."""
    shared = {Path(f).resolve() for f in train} & {Path(f).resolve() for f in heldout}
    if shared:
        raise ValueError(f"held-out files are also training files: {sorted(map(str, shared))[:3]} ({len(shared)} in all)")
    if not heldout or not train:
        raise ValueError(f"a file split needs files on both sides: {len(train)} training, {len(heldout)} held out")


def token_windows(
    tokenize: Callable[[str], list[int]], eod: int, files: Sequence[Path], seq: int, windows: int
) -> torch.Tensor:
    """The first `windows` windows of `seq + 1` tokens ([windows, seq + 1]; inputs and their
    next-token labels) of the files' documents in order, each document ended by `eod`."""
    need, ids = windows * (seq + 1), []
    for path in files:
        ids += tokenize(Path(path).read_text(encoding="utf-8", errors="replace")) + [eod]
        if len(ids) >= need:
            return torch.tensor(ids[:need]).view(windows, seq + 1)
    raise ValueError(f"the {len(files)} files hold {len(ids)} tokens, fewer than {windows} windows of {seq + 1}")
