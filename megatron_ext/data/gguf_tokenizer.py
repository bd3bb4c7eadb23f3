"""The tokenizer a GGUF file describes, rebuilt with Hugging Face `tokenizers`.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the vocabulary
(`tokenizer.ggml.tokens`, already spelled in GPT-2's byte-to-character alphabet), the BPE merges,
a type per token (control tokens such as `<|im_start|>` are matched whole, never split), the
pre-tokenizer's name, the bos/eos/pad ids and the chat template. Byte-level BPE ("gpt2", which
LLaMA-3, SmolLM, Qwen and most recent models use) is rebuilt here.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from gguf import GGUFReader
from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from megatron_ext.data.chat_template import ChatTemplate
from megatron_ext.data.hf_tokenizer import EOD_CANDIDATES, HFTokenizer

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are
# added tokens that are matched whole but are not special.
CONTROL, USER_DEFINED = 3, 4


@dataclass(frozen=True)
class GGUFVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_id: Optional[int]
    eos_id: Optional[int]
    pad_id: Optional[int]
    add_bos: bool
    chat_template: Optional[str]


def read_vocab(path: str) -> GGUFVocab:
    reader = GGUFReader(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(f"tokenizer.{key}")
        return default if f is None else f.contents()

    kind = field("ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens = field("ggml.tokens")
    return GGUFVocab(
        tokens=tokens,
        token_types=field("ggml.token_type", [1] * len(tokens)),
        merges=field("ggml.merges", []),
        pre=field("ggml.pre", "default"),
        bos_id=field("ggml.bos_token_id"),
        eos_id=field("ggml.eos_token_id"),
        pad_id=field("ggml.padding_token_id"),
        add_bos=bool(field("ggml.add_bos_token", False)),
        chat_template=field("chat_template"),
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """How text is split before BPE. SmolLM's vocabulary was learned with every digit on its
    own (llama.cpp's "smollm" pre-tokenizer); "default"/"gpt2" is GPT-2's split."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in ("default", "gpt2"):
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known here; splitting text as GPT-2 does", stacklevel=2)
    return gpt2


def build_bpe(vocab: GGUFVocab) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` with the file's token ids."""
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=[tuple(m.split(" ", 1)) for m in vocab.merges],
        fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()

    def added(token_type: int, special: bool) -> list[AddedToken]:
        return [
            AddedToken(t, special=special, normalized=False)
            for t, kind in zip(vocab.tokens, vocab.token_types)
            if kind == token_type
        ]

    tokenizer.add_special_tokens(added(CONTROL, special=True))
    tokenizer.add_tokens(added(USER_DEFINED, special=False))
    return tokenizer


class GGUFTokenizer(HFTokenizer):
    """`HFTokenizer`'s interface over a GGUF file's tokenizer, its chat template included.

    eod (the document separator of pretraining data): `eod_token`, else `<|endoftext|>` or
    `</s>` when the vocabulary has one (as for tokenizer.json), else the file's eos token.
    """

    def __init__(self, path: str, eod_token: Optional[str] = None) -> None:
        # HFTokenizer.__init__ reads a tokenizer.json; the state it sets up is built here instead.
        MegatronTokenizerBase.__init__(self, path=path, config={})
        self.gguf_vocab = read_vocab(path)
        self._tokenizer = build_bpe(self.gguf_vocab)
        # The content identifies the tokenizer (it names cached dataset indices), not the path.
        self._sha256 = hashlib.sha256(self._tokenizer.to_str().encode()).hexdigest()
        vocab = self.gguf_vocab
        ids = {"bos_token": vocab.bos_id, "eos_token": vocab.eos_id, "pad_token": vocab.pad_id}
        self._special_ids = {name: token_id for name, token_id in ids.items() if token_id is not None}
        self._eod_token = eod_token or self._default_eod()
        self._eod = self._token_id(self._eod_token)
        specials = {"bos_token": self._token(self.bos), "eos_token": self._token(self.eos)}
        template = self.gguf_vocab.chat_template
        self._chat = ChatTemplate(path, template, {k: v for k, v in specials.items() if v is not None}) if template else None

    def _default_eod(self) -> str:
        token = self._first_present(EOD_CANDIDATES) or self._token(self.eos)
        if token is None:
            raise ValueError(f"{self.path} has no eos token and none of {list(EOD_CANDIDATES)}")
        return token

    def _token(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self.gguf_vocab.tokens[token_id]

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [("class", f"{__name__}.GGUFTokenizer"), ("sha256", self._sha256), ("eod_token", self._eod_token)]
        )

    def save_pretrained(self, folder: str) -> None:
        """tokenizer.json + tokenizer_config.json, loadable with transformers' AutoTokenizer."""
        os.makedirs(folder, exist_ok=True)
        self._tokenizer.save(os.path.join(folder, "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token(self.bos),
            "eos_token": self._token(self.eos),
            "pad_token": self._token(self.gguf_vocab.pad_id),
            "add_bos_token": self.gguf_vocab.add_bos,
            "chat_template": self.chat_template,
        }
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2)
