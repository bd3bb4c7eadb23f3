"""Text -> Megatron indexed dataset (.bin/.idx), and the cached default corpus."""

import contextlib
import fcntl
import hashlib
import json
import os
import re
from typing import Iterable, Iterator

import numpy
import torch
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from megatron_ext.data.cache_files import full_disk_named, indexed_dataset_is_whole
from megatron_ext.data.corpus import DEFAULT_MAX_BYTES, corpus_fingerprint, iter_documents
from megatron_ext.data.tokenizers import Tokenizer, build_tokenizer

# Bump when what a cached dataset contains changes (eod placement, document rules, ...), so
# that old caches are not trusted.
FORMAT_VERSION = 1


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _remove_if_present(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def build_indexed_dataset(
    documents: Iterable[str], tokenizer: Tokenizer, output_prefix: str
) -> str:
    """Write `<output_prefix>.bin/.idx`: one sequence per non-empty document, eod appended.

    The files are written under temporary names and renamed into place at the end (.idx last,
    as the commit mark), so an interrupted build never leaves a dataset that looks complete.
    Returns output_prefix.
    """
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp{os.getpid()}"
    tmp_bin, tmp_idx = get_bin_path(tmp_prefix), get_idx_path(tmp_prefix)
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=DType.optimal_dtype(tokenizer.vocab_size))
        num_documents = 0
        for text in documents:
            if not text:
                continue
            ids = tokenizer.tokenize(text) + [tokenizer.eod]
            builder.add_document(numpy.asarray(ids), [len(ids)])
            num_documents += 1
        if num_documents == 0:
            raise ValueError(f"no text to write to {output_prefix}: every document is empty")
        builder.finalize(tmp_idx)
        _fsync(tmp_bin)
        _fsync(tmp_idx)
        # A stale .idx next to the new .bin would pass for a complete dataset: drop it first.
        _remove_if_present(get_idx_path(output_prefix))
        os.replace(tmp_bin, get_bin_path(output_prefix))
        os.replace(tmp_idx, get_idx_path(output_prefix))
    finally:
        _remove_if_present(tmp_bin, tmp_idx)
    return output_prefix


def _cache_prefix(cache_dir: str, corpus: str, tokenizer: Tokenizer, max_bytes: int) -> str:
    key = json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "corpus": corpus,
            "corpus_fingerprint": corpus_fingerprint(corpus, max_bytes),
            "tokenizer": tokenizer.unique_identifiers,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(corpus.rstrip("/")) or "corpus")
    return os.path.join(os.path.expanduser(cache_dir), "corpus", f"{label}-{digest}")


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_once(prefix: str, corpus: str, tokenizer: Tokenizer, max_bytes: int) -> None:
    # The lock serialises independent processes (separate jobs, test workers) sharing a cache.
    with _file_lock(prefix + ".lock"):
        if not indexed_dataset_is_whole(prefix):  # none yet, or cut by a full disk or a kill
            with full_disk_named(os.path.dirname(prefix)):
                build_indexed_dataset(iter_documents(corpus, max_bytes), tokenizer, prefix)


def default_corpus_prefix(
    cache_dir: str, corpus: str, tokenizer_name: str, max_bytes: int = DEFAULT_MAX_BYTES
) -> str:
    """The prefix of the indexed dataset of `corpus` tokenized by `tokenizer_name`.

    Built on first use under cache_dir/corpus/, keyed by the corpus (spec, files, cap), the
    tokenizer's identity and FORMAT_VERSION. With torch.distributed initialized every rank must
    call this: global rank 0 builds while the others wait at a barrier, so cache_dir must be on
    a filesystem all ranks see.
    """
    tokenizer = build_tokenizer(tokenizer_name)
    prefix = _cache_prefix(cache_dir, corpus, tokenizer, max_bytes)
    if not torch.distributed.is_initialized():
        _build_once(prefix, corpus, tokenizer, max_bytes)
        return prefix
    if torch.distributed.get_rank() == 0:
        try:
            _build_once(prefix, corpus, tokenizer, max_bytes)
        finally:
            # Release the other ranks even on failure, so they fail too instead of hanging.
            torch.distributed.barrier()
    else:
        torch.distributed.barrier()
        if not IndexedDataset.exists(prefix):
            raise RuntimeError(
                f"rank 0 did not build {prefix}: it failed, or data.cache_dir is not on a "
                "filesystem shared by all ranks"
            )
    return prefix
