"""Tokenizers, the default corpus, Megatron indexed datasets, GPT datasets and batches."""

from megatron_ext.data.corpus import DEFAULT_MAX_BYTES, corpus_files, iter_documents
from megatron_ext.data.datasets import (
    BATCH_KEYS,
    PretrainingSampler,
    build_data_iterator,
    build_gpt_datasets,
)
from megatron_ext.data.preprocess import build_indexed_dataset, default_corpus_prefix
from megatron_ext.data.hf_tokenizer import HFTokenizer
from megatron_ext.data.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron_ext.data.tokenizers import ByteTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "BATCH_KEYS",
    "DEFAULT_MAX_BYTES",
    "ByteTokenizer",
    "HFTokenizer",
    "PretrainingSampler",
    "SentencePieceTokenizer",
    "Tokenizer",
    "build_data_iterator",
    "build_gpt_datasets",
    "build_indexed_dataset",
    "build_tokenizer",
    "corpus_files",
    "default_corpus_prefix",
    "iter_documents",
]
