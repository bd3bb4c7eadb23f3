"""SentencePiece .model files: the ids, eod and offsets of models trained here on Python's standard
library, against transformers and sentencepiece's own character offsets; a short training run on one.

The reference for the ids is transformers' AutoTokenizer on the model's folder: it converts the
.model into a `tokenizers` tokenizer (BPE or Unigram with the model's normalizer, in Rust), so it
encodes independently of sentencepiece's C++ encoder that SentencePieceTokenizer calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import sentencepiece
from megatron.core.datasets.indexed_dataset import IndexedDataset
from transformers import AutoTokenizer

from megatron_ext.data import HFTokenizer, SentencePieceTokenizer, build_tokenizer, iter_documents

REPO = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "colorsys.py"]

TEXTS = {
    "words": "the quick brown fox jumps over the lazy dog",
    "leading_spaces": "   three leading spaces and two  inside",
    "code": "def f(x):\n    return x * 2  # doubled\n",
    "unicode": "Grüße, 世界! naïve café — ∑ x² 🙂",
    "digits": "x=1234.5678; y=(a+b)*c",
    "nfkc": "ﬁ ½ Ｆｕｌｌ ｗｉｄｔｈ",
    "empty": "",
}

# (id, sentencepiece trainer options): Llama-2's kind of model (BPE, no normalization, byte
# fallback, digits split) and sentencepiece's defaults (Unigram, NFKC, extra whitespace removed)
# with a pad piece.
MODELS = {
    "bpe_llama": dict(model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False,
                      byte_fallback=True, split_digits=True),
    "unigram_nfkc_pad": dict(model_type="unigram", pad_id=3),
}


def _train(folder: Path, options: dict) -> Path:
    folder.mkdir()
    lines = [line for name in SOURCES for line in (STDLIB / name).read_text().splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "tokenizer"), vocab_size=400,
        character_coverage=1.0, minloglevel=2, **options,
    )
    return folder / "tokenizer.model"


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def model(request, tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("spm") / request.param, MODELS[request.param])


@pytest.fixture(scope="module")
def reference(model):
    return AutoTokenizer.from_pretrained(model.parent)


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_ids_are_transformers(model, reference, text):
    ours = build_tokenizer(str(model))
    assert isinstance(ours, SentencePieceTokenizer)
    assert reference.is_fast  # the `tokenizers` conversion, not a wrapper of sentencepiece
    ids = ours.tokenize(text)
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    if ours.unk in ids:  # sentencepiece spells an unknown piece " ⁇ ", transformers "<unk>"
        assert ours.detokenize(ids) == reference.decode(ids).replace(reference.unk_token, " ⁇ ")
    else:
        assert ours.detokenize(ids) == reference.decode(ids)


def test_the_special_ids_are_transformers(model, reference):
    ours = SentencePieceTokenizer(str(model))
    assert (ours.eod, ours.eos, ours.bos, ours.unk) == (
        reference.eos_token_id, reference.eos_token_id, reference.bos_token_id, reference.unk_token_id
    )
    # transformers names no pad token for a .model: the trainer's pad_id is the reference
    pad_id = MODELS[model.parent.name].get("pad_id")
    if pad_id is None:
        with pytest.raises(AttributeError, match="no pad piece"):
            _ = ours.pad
    else:
        assert ours.pad == pad_id and reference.convert_ids_to_tokens(pad_id) == "<pad>"
    assert ours.vocab_size == len(reference) == 400
    assert ours.vocab == reference.get_vocab()
    assert ours.inv_vocab == {i: t for t, i in reference.get_vocab().items()}
    assert ours.eod not in ours.tokenize(TEXTS["words"])  # documents are separated by eod alone


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_offsets_are_sentencepieces_character_spans(model, text):
    ours = SentencePieceTokenizer(str(model))
    ids, offsets = ours.tokenize_with_offsets(text)
    assert ids == ours.tokenize(text)
    # sentencepiece's own character offsets (computed in C++ from its byte spans)
    expected = sentencepiece.SentencePieceProcessor(model_file=str(model)).encode(text, out_type="offset_mapping")
    assert offsets == [tuple(span) for span in expected["offsets"]]
    assert all(end == start for (_, end), (start, _) in zip(offsets, offsets[1:]))  # no gaps, no overlaps


def test_without_normalization_the_offsets_cover_the_text(tmp_path):
    """With no normalization every character is some piece's: the spans tile the text, and each
    piece that is not a byte spans the characters it spells."""
    ours = SentencePieceTokenizer(str(_train(tmp_path / "llama", MODELS["bpe_llama"])))
    for text in TEXTS.values():
        ids, offsets = ours.tokenize_with_offsets(text)
        assert "".join(text[start:end] for start, end in offsets) == text
        assert ours.detokenize(ids) == text
        for token_id, (start, end) in zip(ids, offsets):
            piece = ours.inv_vocab[token_id]
            spelled = piece.replace("▁", " ")
            if not piece.startswith("<0x") and start != end:  # a byte spans its character or nothing
                assert text[start:end] in (spelled, spelled[1:])  # less the dummy prefix at the start


def test_identity_errors_and_folders(tmp_path):
    first = _train(tmp_path / "a", MODELS["bpe_llama"])
    (tmp_path / "b").mkdir()
    same = tmp_path / "b" / "copy.model"
    same.write_bytes(first.read_bytes())
    other = _train(tmp_path / "c", MODELS["unigram_nfkc_pad"])
    identifiers = [build_tokenizer(str(path)).unique_identifiers for path in (first, same, other)]
    assert identifiers[0] == identifiers[1] != identifiers[2]  # the content names cached indices
    assert list(identifiers[0]) == ["class", "sha256"]
    assert isinstance(build_tokenizer(str(tmp_path / "a")), SentencePieceTokenizer)  # a folder with tokenizer.model
    AutoTokenizer.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "a")  # adds tokenizer.json
    assert isinstance(build_tokenizer(str(tmp_path / "a")), HFTokenizer)  # which is read first
    with pytest.raises(NotImplementedError, match="no chat template"):
        build_tokenizer(str(first)).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="eod is its eos piece"):
        build_tokenizer(str(first), eod_token="</s>")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        build_tokenizer(str(tmp_path / "bad.model"))


def test_a_run_trains_on_a_model_file(tmp_path):
    """`python -m megatron_ext.train data.tokenizer=<file.model>`: the corpus is tokenized by the
    model (each document ended by its eos) and two steps train."""
    model = _train(tmp_path / "spm", MODELS["bpe_llama"])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in SOURCES:
        (corpus / name).write_text((STDLIB / name).read_text())
    tiny = ["experiment=none", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
            "model.num_attention_heads=4", "model.seq_length=32", "train.micro_batch_size=2",
            "train.global_batch_size=2", "train.eval_interval=0", "logging.progress_bar=false",
            "launcher.nproc=1", "launcher.device=cpu", "train.iters=2"]
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.train", *tiny, f"data.cache_dir={tmp_path / 'cache'}",
         f"data.corpus={corpus}", f"data.tokenizer={model}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final_loss" in done.stdout + done.stderr
    reference = sentencepiece.SentencePieceProcessor(model_file=str(model))
    [index] = (tmp_path / "cache" / "corpus").glob("*.idx")  # the corpus the run tokenized
    dataset = IndexedDataset(str(index.with_suffix("")))
    documents = list(iter_documents(str(corpus)))
    assert len(dataset) == len(documents)
    for i, text in enumerate(documents):
        assert dataset[i].tolist() == reference.encode(text) + [reference.eos_id()]
