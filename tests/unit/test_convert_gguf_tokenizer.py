"""The tokenizer rebuilt from SmolLM2's GGUF gives transformers' token ids (its own GGUF
loader) on English prose and on a chat prompt rendered from the file's template."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model

PARAGRAPH = (
    "The library opens at nine o'clock on weekdays, and the reading room is usually quiet until "
    "noon. Visitors who want to borrow books need a card, which costs nothing and takes a few "
    "minutes to make. Children's books are on the ground floor; maps, newspapers and older "
    "volumes are kept upstairs, where the windows look out over the river.\n\nIn 2019, 1,204 "
    "people joined — naïve café-goers included!"
)
MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def tokenizers(smollm_gguf, smollm_hf_tokenizer):
    from megatron_ext.data.gguf_tokenizer import GGUFTokenizer

    return GGUFTokenizer(str(smollm_gguf)), smollm_hf_tokenizer


def test_paragraph_ids_match_transformers(tokenizers):
    ours, reference = tokenizers
    ids = ours.tokenize(PARAGRAPH)
    assert ids == reference(PARAGRAPH, add_special_tokens=False).input_ids
    assert ours.detokenize(ids) == PARAGRAPH


def test_chat_prompt_matches_transformers(tokenizers):
    ours, reference = tokenizers
    prompt = ours.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt == reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = ours.tokenize(prompt)
    assert ids == reference(prompt, add_special_tokens=False).input_ids
    # Control tokens stay whole: system, three messages, the generation prompt.
    assert ids.count(ours.vocab["<|im_start|>"]) == 5


def test_special_ids_and_interface(tokenizers):
    ours, _ = tokenizers
    assert (ours.bos, ours.eos, ours.pad, ours.vocab_size) == (1, 2, 2, 49152)
    assert ours.inv_vocab[ours.eod] == "<|endoftext|>"  # the pretraining document separator
    json.dumps(ours.unique_identifiers)


def test_saved_tokenizer_loads_in_transformers(tokenizers, tmp_path):
    from transformers import AutoTokenizer

    ours, reference = tokenizers
    ours.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(PARAGRAPH, add_special_tokens=False).input_ids == ours.tokenize(PARAGRAPH)
    assert loaded.apply_chat_template(MESSAGES, tokenize=False) == ours.apply_chat_template(MESSAGES, False)
    assert loaded.eos_token == "<|im_end|>"
