"""A Hugging Face tokenizer folder's special tokens, read as transformers' AutoTokenizer reads them.

Each folder is written by transformers itself (`save_pretrained`), then edited where a case needs
the files an older transformers or a hub repository has; AutoTokenizer.from_pretrained on the same
folder is the reference for the eos/bos/pad/unk ids, GenerationConfig for generation_config.json.
"""

from __future__ import annotations

import json

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from megatron_ext.data import HFTokenizer, build_indexed_dataset, build_tokenizer
from megatron_ext.data.hf_tokenizer import EOD_CANDIDATES

LINES = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "sphinx of black quartz, judge my vow",
] * 5


def _added_token(content: str, config: bool = True) -> dict:
    """A special token as transformers 4.x wrote it into tokenizer_config.json (or, without its
    type, into special_tokens_map.json)."""
    token = {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {"__type": "AddedToken", **token} if config else token


# (id, the vocabulary's special tokens, what save_pretrained is given, then the files written
# over it: {file name: JSON object}, a tokenizer_config.json entry of None dropping the key)
CASES = [
    (
        "llama3",  # Llama-3.1: no <|endoftext|>, no </s>
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|finetune_right_pad_id|>"},
        {},
    ),
    (
        "qwen2_base",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        {},
    ),
    (
        "qwen2_instruct",  # eos is <|im_end|>, though the vocabulary has <|endoftext|> (its pad)
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        {},
    ),
    (
        "mixtral",
        ["<unk>", "<s>", "</s>"],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        {},
    ),
    (
        "llama2_added_token_dicts",  # tokenizer_config.json as transformers 4.x wrote Llama-2's
        ["<unk>", "<s>", "</s>"],
        {},
        {"tokenizer_config.json": {"bos_token": _added_token("<s>"), "eos_token": _added_token("</s>"),
                                   "unk_token": _added_token("<unk>"), "pad_token": None}},
    ),
    (
        "special_tokens_map_replaces_config",  # no added_tokens_decoder: the legacy map is read
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        {"special_tokens_map.json": {
            "eos_token": _added_token("<|eot_id|>", config=False), "pad_token": "<|end_of_text|>"
        }},
    ),
    (
        "added_tokens_decoder_ignores_the_map",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        {
            "tokenizer_config.json": {
                "added_tokens_decoder": {"2": {**_added_token("<|eot_id|>", config=False), "special": True}}
            },
            "special_tokens_map.json": {"eos_token": "<|eot_id|>"},
        },
    ),
    (
        "generation_config_only",  # the tokenizer files name no eos: the model's first one
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>"},
        {"generation_config.json": {"bos_token_id": 0, "eos_token_id": [2, 1]}},
    ),
    (
        "generation_config_one_id",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        {},
        {"generation_config.json": {"eos_token_id": 1}},
    ),
]


def _save_folder(folder, specials: list[str], named: dict, files: dict) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(LINES, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **named).save_pretrained(folder)
    for name, content in files.items():
        path = folder / name
        if name == "tokenizer_config.json":
            content = {**json.loads(path.read_text()), **content}
            content = {key: value for key, value in content.items() if value is not None}
        path.write_text(json.dumps(content))


@pytest.mark.parametrize("specials, named, files", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_special_ids_are_autotokenizers(tmp_path, specials, named, files):
    _save_folder(tmp_path, specials, named, files)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    eos = reference.eos_token_id
    if eos is None:  # transformers' tokenizer reads no generation_config.json; its generation does
        eos = GenerationConfig.from_pretrained(tmp_path).eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
    ours = build_tokenizer(str(tmp_path))
    assert isinstance(ours, HFTokenizer)
    assert (ours.eos, ours.bos, ours.unk) == (eos, reference.bos_token_id, reference.unk_token_id)
    assert ours.eod == eos
    if reference.pad_token_id is None:
        with pytest.raises(AttributeError, match="pad"):
            _ = ours.pad
    else:
        assert ours.pad == reference.pad_token_id
    assert list(ours.unique_identifiers) == ["class", "sha256", "eod_token"]  # the keys of cached indices
    assert ours.unique_identifiers["eod_token"] == reference.convert_ids_to_tokens(eos)


def test_a_folder_without_the_old_eod_tokens_builds_its_documents(tmp_path):
    """Llama-3's vocabulary has neither <|endoftext|> nor </s>: its eos ends each document."""
    _save_folder(tmp_path, *CASES[0][1:])
    reference = AutoTokenizer.from_pretrained(tmp_path)
    assert not set(EOD_CANDIDATES) & set(reference.get_vocab())
    tokenizer = build_tokenizer(str(tmp_path))
    prefix = build_indexed_dataset(LINES[:2], tokenizer, str(tmp_path / "docs"))
    dataset = IndexedDataset(prefix)
    for i, text in enumerate(LINES[:2]):
        ids = reference(text, add_special_tokens=False)["input_ids"] + [reference.eos_token_id]
        assert dataset[i].tolist() == ids


def test_a_named_token_missing_from_the_vocabulary_counts_as_not_named(tmp_path):
    """transformers appends it past the vocabulary (where the model has no embedding): the eod is
    then the usual one the vocabulary has."""
    _save_folder(tmp_path, ["<|endoftext|>"], {}, {"tokenizer_config.json": {"eos_token": "</s>"}})
    reference = AutoTokenizer.from_pretrained(tmp_path)
    ours = build_tokenizer(str(tmp_path))
    assert reference.eos_token_id == ours.vocab_size  # appended
    assert ours.eos is None and ours.eod == reference.convert_tokens_to_ids("<|endoftext|>")


def test_a_folder_naming_no_eos_and_no_usual_eod_is_refused(tmp_path):
    _save_folder(tmp_path, ["<|begin_of_text|>"], {"bos_token": "<|begin_of_text|>"}, {})
    with pytest.raises(ValueError, match=r"names no eos token .*<\|endoftext\|>.*</s>.*eos_token in tokenizer_config"):
        build_tokenizer(str(tmp_path))


def test_an_explicit_eod_token_wins_over_the_folders_eos(tmp_path):
    _save_folder(tmp_path, *CASES[0][1:])
    reference = AutoTokenizer.from_pretrained(tmp_path)
    ours = build_tokenizer(str(tmp_path), eod_token="<|eot_id|>")
    assert ours.eod == reference.convert_tokens_to_ids("<|eot_id|>")
    assert ours.eos == reference.eos_token_id != ours.eod


def test_the_chat_template_sees_the_special_tokens_transformers_resolves(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    case = dict(CASES[5][3])  # special_tokens_map.json replaces tokenizer_config.json's eos
    case["tokenizer_config.json"] = {"chat_template": template}
    _save_folder(tmp_path, CASES[5][1], CASES[5][2], case)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    assert build_tokenizer(str(tmp_path)).apply_chat_template(messages) == expected
    assert expected.endswith("<|eot_id|>")
