"""Convert checkpoints between Hugging Face / GGUF and megatron dist checkpoints.

    python scripts/convert_checkpoint.py hf-to-megatron --hf-dir HF_FOLDER --out CKPT --tp 2 --pp 2
    python scripts/convert_checkpoint.py gguf-to-megatron --gguf MODEL.gguf --out CKPT --tp 3
    python scripts/convert_checkpoint.py megatron-to-hf --load CKPT --out HF_FOLDER

The megatron checkpoint is model-only, at iteration 0 (CKPT/iter_0000000 + tracker); train from
it with `model.pretrained=CKPT` (weights only). The Hugging Face folder holds model.safetensors
(fp32), a config.json of the model's transformers family (Llama, Qwen2, Qwen3, Mixtral or
Qwen3-MoE, whichever megatron's model is) and the tokenizer files when the checkpoint has them;
a model none of them expresses (multi-token prediction layers, a sliding window within the
context, softmax offsets, multi-latent attention, ...) is refused with one line naming the setting
and the family, before anything is written.
Hugging Face imports read Llama (3.x RoPE scaling included), Mistral, Qwen2/2.5, Qwen3, Mixtral and
Qwen3-MoE folders; what megatron's model space cannot build is refused with one line.
Destinations must not exist (or be empty); they appear complete or not at all.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, flag, help_text in (
        ("hf-to-megatron", "--hf-dir", "a Hugging Face folder (config.json + *.safetensors) of Llama, Mistral, Qwen2/3, Mixtral or Qwen3-MoE"),
        ("gguf-to-megatron", "--gguf", "a llama GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors)"),
    ):
        command = commands.add_parser(name)
        command.add_argument(flag, dest="source", required=True, help=help_text)
        command.add_argument("--out", required=True, help="the megatron checkpoint folder to create")
        command.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the checkpoint")
        command.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the checkpoint")
        command.add_argument(
            "--max-seq-length", type=int, default=2048, help="cap on model.seq_length (the model's context)"
        )
    export = commands.add_parser("megatron-to-hf")
    export.add_argument("--load", required=True, help="a megatron checkpoint folder (any layout)")
    export.add_argument("--out", required=True, help="the Hugging Face folder to create")
    export.add_argument("--iteration", type=int, default=None, help="default: the latest")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    from megatron_ext.models.convert.checkpoint import export_checkpoint, import_checkpoint

    try:
        if args.command == "megatron-to-hf":
            written = export_checkpoint(args.load, args.out, args.iteration)
        else:
            written = import_checkpoint(args.source, args.out, args.tp, args.pp, args.max_seq_length)
    except (ValueError, KeyError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
