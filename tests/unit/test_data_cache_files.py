"""Cached data files are written whole or not at all, and a truncated one (a full disk, a kill,
an older version) is found and built again instead of failing every later run."""

from __future__ import annotations

import errno
import io
import os
import re
from pathlib import Path

import numpy
import pytest

from megatron_ext.config.validate import ConfigError
from megatron_ext.data import ByteTokenizer, build_gpt_datasets, build_indexed_dataset
from megatron_ext.data.cache_files import npy_is_whole
from megatron_ext.data.preprocess import default_corpus_prefix

SEQ = 32
NUM_SAMPLES = (300, 0, 0)


@pytest.fixture
def prefix(tmp_path) -> str:
    documents = [f"doc {i} " + " ".join(f"w{i}x{j}" for j in range(i % 7 + 3)) for i in range(60)]
    return build_indexed_dataset(documents, ByteTokenizer(), str(tmp_path / "corpus"))


def _samples(prefix: str, cache: Path) -> numpy.ndarray:
    train, _, _ = build_gpt_datasets([prefix], ByteTokenizer(), SEQ, "100,0,0", NUM_SAMPLES, 7, str(cache))
    return numpy.stack([train[i]["tokens"].numpy() for i in range(len(train))])


def _shuffle_index(cache: Path) -> Path:
    (path,) = cache.glob("*-shuffle_index.npy")
    return path


def _disk_full_writing(name: str, monkeypatch) -> None:
    """Writing a .npy whose file name holds `name` stops half-way with ENOSPC, as on a full
    disk: the first half of its bytes is written, then the write fails."""
    write_array = numpy.lib.format.write_array

    def half_then_full(fp, array, *args, **kwargs):
        if name not in str(getattr(fp, "name", "")):
            return write_array(fp, array, *args, **kwargs)
        whole = io.BytesIO()
        write_array(whole, array, *args, **kwargs)
        fp.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(numpy.lib.format, "write_array", half_then_full)


def test_a_full_disk_while_writing_an_index_leaves_no_truncated_file(prefix, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    with monkeypatch.context() as patch:
        _disk_full_writing("shuffle_index", patch)
        with pytest.raises(ConfigError) as full:
            _samples(prefix, cache)
    # one line naming the file and the space left on its filesystem
    (index,) = re.findall(r"^data\.cache_dir: (\S+-shuffle_index\.npy): no space left on its filesystem \(.+ free of .+\)$", str(full.value))
    assert os.path.dirname(index) == str(cache)
    assert not list(cache.glob("*shuffle_index*"))  # neither a cut file nor its temporary one
    assert all(npy_is_whole(str(p)) for p in cache.glob("*.npy"))
    # The next run builds it, and reads what a run on an empty cache reads.
    numpy.testing.assert_array_equal(_samples(prefix, cache), _samples(prefix, tmp_path / "fresh"))
    assert npy_is_whole(str(_shuffle_index(cache)))


def test_a_truncated_index_in_the_cache_is_built_again(prefix, tmp_path):
    cache = tmp_path / "cache"
    expected = _samples(prefix, cache)
    index = _shuffle_index(cache)
    whole = index.read_bytes()
    index.write_bytes(whole[: len(whole) // 2])  # as an older version left it on a full disk
    numpy.testing.assert_array_equal(_samples(prefix, cache), expected)
    assert index.read_bytes() == whole


NPY_FILES = {
    "whole": (lambda data: data, True),
    "cut_in_the_data": (lambda data: data[:-3], False),
    "cut_in_the_header": (lambda data: data[:20], False),
    "empty": (lambda data: b"", False),
}


@pytest.mark.parametrize("case", NPY_FILES)
def test_a_npy_file_is_whole_when_it_holds_what_its_header_says(tmp_path, case):
    cut, whole = NPY_FILES[case]
    buffer = io.BytesIO()
    numpy.save(buffer, numpy.arange(100, dtype=numpy.int32))
    path = tmp_path / "a.npy"
    path.write_bytes(cut(buffer.getvalue()))
    assert npy_is_whole(str(path)) == whole


@pytest.mark.parametrize("part", [".bin", ".idx"])
def test_a_truncated_default_corpus_is_built_again(tmp_path, part):
    text = tmp_path / "text"
    text.mkdir()
    for i in range(5):
        (text / f"{i}.txt").write_text(f"document {i} " * (i + 3))
    cache = str(tmp_path / "cache")
    prefix = default_corpus_prefix(cache, str(text), "byte")
    whole = Path(prefix + part).read_bytes()
    Path(prefix + part).write_bytes(whole[: len(whole) // 2])
    assert default_corpus_prefix(cache, str(text), "byte") == prefix
    assert Path(prefix + part).read_bytes() == whole


def test_megatron_writes_its_indices_through_the_atomic_save():
    # The installed megatron-core saves with a module-global numpy.save (0.16.1); a version that
    # no longer does needs another way (platform/atomic_index_writes.py).
    from megatron_ext.platform.atomic_index_writes import MODULES, make_index_writes_atomic

    assert make_index_writes_atomic() == list(MODULES)
