"""GPT datasets from Megatron indexed datasets, and the resumable per-rank batch iterator."""

import os
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron_ext.config.validate import ConfigError
from megatron_ext.data.cache_files import drop_truncated_indices, full_disk_named
from megatron_ext.data.tokenizers import Tokenizer
from megatron_ext.platform.atomic_index_writes import make_index_writes_atomic
from megatron_ext.platform.blended_dataset_rank import single_process_is_rank_zero

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
# Keys some datasets add: SFT samples mark every token a conversation predicts of itself, packed
# ones number their conversations (data/sft/packing.py).
OPTIONAL_BATCH_KEYS = ("conversation_mask", "document_ids")


def _always() -> bool:
    return True


def _documents_in_split(bounds: Optional[tuple[float, float]], num_documents: int) -> int:
    # the same rounding BlendedMegatronDatasetBuilder uses to cut the documents
    if bounds is None:
        return 0
    return round(bounds[1] * num_documents) - round(bounds[0] * num_documents)


def split_has_documents(data_path: Sequence[str], split: str, split_kind: Split) -> bool:
    """Whether `split` (megatron's "969,30,1") leaves `split_kind` documents of every dataset
    of `data_path` (prefixes, optionally weighted as megatron's --data-path)."""
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[split_kind.value]
    prefixes = get_blend_from_list(list(data_path))[0]
    return all(
        _documents_in_split(bounds, IndexedDataset(p).sequence_lengths.shape[0]) > 0 for p in prefixes
    )


def check_split_coverage(prefixes: Sequence[str], split: str, reads: Mapping[Split, str]) -> None:
    """Raise ConfigError (data.split) for the first dataset of `prefixes` to which `split`
    (megatron's "969,30,1") leaves no documents in a split the run reads: `reads` maps each such
    split to what reads it, for the message. Megatron would draw samples from it for ever."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix in prefixes:
        if not IndexedDataset.exists(prefix):
            raise FileNotFoundError(f"data.data_path: no {prefix}.bin/.idx")
        num_documents = IndexedDataset(prefix).sequence_lengths.shape[0]
        for kind, reader in reads.items():
            if _documents_in_split(matrix[kind.value], num_documents) <= 0:
                raise ConfigError(
                    "data.split",
                    f"{split!r} leaves the {kind.name} split no documents of {prefix} ({num_documents} documents), "
                    f"but {reader}",
                )


def dataset_config(tokenizer: Tokenizer, seq_length: int, seed: int, cache_dir: str, **sources) -> GPTDatasetConfig:
    """megatron's GPTDatasetConfig as every dataset here is read: whole causal samples, no
    per-sample mask. `sources`: the blend and split (none for mock data)."""
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # GPTModel with a causal mask type builds the mask itself; a [1, s, s] mask per sample
        # would dominate batch memory at long sequence lengths.
        create_attention_mask=False,
        **sources,
    )


def build_gpt_datasets(
    data_path: list[str],
    tokenizer: Tokenizer,
    seq_length: int,
    split: str,
    num_samples: tuple[int, int, int],
    seed: int,
    cache_dir: str,
    is_built_on_rank: Callable[[], bool] = _always,
) -> tuple[Optional[GPTDataset], Optional[GPTDataset], Optional[GPTDataset]]:
    """Train/valid/test GPT datasets, each with at least the requested number of samples.

    data_path follows megatron's --data-path: prefixes, optionally as weight/prefix pairs
    ("0.7", "a", "0.3", "b"). A split with 0 requested samples is not built and comes back None,
    as does every split on ranks where is_built_on_rank() is False (megatron's convention; it
    must be True on global rank 0). Index caches go to cache_dir, each written whole or not at
    all; a truncated one (left by an older version) is built again. With torch.distributed
    initialized, all ranks must call this: rank 0 builds the caches, then the others read them.
    """
    if not data_path:
        raise ValueError("data.data_path is empty: give at least one dataset prefix")
    blend = get_blend_from_list(list(data_path))
    config = dataset_config(tokenizer, seq_length, seed, cache_dir, blend=blend, split=split)
    requested = {kind: f"{n} {kind.name} samples were requested" for kind in Split if (n := num_samples[kind.value])}
    check_split_coverage(blend[0], split, requested)
    for split_kind in Split:
        if num_samples[split_kind.value] == 0:
            config.split_matrix[split_kind.value] = None
    make_index_writes_atomic()
    if os.path.isdir(cache_dir) and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        drop_truncated_indices(cache_dir)  # the others read the caches after rank 0 has built them
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), is_built_on_rank, config)
    with single_process_is_rank_zero(), full_disk_named(cache_dir):
        train, valid, test = builder.build()
    return train, valid, test


class PretrainingSampler:
    """Micro-batches of sample indices for one data-parallel rank, in one fixed global order.

    Global step k covers samples [consumed + k*mbs*dp, consumed + (k+1)*mbs*dp); rank r takes
    the r-th contiguous slice of mbs. Everything is a function of the global sample count, so
    resuming at `consumed_samples`, with the same or another dp size, continues the same order
    with nothing skipped or repeated. A trailing partial global batch is dropped so all ranks
    take the same number of steps.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro_batch_size and data_parallel_size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})"
            )
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} not in [0, {total_samples}]")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for step in range(len(self)):
            begin = first + step * self.global_micro_batch
            yield list(range(begin, begin + self.micro_batch_size))


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    # Only the GPT keys: a blend adds "dataset_id", and the batch layout must not depend on it.
    keys = BATCH_KEYS + tuple(key for key in OPTIONAL_BATCH_KEYS if key in samples[0])
    return {key: torch.stack([sample[key] for sample in samples]) for key in keys}


def build_data_iterator(
    dataset: torch.utils.data.Dataset,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    consumed_samples: int,
    num_workers: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Iterate this rank's micro-batches from `consumed_samples` on.

    Batches are dicts of [micro_batch_size, seq_length] tensors: tokens, labels, position_ids
    (long) and loss_mask (float).
    """
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=_collate,
        persistent_workers=num_workers > 0,
        # Each new iterator draws its workers' base seed; from torch's global generator that
        # draw would shift dropout's random numbers: after a resume (which builds the iterator
        # after restoring them) and at each evaluation.
        generator=torch.Generator().manual_seed(0),
    )
    return iter(loader)
