"""Two gloo ranks: rank 0 alone builds the corpus and index caches; ranks split batches exactly."""

from pathlib import Path

import pytest
import torch

from megatron_ext.data import (
    ByteTokenizer,
    build_data_iterator,
    build_gpt_datasets,
    default_corpus_prefix,
)
from megatron_ext.platform.launch import launch_local

pytestmark = pytest.mark.distributed

WORLD = 2
MBS = 2


def _datasets(prefix: str, cache: str):
    return build_gpt_datasets([prefix], ByteTokenizer(), 16, "90,10,0", (64, 8, 0), 3, cache)


def _rank_main(tmp: Path, corpus: str) -> dict:
    from megatron_ext.data import preprocess
    from megatron_ext.platform.launch import join_world

    real_build = preprocess.build_indexed_dataset

    def logged_build(documents, tokenizer, prefix):
        with open(tmp / "builds.log", "a") as f:
            f.write(f"{torch.distributed.get_rank()}\n")
        return real_build(documents, tokenizer, prefix)

    preprocess.build_indexed_dataset = logged_build
    launch, _ = join_world("cpu")
    try:
        prefix = default_corpus_prefix(str(tmp / "cache"), corpus, "byte")
        train, _, _ = _datasets(prefix, str(tmp / "index"))
        batches = list(build_data_iterator(train, MBS, launch.rank, WORLD, consumed_samples=4))
        return {"prefix": prefix, "batches": batches}
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_build_once_and_split_the_global_order(tmp_path):
    corpus = tmp_path / "text"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text(f"text number {i} " * (5 + i))
    results = launch_local(WORLD, _rank_main, (tmp_path, str(corpus)), "127.0.0.1", 0)

    assert (tmp_path / "builds.log").read_text().split() == ["0"]  # only rank 0 tokenized
    assert results[0]["prefix"] == results[1]["prefix"]

    # reference: one process, dp=1, fresh index cache, same consumed_samples
    train, _, _ = _datasets(results[0]["prefix"], str(tmp_path / "single"))
    single = [b["tokens"] for b in build_data_iterator(train, MBS, 0, 1, consumed_samples=4)]
    steps = len(results[0]["batches"])
    assert steps == len(results[1]["batches"]) == (len(train) - 4) // (MBS * WORLD)
    merged = [results[r]["batches"][k]["tokens"] for k in range(steps) for r in range(WORLD)]
    assert all(torch.equal(a, b) for a, b in zip(merged, single))
