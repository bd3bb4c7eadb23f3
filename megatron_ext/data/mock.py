"""Megatron's mock GPT datasets (`--mock-data`): no files read, every split generated.

megatron-core's `MockGPTDataset`, built by `BlendedMegatronDatasetBuilder` as Megatron-LM's
`pretrain_gpt.py` builds it: a config without a blend is a mock config, whose split is always
"1,1,1". Each mock document is the ids 1, 2, ... (modulo the tokenizer's vocabulary) followed by
the end-of-document id, documents of random length from a fixed seed; the samples are drawn
from them with `random_seed` like any GPT dataset's.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import MockGPTDataset
from megatron.core.datasets.utils import Split

from megatron_ext.data.datasets import dataset_config
from megatron_ext.data.tokenizers import Tokenizer


def build_mock_datasets(
    tokenizer: Tokenizer,
    seq_length: int,
    num_samples: tuple[int, int, int],
    seed: int,
    cache_dir: str,
) -> tuple[Optional[MockGPTDataset], Optional[MockGPTDataset], Optional[MockGPTDataset]]:
    """Train/valid/test mock datasets with at least the requested samples; a split with 0
    requested samples comes back None. Collective under torch.distributed, like
    `build_gpt_datasets`: rank 0 writes the sample indices to `cache_dir`, the others read them."""
    config = dataset_config(tokenizer, seq_length, seed, cache_dir)
    for split in Split:
        if num_samples[split.value] == 0:
            config.split_matrix[split.value] = None
    builder = BlendedMegatronDatasetBuilder(MockGPTDataset, list(num_samples), lambda: True, config)
    train, valid, test = builder.build()
    return train, valid, test
