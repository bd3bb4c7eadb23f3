"""Tokenizers: byte ids are the UTF-8 bytes; tokenizer.json tokenizers round-trip and find eod."""

import json
import os

import pytest
from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron_ext.data import ByteTokenizer, HFTokenizer, build_tokenizer

TEXT = "Grüße, 世界! naïve café — ∑ x² 🙂\n\ttabs"

LINES = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "how vexingly quick daft zebras jump",
    "sphinx of black quartz, judge my vow",
] * 5


def _train_bpe(tmp_path, special_tokens=("<|endoftext|>", "<pad>")):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(LINES, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_byte_ids_are_utf8_bytes_and_round_trip():
    tok = ByteTokenizer()
    ids = tok.tokenize(TEXT)
    assert ids == list(TEXT.encode("utf-8"))  # independent reference: Python's own encoder
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids) == TEXT
    assert (tok.eod, tok.pad, tok.vocab_size) == (256, 257, 258)
    assert len(tok.vocab) == tok.vocab_size and tok.inv_vocab[256] == "<eod>"


def test_byte_offsets_give_each_byte_its_character():
    """The reference: each character's own UTF-8 bytes, found one character at a time."""
    tok = ByteTokenizer()
    text = "aé€😀 b"
    ids, offsets = tok.tokenize_with_offsets(text)
    assert ids == tok.tokenize(text) and len(offsets) == len(ids)
    assert all(end == start + 1 for start, end in offsets)
    for i, char in enumerate(text):
        assert bytes(t for t, (start, _) in zip(ids, offsets) if start == i) == char.encode("utf-8")


def test_byte_detokenize_drops_specials_and_replaces_broken_utf8():
    tok = ByteTokenizer()
    assert tok.detokenize([104, 256, 105, 257]) == "hi"
    assert tok.detokenize(list("é".encode())[:1]) == "\ufffd"


def test_tokenizers_are_what_gpt_dataset_config_is_typed_on(tmp_path):
    assert isinstance(ByteTokenizer(), MegatronTokenizerBase)
    assert isinstance(HFTokenizer(str(_train_bpe(tmp_path))), MegatronTokenizerBase)
    json.dumps(ByteTokenizer().unique_identifiers)  # megatron hashes this into cache names


def test_hf_round_trip_and_eod(tmp_path):
    path = _train_bpe(tmp_path)
    tok = build_tokenizer(str(path))
    reference = Tokenizer.from_file(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eod == reference.token_to_id("<|endoftext|>")
    assert tok.pad == reference.token_to_id("<pad>")
    assert tok.vocab_size == reference.get_vocab_size()
    for text in [LINES[0], "jumps over zebras", TEXT]:
        ids = tok.tokenize(text)
        assert tok.eod not in ids
        assert tok.detokenize(ids) == text
    assert len(tok.tokenize(LINES[0])) < len(LINES[0])  # merges were learned and used
    assert build_tokenizer(str(tmp_path)).eod == tok.eod  # a folder holding tokenizer.json


def test_hf_eod_fallback_explicit_and_missing(tmp_path):
    path = _train_bpe(tmp_path, special_tokens=("</s>", "<unk>"))
    reference = Tokenizer.from_file(str(path))
    tok = HFTokenizer(str(path))
    assert tok.eod == reference.token_to_id("</s>")
    assert HFTokenizer(str(path), eod_token="<unk>").eod == reference.token_to_id("<unk>")
    with pytest.raises(AttributeError, match="pad"):
        _ = tok.pad
    (tmp_path / "bare").mkdir()
    bare = _train_bpe(tmp_path / "bare", special_tokens=("<unk>",))
    with pytest.raises(ValueError, match=r"<\|endoftext\|>.*</s>"):
        HFTokenizer(str(bare))


def test_hf_identity_is_the_file_content(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = HFTokenizer(str(_train_bpe(tmp_path / "a")))
    same = HFTokenizer(str(_train_bpe(tmp_path / "b")))
    other = HFTokenizer(str(_train_bpe(tmp_path / "b", special_tokens=("<|endoftext|>",))))
    assert first.unique_identifiers == same.unique_identifiers
    assert first.unique_identifiers != other.unique_identifiers


def test_null_tokenizer_is_megatron_lms():
    # Megatron-LM's NullTokenizer(V): ids are tokens, the end of document is V, the vocabulary
    # V + 1; its text is the ids in decimal.
    tok = build_tokenizer("null:128")
    assert isinstance(tok, MegatronTokenizerBase)
    assert (tok.vocab_size, tok.eod) == (129, 128)
    assert tok.tokenize("5 0 127") == [5, 0, 127]
    assert tok.detokenize([5, 0, 127]) == "5 0 127"
    assert tok.unique_identifiers != build_tokenizer("null:256").unique_identifiers


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        build_tokenizer(str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="use null:<V>"):
        build_tokenizer("null:0")
    with pytest.raises(ValueError, match="data.tokenizer.*'byte'.*tokenizer.json"):
        build_tokenizer("gpt2")


# --- GPT-2's vocab.json + merges.txt (Megatron-LM's GPT2BPETokenizer) ------------------------------

GPT2_TEXTS = {
    "words": "the quick brown fox jumps over the lazy dog",
    "contractions": "it's we're they'll I'd you've",
    "unicode": TEXT,
    "whitespace": "  leading spaces,\n\n newlines\tand   runs   ",
    "digits_punct": "x=1234.5678; y=(a+b)*c!? [ok] {yes} <no>",
    "unseen": "zzyzx qwfp Xylophone ÆØÅ",
}


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A byte-level BPE trained here and saved as GPT-2's files (vocab.json, merges.txt)."""
    from tokenizers import ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(LINES, vocab_size=400, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(folder))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


@pytest.mark.parametrize("text", GPT2_TEXTS.values(), ids=GPT2_TEXTS.keys())
def test_gpt2_files_tokenize_as_transformers_gpt2_tokenizer(gpt2_files, text):
    from transformers import GPT2TokenizerFast

    reference = GPT2TokenizerFast.from_pretrained(os.path.dirname(gpt2_files[0]))  # reads the two files
    tok = build_tokenizer("gpt2:{}:{}".format(*gpt2_files))
    ids = tok.tokenize(text)
    assert ids == reference(text)["input_ids"]
    assert tok.detokenize(ids) == text
    assert tok.eod == reference.convert_tokens_to_ids("<|endoftext|>")
    assert tok.vocab_size == len(reference)


def test_gpt2_files_from_megatron_flags(gpt2_files):
    from megatron_ext.config.mlm_args import mlm_args_to_overrides

    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1]]
    overrides = dict(o.split("=", 1) for o in mlm_args_to_overrides(flags))
    assert overrides["data.tokenizer"].strip("'") == "gpt2:{}:{}".format(*gpt2_files)
