"""A Hugging Face `tokenizers` tokenizer (tokenizer.json) as megatron-core's GPT datasets take it.

The base of the tokenizers built with `tokenizers` (GPT-2's files in tokenizers.py, a GGUF
vocabulary in gguf_tokenizer.py): they share its special-token ids, pad rule and chat template.
"""

import hashlib
import os
from collections import OrderedDict
from typing import Any, Iterable, Optional, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer

from megatron_ext.data.chat_template import TEMPLATE_FILE, ChatTemplate, read_chat_template
from megatron_ext.data.special_tokens import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    generation_eos_id,
    read_special_tokens,
)

# The eod token of a vocabulary whose files name no eos token: the first of these it has.
EOD_CANDIDATES = ("<|endoftext|>", "</s>")
# The pad token of a vocabulary whose files name none.
_PAD_CANDIDATES = ("<pad>", "<|padding|>", "[PAD]")
# The tokenizer's kind in `unique_identifiers`, which megatron hashes into the names of cached
# dataset indices: the name it is imported by (megatron_ext.data.tokenizers), so those names do
# not depend on the module that defines it.
CLASS_IDENTIFIER = "megatron_ext.data.tokenizers.HFTokenizer"


class HFTokenizer(MegatronTokenizerBase):
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file, with the special
    tokens (special_tokens.py) and the chat template (chat_template.py) its folder keeps.

    eod (the document separator of pretraining data): `eod_token`, else the folder's eos token,
    else the first of EOD_CANDIDATES the vocabulary has.
    """

    def __init__(self, path: str, eod_token: Optional[str] = None) -> None:
        super().__init__(path=path, config={})
        self._tokenizer = self._read()
        # The content, not the path, identifies the tokenizer: a retrained tokenizer.json at
        # the same path must not reuse token ids cached for the old one.
        digest = hashlib.sha256()
        for file in self._files():
            with open(file, "rb") as f:
                digest.update(f.read())
        self._sha256 = digest.hexdigest()
        folder = os.path.dirname(os.path.abspath(path))
        self._special_ids = self._folder_special_ids(folder)
        self._eod_token = eod_token or self._default_eod(folder)
        self._eod = self._token_id(self._eod_token)
        self._chat: Optional[ChatTemplate] = read_chat_template(folder)

    def _folder_special_ids(self, folder: str) -> dict[str, int]:
        """The id of each special token (bos_token, eos_token, ...) the folder names. A token the
        vocabulary lacks counts as not named: transformers would append it past the vocabulary,
        where the model has no embedding."""
        ids = {name: self._tokenizer.token_to_id(text) for name, text in read_special_tokens(folder).items()}
        eos = generation_eos_id(folder)
        if ids.get("eos_token") is None and eos is not None and self._tokenizer.id_to_token(eos) is not None:
            ids["eos_token"] = eos
        return {name: token_id for name, token_id in ids.items() if token_id is not None}

    def _default_eod(self, folder: str) -> str:
        if self.eos is not None:
            return self._tokenizer.id_to_token(self.eos)
        token = self._first_present(EOD_CANDIDATES)
        if token is None:
            raise ValueError(
                f"{folder} names no eos token (in {CONFIG_FILE}, {SPECIAL_TOKENS_MAP_FILE} or "
                f"{GENERATION_CONFIG_FILE}) and {self.path} has none of the eod tokens "
                f"{list(EOD_CANDIDATES)}: name its eos_token in {CONFIG_FILE}"
            )
        return token

    def _read(self):
        return Tokenizer.from_file(self.path)

    def _files(self) -> tuple[str, ...]:
        """The files that define the tokenizer."""
        return (self.path,)

    def _first_present(self, candidates: tuple[str, ...]) -> Optional[str]:
        """The first of `candidates` the vocabulary has, or None."""
        return next((token for token in candidates if self._tokenizer.token_to_id(token) is not None), None)

    def _token_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the vocabulary of {self.path}")
        return token_id

    def tokenize(self, text: str) -> list[int]:
        # No post-processor specials (BOS etc.): documents are separated by eod alone.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` (as `tokenize`) and each token's (start, end) character span in it."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> Optional[int]:
        """The eos token's id, or None where the folder names none."""
        return self._special_ids.get("eos_token")

    @property
    def bos(self) -> Optional[int]:
        """The bos token's id, or None where the folder names none."""
        return self._special_ids.get("bos_token")

    @property
    def unk(self) -> Optional[int]:
        """The unk token's id, or None where the folder names none."""
        return self._special_ids.get("unk_token")

    @property
    def pad(self) -> int:
        """The folder's pad token, else the first of the usual pad tokens the vocabulary has."""
        if "pad_token" in self._special_ids:
            return self._special_ids["pad_token"]
        token = self._first_present(_PAD_CANDIDATES)
        if token is None:
            # AttributeError, not a made-up id: megatron's datasets then fall back to a pad id
            # that cannot occur in the data, and getattr(tokenizer, "pad", None) works for callers.
            raise AttributeError(f"{self.path} names no pad token and has none of {list(_PAD_CANDIDATES)}")
        return self._tokenizer.token_to_id(token)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [
                ("class", CLASS_IDENTIFIER),
                ("sha256", self._sha256),
                ("eod_token", self._eod_token),
            ]
        )

    @property
    def chat_template(self) -> Optional[str]:
        return self._chat.template if self._chat else None

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of a conversation, rendered with the tokenizer's chat template as
        Hugging Face renders it."""
        if self._chat is None:
            folder = os.path.dirname(os.path.abspath(self.path))
            raise ValueError(f"{folder} has no chat template (no {TEMPLATE_FILE}, no chat_template in {CONFIG_FILE})")
        return self._chat.render(messages, add_generation_prompt, **kwargs)
