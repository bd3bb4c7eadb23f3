"""Tokenizers that megatron-core's GPT datasets accept.

GPTDatasetConfig is typed on `megatron.core.tokenizers.MegatronTokenizerBase` and reads `eod`,
`pad`, `vocab_size` and `unique_identifiers` (the latter goes into the hash that names the
dataset index caches), so each tokenizer subclasses that base and provide those members.
"""

import os
from collections import OrderedDict
from typing import Iterable, Optional, Union

from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import decoders, models, pre_tokenizers
# `tokenizers`' own class; `Tokenizer` here names the tokenizers this module builds
from tokenizers import Tokenizer as TokenizerPipeline

from megatron_ext.config.tokenizer_spec import GPT2_FILES_PREFIX, NULL_PREFIX
from megatron_ext.data.gguf_tokenizer import GGUFTokenizer
from megatron_ext.data.hf_tokenizer import HFTokenizer
from megatron_ext.data.sentencepiece_tokenizer import SentencePieceTokenizer


# The files a tokenizer folder is read from, the first one present.
FOLDER_FILES = ("tokenizer.json", "tokenizer.model")


class ByteTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes are the ids 0..255; `<eod>` is 256 and `<pad>` 257.

    Needs no training and no files, so every machine can build the default corpus with it.
    """

    _NUM_BYTES = 256

    def __init__(self) -> None:
        super().__init__(path="byte", config={})
        self._special = {"<eod>": self._NUM_BYTES, "<pad>": self._NUM_BYTES + 1}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` (as `tokenize`) and each token's (start, end) character span in it:
        every byte of a character spans that character."""
        offsets = [(i, i + 1) for i, char in enumerate(text) for _ in char.encode("utf-8")]
        return self.tokenize(text), offsets

    def detokenize(self, ids: Iterable[int]) -> str:
        # Special ids are dropped, as Hugging Face's decode does by default.
        data = bytes(int(i) for i in ids if int(i) < self._NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        # latin-1 maps each byte to one distinct character, so the byte vocab is printable
        vocab = {bytes([i]).decode("latin-1"): i for i in range(self._NUM_BYTES)}
        vocab.update(self._special)
        return vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._NUM_BYTES + len(self._special)

    @property
    def eod(self) -> int:
        return self._special["<eod>"]

    @property
    def pad(self) -> int:
        return self._special["<pad>"]

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [("class", f"{__name__}.ByteTokenizer"), ("vocab_size", self.vocab_size)]
        )

    def apply_chat_template(self, *args, **kwargs) -> None:
        raise NotImplementedError("ByteTokenizer has no chat template")


class NullTokenizer(MegatronTokenizerBase):
    """Megatron-LM's NullTokenizer: the data are token ids already. Ids 0..V-1 are tokens and V
    is the end of document, so the vocabulary is V + 1 (the embedding is padded from there, as
    Megatron-LM pads it); text is ids written in decimal, separated by spaces."""

    def __init__(self, size: int) -> None:
        # heavy: megatron's tokenizers.text package imports transformers (about 1 s in every worker)
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as Ids

        super().__init__(path=f"{NULL_PREFIX}{size}", config={})
        self._ids = Ids(size)

    def tokenize(self, text: str) -> list[int]:
        return self._ids.text_to_ids(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._ids.ids_to_text([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: str(i) for i in range(self.vocab_size)}

    @property
    def vocab_size(self) -> int:
        return self._ids.vocab_size

    @property
    def eod(self) -> int:
        return self._ids.eod

    @property
    def pad(self) -> int:
        # Megatron-LM's default --null-tokenizer-pad-id: no padding id.
        return -1

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", f"{__name__}.NullTokenizer"), ("vocab_size", self.vocab_size)])

    def apply_chat_template(self, *args, **kwargs) -> None:
        raise NotImplementedError("NullTokenizer has no chat template")


class GPT2BPETokenizer(HFTokenizer):
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from its vocab.json and merges.txt
    (Megatron-LM's --vocab-file / --merge-file), built with `tokenizers`; eod is
    `<|endoftext|>`. As in Megatron-LM, special-token text inside a document is plain text."""

    def __init__(self, vocab_file: str, merges_file: str, eod_token: Optional[str] = None) -> None:
        self._merges_file = merges_file
        super().__init__(vocab_file, eod_token or "<|endoftext|>")

    def _read(self):
        tokenizer = TokenizerPipeline(models.BPE.from_file(self.path, self._merges_file))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer

    def _files(self) -> tuple[str, ...]:
        return (self.path, self._merges_file)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([*super().unique_identifiers.items(), ("class", f"{__name__}.GPT2BPETokenizer")])


Tokenizer = Union[ByteTokenizer, NullTokenizer, HFTokenizer, SentencePieceTokenizer]


def build_tokenizer(spec: str, eod_token: Optional[str] = None) -> Tokenizer:
    """Build the tokenizer named by the `data.tokenizer` setting.

    spec: "byte", null:<V> (ids are tokens: Megatron-LM's NullTokenizer), a path to a Hugging
    Face tokenizer.json, a SentencePiece .model file, a folder holding either (tokenizer.json
    first, else tokenizer.model), a GGUF file whose vocabulary defines the tokenizer, or GPT-2's
    files as gpt2:<vocab.json>:<merges.txt>.
    eod_token: for tokenizer.json, GPT-2's files and GGUF only; defaults to the eos token the
    files name, else `<|endoftext|>` or `</s>` (a GGUF file: those first, then its eos token).
    A SentencePiece model's eod is its eos piece.
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith(NULL_PREFIX):
        size = spec[len(NULL_PREFIX):]
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"data.tokenizer={spec!r}: use null:<V>, V the number of token ids")
        return NullTokenizer(int(size))
    if spec.startswith(GPT2_FILES_PREFIX):
        vocab_file, sep, merges_file = spec[len(GPT2_FILES_PREFIX):].rpartition(":")
        if not sep:
            raise ValueError(f"data.tokenizer={spec!r}: use gpt2:<vocab.json>:<merges.txt>")
        return GPT2BPETokenizer(os.path.expanduser(vocab_file), os.path.expanduser(merges_file), eod_token)
    path = os.path.expanduser(spec)
    if path.endswith(".gguf"):
        return GGUFTokenizer(path, eod_token=eod_token)
    if os.path.isdir(path):
        path = next(
            (os.path.join(path, name) for name in FOLDER_FILES if os.path.isfile(os.path.join(path, name))), path
        )
    if os.path.isfile(path) and path.endswith(".json"):
        return HFTokenizer(path, eod_token=eod_token)
    if os.path.isfile(path) and path.endswith(".model"):
        if eod_token is not None:
            raise ValueError(f"{path}: a SentencePiece model's eod is its eos piece; no other eod token is taken")
        return SentencePieceTokenizer(path)
    raise ValueError(
        f"data.tokenizer={spec!r} is not a tokenizer: use 'byte', null:<V>, the path to a Hugging Face "
        "tokenizer.json or a SentencePiece .model (or a folder holding either), a .gguf file, or "
        "gpt2:<vocab.json>:<merges.txt>"
    )


def stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids generation stops at: the tokenizer's eos (a chat model's end of turn) and its end
    of document, each once."""
    return tuple(dict.fromkeys(t for t in (getattr(tokenizer, "eos", None), tokenizer.eod) if t is not None))
