"""Supervised fine-tuning data: the user's conversations, the loss on the assistant's tokens.

  records.py  JSONL / JSON / Parquet records -> conversations, errors naming file:line
  render.py   a conversation -> token ids and the assistant's tokens (chat template or format)
  packing.py  conversations packed into samples, each attending to itself
  dataset.py  the tokenized cache, the split by conversation, the datasets
"""

from megatron_ext.data.sft.dataset import build_sft_datasets, tokenize_sft_files
from megatron_ext.data.sft.packing import attention_mask_of, document_mask
from megatron_ext.data.sft.records import SFTDataError, read_conversations, sft_files
from megatron_ext.data.sft.render import PROMPT_FORMATS, prompt_renderer, tokenize_conversation

__all__ = [
    "PROMPT_FORMATS",
    "SFTDataError",
    "attention_mask_of",
    "build_sft_datasets",
    "document_mask",
    "prompt_renderer",
    "read_conversations",
    "sft_files",
    "tokenize_conversation",
    "tokenize_sft_files",
]
