"""A conversation as token ids, with the assistant's tokens marked: what SFT's loss falls on.

The text is the conversation rendered by the tokenizer's own chat template (as transformers
renders it) or by a named prompt format. An assistant turn's text is found the way the template
itself produces it: the conversation rendered up to the turn with the generation prompt, then
rendered with the turn. What the turn adds, up to its last non-space character (its
end-of-turn token, where the template has one), is the assistant's; so the model learns to end
its turn and nothing of the template's prompt. The whole text is tokenized once (token merges
across a turn's edge are those of the real prompt) and a token is the assistant's when its
characters overlap an assistant span: transformers' rule for `{% generation %}` blocks.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

from megatron_ext.data.chat_template import ChatTemplate

# Named prompt formats, for tokenizers with no chat template or data made for another format.
# Megatron-LM's --sft-tokenizer-prompt-format names the two nemotron ones (its default is
# "nemotron-h-aligned"); their text is the one Megatron-LM's SFT tokenizer renders.
PROMPT_FORMATS = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "nemotron-h-aligned": (
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}<SPECIAL_10>System\n{{ m['content'] | trim }}\n"
        "{% elif m['role'] == 'user' %}<SPECIAL_11>User\n{{ m['content'] | trim }}\n<SPECIAL_11>Assistant\n"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] | trim }}\n{% endif %}{% endfor %}"
    ),
    "nemotron-nano-v2": (
        "{% for m in messages %}{% set text = m['content'].replace('/think', '').replace('/no_think', '') | trim %}"
        "{% if m['role'] == 'system' %}<SPECIAL_10>System\n{{ text }}\n"
        "{% elif m['role'] == 'user' %}<SPECIAL_11>User\n{{ text }}\n"
        "{% elif m['role'] == 'assistant' %}<SPECIAL_11>Assistant\n{{ m['content'] | trim }}\n<SPECIAL_12>\n"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<SPECIAL_11>Assistant\n{% endif %}"
    ),
}


class OffsetTokenizer(Protocol):
    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


Render = Callable[[Sequence[dict], bool], str]  # (messages, add_generation_prompt) -> text


def prompt_renderer(tokenizer, prompt_format: Optional[str]) -> Render:
    """How conversations become text: the named `prompt_format`, or (None) the tokenizer's own
    chat template. Raises ValueError naming what is missing."""
    if prompt_format is not None:
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format {prompt_format!r} is unknown; formats: {sorted(PROMPT_FORMATS)}")
        template = ChatTemplate(prompt_format, PROMPT_FORMATS[prompt_format])
        return lambda messages, add_generation_prompt: template.render(messages, add_generation_prompt)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'path', tokenizer)!r} has no chat template: name a prompt "
            f"format ({', '.join(sorted(PROMPT_FORMATS))})"
        )
    return lambda messages, add_generation_prompt: tokenizer.apply_chat_template(messages, add_generation_prompt)


def assistant_spans(render: Render, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the (start, end) character spans of its assistant turns."""
    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the prompt format renders a conversation's earlier turns differently once it goes on "
                f"(turn {i}), so the assistant's text cannot be told apart; name another prompt format"
            )
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def tokenize_conversation(
    tokenizer: OffsetTokenizer, render: Render, messages: Sequence[dict]
) -> tuple[list[int], list[bool]]:
    """(ids, assistant) of the conversation: assistant[i] is whether token i is the assistant's."""
    text, spans = assistant_spans(render, messages)
    ids, offsets = tokenizer.tokenize_with_offsets(text)
    assistant = [any(start < span_end and end > span_start for span_start, span_end in spans) for start, end in offsets]
    return ids, assistant
