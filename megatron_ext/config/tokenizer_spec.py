"""The forms of `data.tokenizer` that name no file: the config writes them (from Megatron-LM's
flags, config/mlm_args.py) and checks them (config/validate.py); data/tokenizers.py reads them.
"""

from __future__ import annotations

# GPT-2's files: gpt2:<vocab.json>:<merges.txt>
GPT2_FILES_PREFIX = "gpt2:"
# Megatron-LM's NullTokenizer of V ids: null:<V>
NULL_PREFIX = "null:"


def gpt2_files_spec(vocab_file: str, merges_file: str) -> str:
    return f"{GPT2_FILES_PREFIX}{vocab_file}:{merges_file}"


def null_tokenizer_spec(size: int) -> str:
    return f"{NULL_PREFIX}{size}"
