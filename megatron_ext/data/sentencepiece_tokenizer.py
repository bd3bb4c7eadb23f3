"""A SentencePiece model file (`tokenizer.model`) as megatron-core's GPT datasets take it.

Megatron-LM reads one with --tokenizer-type Llama2Tokenizer, SentencePieceTokenizer or
GPTSentencePieceTokenizer. Its default tokenizers (megatron.core.tokenizers, the same class for
the three) encode text as sentencepiece does, adding neither bos nor eos, and end each document
with the model's eos piece; so does this one. Megatron-LM's legacy tokenizers (--legacy-tokenizer)
differ: the legacy Llama2Tokenizer puts bos before each text, and the legacy SentencePieceTokenizer
appends <CLS>, <SEP>, <EOD> and <MASK> to the vocabulary and ends documents with <EOD>.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections import OrderedDict
from typing import Iterable, Optional

import sentencepiece
from megatron.core.tokenizers import MegatronTokenizerBase
from sentencepiece import sentencepiece_pb2

# The tokenizer's kind in `unique_identifiers` (hashed into the names of cached dataset indices):
# the name it is imported by, as for HFTokenizer.
CLASS_IDENTIFIER = "megatron_ext.data.tokenizers.SentencePieceTokenizer"


class SentencePieceTokenizer(MegatronTokenizerBase):
    """A SentencePiece .model file: its pieces are the vocabulary, its eos piece ends documents."""

    def __init__(self, path: str) -> None:
        super().__init__(path=path, config={})
        with open(path, "rb") as f:
            model = f.read()
        # The content identifies the tokenizer (it names cached dataset indices), not the path.
        self._sha256 = hashlib.sha256(model).hexdigest()
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=model)
        except RuntimeError as e:  # sentencepiece's message for a file that is not a model
            raise ValueError(f"{path} is not a SentencePiece model: {e}") from None
        if self._sp.eos_id() < 0:
            raise ValueError(f"{path} has no eos piece (it was trained with eos_id=-1): no end of document")

    def tokenize(self, text: str) -> list[int]:
        # No bos or eos: documents are separated by eod alone, as Megatron-LM's default
        # tokenizer and preprocess_data.py write them.
        return self._sp.encode(text)

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` (as `tokenize`) and each token's (start, end) character span in it.

        As sentencepiece spans them: the dummy prefix "▁" and all but the last byte piece of a
        character span nothing; a piece of normalized text spans the characters it came from.
        """
        pieces = sentencepiece_pb2.SentencePieceText.FromString(self._sp.encode(text, out_type="serialized_proto"))
        # sentencepiece's spans are in UTF-8 bytes: the byte where each character starts, and the end
        starts = list(itertools.accumulate((len(c.encode("utf-8")) for c in text), initial=0))
        return (
            [p.id for p in pieces.pieces],
            [(bisect.bisect_right(starts, p.begin) - 1, bisect.bisect_left(starts, p.end)) for p in pieces.pieces],
        )

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(self.vocab_size)}

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> Optional[int]:
        """The bos piece's id, or None where the model has none."""
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def unk(self) -> int:
        return self._sp.unk_id()  # every SentencePiece model has one

    @property
    def pad(self) -> int:
        if self._sp.pad_id() < 0:
            # AttributeError, as HFTokenizer's: megatron's datasets then pick a pad id that
            # cannot occur in the data.
            raise AttributeError(f"{self.path} has no pad piece (pad_id -1)")
        return self._sp.pad_id()

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", CLASS_IDENTIFIER), ("sha256", self._sha256)])

    def apply_chat_template(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"{self.path}: a SentencePiece model has no chat template")
