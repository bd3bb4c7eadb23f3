"""GPT datasets over indexed datasets, and the resumable data-parallel sampler and iterator."""

import re

import numpy
import pytest
import torch

from megatron_ext.data import (
    ByteTokenizer,
    PretrainingSampler,
    build_data_iterator,
    build_gpt_datasets,
    build_indexed_dataset,
)

SEQ = 32


def _words(i: int) -> str:
    return " ".join(f"w{i}x{j}" for j in range(i % 7 + 3))


def _documents(count: int, letter: str = "") -> list[str]:
    return [f"{letter}doc {i} {_words(i)}" for i in range(count)]


@pytest.fixture
def prefix(tmp_path):
    return build_indexed_dataset(_documents(60), ByteTokenizer(), str(tmp_path / "corpus"))


def _build(prefix_or_blend, cache_dir, seed=7, num_samples=(200, 20, 5), split="80,15,5"):
    data_path = prefix_or_blend if isinstance(prefix_or_blend, list) else [prefix_or_blend]
    return build_gpt_datasets(
        data_path, ByteTokenizer(), SEQ, split, num_samples, seed, str(cache_dir)
    )


def _all_tokens(dataset) -> numpy.ndarray:
    return numpy.stack([dataset[i]["tokens"].numpy() for i in range(len(dataset))])


def test_samples_are_shifted_windows_of_the_documents(prefix, tmp_path):
    train, valid, test = _build(prefix, tmp_path / "cache")
    assert len(train) >= 200 and len(valid) >= 20 and len(test) >= 5
    stream = ByteTokenizer().detokenize  # eod is dropped, so compare on the text
    corpus_text = "".join(_documents(60))
    for i in range(0, len(train), 17):
        sample = train[i]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}  # no [s, s] mask
        assert sample["tokens"].shape == (SEQ,) and sample["tokens"].dtype == torch.long
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ))
        assert torch.equal(sample["loss_mask"], torch.ones(SEQ))
        # a window of consecutive tokens: inside one document, its text is in the corpus
        ids = torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()
        if 256 not in ids:
            assert stream(ids) in corpus_text


def test_same_seed_same_samples_other_seed_other_order(prefix, tmp_path):
    first = _all_tokens(_build(prefix, tmp_path / "a")[0])
    again = _all_tokens(_build(prefix, tmp_path / "b")[0])  # fresh cache: rebuilt, not loaded
    other = _all_tokens(_build(prefix, tmp_path / "c", seed=8)[0])
    numpy.testing.assert_array_equal(first, again)
    assert not numpy.array_equal(first, other)


def test_splits_hold_disjoint_documents(prefix, tmp_path):
    train, valid, _ = _build(prefix, tmp_path / "cache")
    # documents are numbered in their text; 80% of 60 go to train, the next 15% to valid
    def doc_numbers(dataset):
        texts = [ByteTokenizer().detokenize(tokens) for tokens in _all_tokens(dataset)]
        return {int(n) for text in texts for n in re.findall(r"doc (\d+) ", text)}

    assert doc_numbers(train) == set(range(48))  # small docs: every one is seen whole
    assert doc_numbers(valid) <= set(range(48, 57)) and doc_numbers(valid)


def test_weighted_blend_follows_the_weights(tmp_path):
    tok = ByteTokenizer()
    a = build_indexed_dataset(_documents(40, "A"), tok, str(tmp_path / "a"))
    b = build_indexed_dataset(_documents(40, "B"), tok, str(tmp_path / "b"))
    train, _, _ = _build(["0.25", a, "0.75", b], tmp_path / "cache", num_samples=(400, 0, 0))
    assert len(train) == 400
    counts = {"A": 0, "B": 0}
    for i in range(len(train)):
        text = tok.detokenize(train[i]["tokens"])
        counts["A"] += "Adoc" in text
        counts["B"] += "Bdoc" in text
    assert abs(counts["A"] / (counts["A"] + counts["B"]) - 0.25) < 0.08


def test_unrequested_split_is_none_and_empty_split_is_an_error(prefix, tmp_path):
    train, valid, test = _build(prefix, tmp_path / "cache", num_samples=(50, 0, 0))
    assert len(train) >= 50 and valid is None and test is None
    with pytest.raises(ValueError, match="data.split.*test split no documents"):
        _build(prefix, tmp_path / "cache", split="98,2,0")
    with pytest.raises(FileNotFoundError, match="data.data_path"):
        _build(str(tmp_path / "missing"), tmp_path / "cache")


def _global_order(total, consumed, mbs, dp, steps):
    samplers = [iter(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    order = []
    for _ in range(steps):
        for sampler in samplers:  # rank order within a global step
            order.extend(next(sampler))
    return order


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sampler_global_order_does_not_depend_on_dp(dp):
    # independent reference: the global order is simply the sample ids in sequence
    assert _global_order(1000, 0, 3, dp, 40 // dp) == list(range(120))
    assert _global_order(1000, 36, 3, dp, 40 // dp) == list(range(36, 156))


def test_sampler_resume_and_rank_slices():
    full = list(PretrainingSampler(100, 0, 2, 1, 3))
    assert full[0] == [2, 3] and full[1] == [8, 9]
    assert len(full) == 100 // 6  # the trailing partial global batch is dropped
    resumed = list(PretrainingSampler(100, 5 * 6, 2, 1, 3))
    assert resumed == full[5:]
    # resuming with another dp size continues with the very next sample
    assert list(PretrainingSampler(100, 30, 3, 0, 2))[0] == [30, 31, 32]
    with pytest.raises(ValueError):
        PretrainingSampler(100, 101, 2, 0, 1)
    with pytest.raises(ValueError):
        PretrainingSampler(100, 0, 2, 2, 2)


def test_iterator_batches_and_resume(prefix, tmp_path):
    train, _, _ = _build(prefix, tmp_path / "cache")
    batches = list(build_data_iterator(train, 4, 0, 1, consumed_samples=0))
    assert len(batches) == len(train) // 4
    first = batches[0]
    assert first["tokens"].shape == (4, SEQ) and first["tokens"].dtype == torch.long
    assert first["loss_mask"].dtype == torch.float32 and first["position_ids"].dtype == torch.long
    assert torch.equal(first["tokens"][2], train[2]["tokens"])
    resumed = build_data_iterator(train, 4, 0, 1, consumed_samples=12)
    assert torch.equal(next(resumed)["tokens"], batches[3]["tokens"])
    # two dp ranks at the same point together hold the same 8 samples, in rank order
    r0, r1 = (next(build_data_iterator(train, 4, r, 2, 0, num_workers=0)) for r in (0, 1))
    assert torch.equal(torch.cat([r0["labels"], r1["labels"]]),
                       torch.cat([batches[0]["labels"], batches[1]["labels"]]))


def test_iterator_with_worker_processes(prefix, tmp_path):
    train, _, _ = _build(prefix, tmp_path / "cache")
    plain = build_data_iterator(train, 2, 1, 2, consumed_samples=8)
    workers = build_data_iterator(train, 2, 1, 2, consumed_samples=8, num_workers=1)
    for _ in range(3):
        assert torch.equal(next(plain)["tokens"], next(workers)["tokens"])
