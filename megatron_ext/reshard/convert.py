"""Offline reshard: any checkpoint, Megatron-LM's or this runtime's, rewritten in another layout.

    python -m megatron_ext.reshard.convert --load ckpt/ --save ckpt_pp4/ \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4

The layout flags are Megatron-LM's, absent ones its defaults (1, no interleaving, even stages).
The result is what Megatron-LM's next run with those flags resumes: its optimizer state
`dp_reshardable` (Megatron-LM's default), or `fully_reshardable` with
--dist-ckpt-optim-fully-reshardable, which then loads in any layout. It runs on local workers,
one per model-parallel rank of the layouts involved (CPU included); see training/relayout.py.

A layout the model cannot take, a missing checkpoint or a destination that is not free is one
line, exit code 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_ext.config.schema import ParallelConfig
from megatron_ext.config.validate import ConfigError


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.reshard.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="the checkpoint directory to read")
    parser.add_argument("--save", required=True, help="where to write it (must not exist, or be empty)")
    parser.add_argument("--ckpt-step", type=int, help="the iteration to read (default: the latest)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size", type=int)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int)
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int)
    parser.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                        help="write the optimizer state fully_reshardable (default: dp_reshardable)")
    return parser.parse_args(argv)


def layout(flags: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(
        tp=flags.tensor_model_parallel_size,
        pp=flags.pipeline_model_parallel_size,
        vpp=flags.num_virtual_stages_per_pipeline_rank,
        ep=flags.expert_model_parallel_size,
        cp=flags.context_parallel_size,
        first_stage_layers=flags.decoder_first_pipeline_num_layers,
        last_stage_layers=flags.decoder_last_pipeline_num_layers,
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    flags = parse(sys.argv[1:] if argv is None else argv)
    # Late: torch and megatron-core, once the flags are read.
    from megatron_ext.training.relayout import read_source, relayout

    try:
        source = read_source(flags.load, flags.ckpt_step)
        rewritten = relayout(source, flags.save, layout(flags), flags.dist_ckpt_optim_fully_reshardable)
    except ConfigError as error:
        print("error: " + "; ".join(f"{field}: {rule}" for field, rule in error.violations), file=sys.stderr)
        sys.exit(2)
    print(f"wrote iteration {source.iteration} to {rewritten}")


if __name__ == "__main__":
    main()
