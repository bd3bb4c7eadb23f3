"""A model's chat template: where a tokenizer folder keeps it, and the prompt it renders.

A Hugging Face tokenizer folder holds the template in `chat_template.jinja` (newer
transformers) or under `chat_template` in tokenizer_config.json (a string, or a list of named
templates whose "default" one is used). The special tokens the template may name (`bos_token`,
`eos_token`, ...) are the folder's, as special_tokens.py reads them. The prompt is rendered as
transformers renders it: a sandboxed jinja environment with trimmed blocks, loop controls,
`raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megatron_ext.data.special_tokens import CONFIG_FILE, read_json, read_special_tokens

TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # where the template was read, for messages
    template: str
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. bos_token -> "<s>"

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of the conversation `messages`."""
        return _environment().from_string(self.template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
        )


def read_chat_template(folder: str) -> Optional[ChatTemplate]:
    """The chat template of the tokenizer folder `folder`, or None when it has none."""
    config_path = os.path.join(folder, CONFIG_FILE)
    config = read_json(folder, CONFIG_FILE)
    template_path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(template_path):
        with open(template_path, encoding="utf-8") as f:
            template, source = f.read(), template_path
    else:
        template, source = _default_template(config.get("chat_template")), config_path
    if not template:
        return None
    return ChatTemplate(source, template, read_special_tokens(folder))


def _default_template(value: Any) -> Optional[str]:
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _environment():
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None, sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which a prompt must keep as they are
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
