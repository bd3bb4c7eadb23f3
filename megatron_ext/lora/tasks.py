"""Small instruction-style tasks built from data on the machine (the Python standard library),
for fine-tuning a chat model such as SmolLM2-Instruct. Deterministic: the same examples on
every machine with the same Python.

  docstring   "What does the Python function `json.dumps` do?" -> its docstring's first line
  module      "What is the Python module `textwrap` for?"       -> the module docstring's first line
  reverse     "Reverse the order of these words: a b c"          -> "c b a"
  upper       "Write this in capital letters: some words"        -> "SOME WORDS"
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
from pathlib import Path
from typing import Callable

TASKS = ("docstring", "module", "reverse", "upper")
# Modules read for examples: plain, stable, documented.
MODULES = (
    "json/__init__", "textwrap", "string", "shutil", "os", "posixpath", "statistics", "fractions", "heapq",
    "bisect", "random", "calendar", "difflib", "fnmatch", "glob", "tempfile", "csv", "base64", "copy",
    "functools", "inspect", "pathlib", "pprint", "argparse", "gzip", "zipfile", "tarfile", "logging/__init__",
    "email/utils", "urllib/parse", "http/client", "ipaddress", "uuid", "locale", "secrets", "shlex",
)


def _first_line(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())[:200]


@functools.lru_cache(maxsize=1)
def _documented() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(function name, summary) and (module name, summary) pairs from the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    functions, modules = [], []
    for rel in MODULES:
        path = root / f"{rel}.py"
        if not path.is_file():
            continue
        module = rel.removesuffix("/__init__").replace("/", ".")
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        doc = ast.get_docstring(tree)
        if doc:
            modules.append((module, _first_line(doc)))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(_first_line(doc)) > 10:
                    functions.append((f"{module}.{node.name}", _first_line(doc)))
    return functions, modules


def _words() -> list[str]:
    functions, _ = _documented()
    return [w.strip(".,;:()`'\"").lower() for _, d in functions for w in d.split() if w.isalpha()]


def examples(task: str) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of `task`, in a fixed shuffled order (held-out examples are the
    last ones: spread over all modules)."""
    pairs = _pairs(task)
    random.Random(0).shuffle(pairs)
    return pairs


def _pairs(task: str) -> list[tuple[str, str]]:
    functions, modules = _documented()
    if task == "docstring":
        return [(f"What does the Python function `{name}` do?", doc) for name, doc in functions]
    if task == "module":
        return [(f"What is the Python module `{name}` for?", doc) for name, doc in modules]
    words = _words()
    groups = [words[i : i + 5] for i in range(0, len(words) - 5, 5)]
    if task == "reverse":
        return [("Reverse the order of these words: " + " ".join(g), " ".join(reversed(g))) for g in groups]
    if task == "upper":
        return [("Write this in capital letters: " + " ".join(g), " ".join(g).upper()) for g in groups]
    raise ValueError(f"lora: unknown task {task!r}; tasks: {list(TASKS)}")


def chat_ids(tokenize: Callable[[str], list[int]], prompt: str, answer: str, end: str = "<|im_end|>") -> tuple[list[int], list[int]]:
    """ChatML (SmolLM2-Instruct's format) token ids of the prompt turn and of the answer."""
    question = tokenize(f"<|im_start|>user\n{prompt}{end}\n<|im_start|>assistant\n")
    return question, tokenize(f"{answer}{end}")
