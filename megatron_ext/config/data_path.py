"""Megatron-LM's --data-path list: dataset prefixes, optionally paired with weights
("0.7 a 0.3 b"); no torch, so the launcher reads it before anything starts."""

from __future__ import annotations

from typing import Sequence


def data_prefixes(data_path: Sequence[str]) -> list[str]:
    """The prefixes of `data_path`: every other item when the list pairs weights with prefixes,
    else all of them."""
    weights = data_path[0::2]
    if len(data_path) % 2 == 0 and all(is_number(w) for w in weights):
        return list(data_path[1::2])
    return list(data_path)


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
