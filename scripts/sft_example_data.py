"""Write SFT conversations made from text on this machine (the Python standard library) as JSONL,
one {"messages": [...]} record per line: data to try `data=sft` with, and the tests' data.

    python scripts/sft_example_data.py OUT.jsonl [--task docstring] [--limit N] [--system TEXT]

Tasks (megatron_ext/lora/tasks.py): docstring ("What does the Python function `json.dumps` do?"
-> its docstring's first line), module, reverse, upper.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_ext.lora.tasks import TASKS, examples


def write_conversations(path: Path, task: str, limit: int | None = None, system: str | None = None) -> int:
    """Write `task`'s examples (at most `limit`) to `path`; returns how many."""
    pairs = examples(task)[:limit]
    prefix = [{"role": "system", "content": system}] if system else []
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for prompt, answer in pairs:
            messages = [*prefix, {"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--task", choices=TASKS, default="docstring")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--system", default=None, help="a system message opening every conversation")
    args = parser.parse_args()
    count = write_conversations(args.out, args.task, args.limit, args.system)
    print(f"{args.out}: {count} conversations ({args.task})")


if __name__ == "__main__":
    main()
