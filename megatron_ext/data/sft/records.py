"""Conversations read from the user's files: JSONL (or JSON lists, or Parquet) of chat records.

A record is one of:
  {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
      the format of Megatron-LM's --sft data and of the OpenAI-style tools. As in Megatron-LM,
      one record may hold several conversations one after another: each system message after
      the first message starts a new one.
  {"prompt": ..., "completion": ...}
      a prompt / completion pair; each side is a string (a user turn, an assistant turn) or a
      list of messages.
Every problem is reported with the file and line (the row, for Parquet) it is on, before any
training starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

ROLES = ("system", "user", "assistant", "tool")
SUFFIXES = (".jsonl", ".json", ".parquet")


class SFTDataError(ValueError):
    """A record that cannot be trained on: `where` is "file:line"."""

    def __init__(self, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class Conversation:
    messages: tuple[dict, ...]  # {"role", "content"} dicts, in order
    where: str  # "file:line" of the record it came from


def sft_files(paths: Sequence[str]) -> list[Path]:
    """The data files of `paths` (files, or folders whose .jsonl/.json/.parquet files are taken
    in name order)."""
    files: list[Path] = []
    for spec in paths:
        path = Path(os.path.expanduser(spec))
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise SFTDataError(str(path), f"no {'/'.join(SUFFIXES)} files in this folder")
            files += found
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise SFTDataError(str(path), f"not SFT data: give {'/'.join(SUFFIXES)} files or a folder of them")
            files.append(path)
        else:
            raise SFTDataError(str(path), "no such file or folder")
    return files


def read_conversations(path: Path) -> list[Conversation]:
    """Every conversation of the file at `path`, in file order."""
    conversations = []
    for where, record in _records(path):
        conversations += _conversations(record, where)
    if not conversations:
        raise SFTDataError(str(path), "holds no conversation")
    return conversations


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise SFTDataError(f"{path}:{e.lineno}", f"not valid JSON ({e.msg})") from None
        for i, record in enumerate(records):
            yield f"{path}:[{i}]", record
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as e:
            raise SFTDataError(f"{path}:{number}", f"not a JSON object ({e.msg} at column {e.colno})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        # optional: only Parquet data needs it
        import pyarrow.parquet as pq
    except ImportError:
        raise SFTDataError(str(path), "reading Parquet needs pyarrow (pip install pyarrow)") from None
    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path}:row {i}", row


def _conversations(record: Any, where: str) -> list[Conversation]:
    if not isinstance(record, dict):
        raise SFTDataError(where, f"a record must be a JSON object, not {type(record).__name__}")
    if "messages" in record:
        messages = _messages(record["messages"], where, "messages")
    elif "prompt" in record and "completion" in record:
        messages = _side(record["prompt"], "user", where, "prompt") + _side(
            record["completion"], "assistant", where, "completion"
        )
    else:
        raise SFTDataError(where, f"no 'messages' (nor 'prompt' and 'completion'); keys: {sorted(record)}")
    conversations = [Conversation(tuple(turns), where) for turns in _split_at_system(messages)]
    for conversation in conversations:
        if not any(m["role"] == "assistant" for m in conversation.messages):
            raise SFTDataError(where, "a conversation with no assistant turn: nothing to learn from it")
    return conversations


def _side(value: Any, role: str, where: str, key: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, where, key)


def _messages(value: Any, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise SFTDataError(where, f"'{key}' must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise SFTDataError(where, f"{key}[{i}] must be an object with 'role' and 'content'")
        if message["role"] not in ROLES:
            raise SFTDataError(where, f"{key}[{i}] has role {message['role']!r}; roles: {list(ROLES)}")
        if not isinstance(message["content"], str):
            raise SFTDataError(where, f"{key}[{i}]'s content must be a string")
        if message["role"] == "assistant" and not message["content"].strip():
            raise SFTDataError(where, f"{key}[{i}] is an empty assistant turn")
        messages.append(dict(message))
    return messages


def _split_at_system(messages: list[dict]) -> list[list[dict]]:
    conversations: list[list[dict]] = []
    for message in messages:
        if not conversations or message["role"] == "system":
            conversations.append([])
        conversations[-1].append(message)
    return conversations
