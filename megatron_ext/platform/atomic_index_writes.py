"""megatron-core's dataset index caches, written to a temporary name and renamed into place.

GPTDataset and BlendedDataset save their index files (document/sample/shuffle index,
dataset index) with `numpy.save(path, array, allow_pickle=True)` straight to the final name,
and take any file present as a cache hit. A full disk or a killed build then leaves a truncated
file that every later run trusts ("mmap length is greater than file size"). megatron has no
hook for the writer, so these modules get a module-local `numpy` (the real one, except `save`)
whose `save` writes `<name>.tmp<pid>` in the same folder, syncs it and renames it over the
final name: a reader sees the whole file or none. Checked against megatron-core 0.16.1; a
megatron whose modules do not save through a module-global `numpy` is left as it is (the
runtime still drops a truncated index before a build: megatron_ext.data.cache_files).
"""

from __future__ import annotations

import importlib
import os
import types

import numpy

MODULES = ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset")


def save_atomically(file, arr, allow_pickle: bool = True, **kwargs) -> None:
    """numpy.save, except that a path is written whole or not at all."""
    if not isinstance(file, (str, os.PathLike)):
        numpy.save(file, arr, allow_pickle=allow_pickle, **kwargs)
        return
    path = os.fspath(file)
    if not path.endswith(".npy"):
        path += ".npy"  # numpy.save's own rule for a path
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            numpy.save(f, arr, allow_pickle=allow_pickle, **kwargs)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, path) from e  # a write to a file object names no file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class NumpyWithAtomicSave(types.ModuleType):
    """A module-local `numpy` for megatron's dataset modules: the real numpy but for `save`."""

    def __init__(self) -> None:
        super().__init__("numpy")
        self.save = save_atomically

    def __getattr__(self, name: str):
        return getattr(numpy, name)


NUMPY_WITH_ATOMIC_SAVE = NumpyWithAtomicSave()


def make_index_writes_atomic() -> list[str]:
    """Give megatron's dataset modules the atomic `save` (idempotent). Returns the modules
    that write through it."""
    redirected = []
    for name in MODULES:
        module = importlib.import_module(name)
        if module.__dict__.get("numpy") is numpy:
            module.numpy = NUMPY_WITH_ATOMIC_SAVE
        if module.__dict__.get("numpy") is NUMPY_WITH_ATOMIC_SAVE:
            redirected.append(name)
    return redirected
