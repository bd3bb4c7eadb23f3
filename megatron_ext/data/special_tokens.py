"""The special tokens of a Hugging Face tokenizer folder, as transformers' AutoTokenizer resolves them.

transformers (`PreTrainedTokenizerBase._from_pretrained`) takes each named special token
(`bos_token`, `eos_token`, `pad_token`, ...) from tokenizer_config.json, where it is a string or an
AddedToken's dict with its "content". A folder whose tokenizer_config.json has no
`added_tokens_decoder` (written before transformers 4.34, or by hand) is read the legacy way:
special_tokens_map.json's entries then replace tokenizer_config.json's.

generation_config.json belongs to the model, not to the tokenizer: its `eos_token_id` (one id or a
list of them) is where generation stops, and the tokenizer takes the first of them as its eos
token when the tokenizer files name none.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_json(folder: str, name: str) -> dict:
    """The JSON object in `folder`/`name`, or {} when the file is not there."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_special_tokens(folder: str) -> dict[str, str]:
    """The text of each special token the tokenizer files of `folder` name, e.g.
    {"bos_token": "<s>", "eos_token": "</s>"}; a token named null is left out."""
    config = read_json(folder, CONFIG_FILE)
    values = {name: config.get(name) for name in SPECIAL_TOKENS}
    if "added_tokens_decoder" not in config:
        legacy = read_json(folder, SPECIAL_TOKENS_MAP_FILE)
        values.update({name: value for name, value in legacy.items() if name in SPECIAL_TOKENS})
    return {name: text for name, value in values.items() if (text := _token_text(value)) is not None}


def generation_eos_id(folder: str) -> Optional[int]:
    """The first `eos_token_id` of `folder`'s generation_config.json, or None."""
    value = read_json(folder, GENERATION_CONFIG_FILE).get("eos_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _token_text(value: Any) -> Optional[str]:
    """A special token as the JSON files write it: its text, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
