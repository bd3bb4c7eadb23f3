"""`--chat` on a Hugging Face folder (the project's own export included) and on a converted
megatron_ext checkpoint: the prompt is the folder's chat template rendered as transformers
renders it (tokenizer_config.json's, or chat_template.jinja's), for a tiny LLaMA whose
tokenizer has a ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed  # the import starts a worker

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
WORDS = ["system", "user", "assistant", "hello", "you", "are", "kind", "é", "<b>", "?", "hi", "\n"]
# bos_token, a role check with raise_exception, loop controls, tojson of non-ASCII and "<"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'system' %}<|im_start|>system\n{{ message | tojson }}<|im_end|>\n{% continue %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = {
    "one_question": ([{"role": "user", "content": "hello ?"}], True),
    "system_and_turns": (
        [{"role": "system", "content": "you are kind é <b>"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "kind ?"}],
        True,
    ),
    "no_generation_prompt": ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], False),
}


def tiny_chat_llama(folder: Path) -> None:
    """A random 2-layer LLaMA and a word-level tokenizer with a chat template in
    tokenizer_config.json, as transformers saves them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {token: i for i, token in enumerate([*SPECIALS, "[UNK]", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "removed")
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "unk_token": "[UNK]", "chat_template": TEMPLATE,
    }))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The HF folder, its converted megatron_ext checkpoint and the project's export of it."""
    from megatron_ext.models.convert.checkpoint import export_checkpoint, import_checkpoint

    root = tmp_path_factory.mktemp("chat")
    hf, megatron, export = root / "hf", root / "megatron", root / "export"
    tiny_chat_llama(hf)
    import_checkpoint(str(hf), str(megatron))
    export_checkpoint(str(megatron), str(export))
    return {"hf": hf, "converted": megatron, "export": export}


@pytest.mark.parametrize("case", CONVERSATIONS)
@pytest.mark.parametrize("source", ["export", "converted"])
def test_the_chat_prompt_is_the_one_transformers_renders(folders, source, case):
    from transformers import AutoTokenizer

    from megatron_ext.data import build_tokenizer
    from megatron_ext.models.pretrained import tokenizer_spec

    messages, generation_prompt = CONVERSATIONS[case]
    reference = AutoTokenizer.from_pretrained(folders["export"])
    ours = build_tokenizer(tokenizer_spec(str(folders[source])))
    prompt = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    assert prompt == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    ids = reference.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=True)["input_ids"]
    assert ours.tokenize(prompt) == list(ids)


def test_a_template_in_chat_template_jinja_is_read_as_transformers_reads_it(folders, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from megatron_ext.data import HFTokenizer

    folder = tmp_path / "jinja"
    shutil.copytree(folders["export"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template").replace("<|im_start|>", "<|im_start|> "))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    messages, _ = CONVERSATIONS["system_and_turns"]
    prompt = HFTokenizer(str(folder / "tokenizer.json")).apply_chat_template(messages)
    assert prompt == AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|> user" in prompt


@pytest.mark.parametrize("source", ["hf", "export", "converted"])
def test_generate_chat_runs_on_a_folder_and_a_converted_checkpoint(folders, source):
    from megatron_ext.generation.cli import Request, run
    from megatron_ext.generation import SamplingConfig

    request = Request(str(folders[source]), ("hello ?",), chat=True, sampling=SamplingConfig(max_new_tokens=3), tp=1)
    (output,) = run(request)
    assert isinstance(output, str)


def test_a_folder_without_a_template_says_so(folders, tmp_path):
    import shutil

    from megatron_ext.data import HFTokenizer

    folder = tmp_path / "plain"
    shutil.copytree(folders["export"], folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ValueError, match=f"^{folder} has no chat template"):
        HFTokenizer(str(folder / "tokenizer.json")).apply_chat_template([{"role": "user", "content": "hi"}])
