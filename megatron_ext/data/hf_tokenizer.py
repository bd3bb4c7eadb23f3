"""A Hugging Face `tokenizers` tokenizer (tokenizer.json) as megatron-core's GPT datasets take it.

The base of the tokenizers built with `tokenizers` (GPT-2's files in tokenizers.py, a GGUF
vocabulary in gguf_tokenizer.py): they share its eod/pad rules and chat template.
"""

import hashlib
import os
from collections import OrderedDict
from typing import Any, Iterable, Optional, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer

from megatron_ext.data.chat_template import CONFIG_FILE, TEMPLATE_FILE, ChatTemplate, read_chat_template

# The eod token when none is named: the first of these the vocabulary has.
EOD_CANDIDATES = ("<|endoftext|>", "</s>")
_PAD_CANDIDATES = ("<pad>", "<|padding|>", "[PAD]")
# The tokenizer's kind in `unique_identifiers`, which megatron hashes into the names of cached
# dataset indices: the name it is imported by (megatron_ext.data.tokenizers), so those names do
# not depend on the module that defines it.
CLASS_IDENTIFIER = "megatron_ext.data.tokenizers.HFTokenizer"


class HFTokenizer(MegatronTokenizerBase):
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file, with the chat
    template its folder keeps (chat_template.py)."""

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
        self._eod_token = eod_token or self._first_present(EOD_CANDIDATES, "eod")
        self._eod = self._token_id(self._eod_token)
        self._chat: Optional[ChatTemplate] = read_chat_template(os.path.dirname(os.path.abspath(path)))

    def _read(self):
        return Tokenizer.from_file(self.path)

    def _files(self) -> tuple[str, ...]:
        """The files that define the tokenizer."""
        return (self.path,)

    def _first_present(self, candidates: tuple[str, ...], role: str) -> str:
        for token in candidates:
            if self._tokenizer.token_to_id(token) is not None:
                return token
        raise ValueError(
            f"{self.path} has none of the {role} tokens {list(candidates)}; "
            f"name the {role} token explicitly"
        )

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
    def pad(self) -> int:
        # AttributeError, not a made-up id: megatron's datasets then fall back to a pad id that
        # cannot occur in the data, and getattr(tokenizer, "pad", None) works for callers.
        for token in _PAD_CANDIDATES:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        raise AttributeError(f"{self.path} has none of the pad tokens {list(_PAD_CANDIDATES)}")

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
