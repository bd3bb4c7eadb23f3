"""Drop-in for Megatron-LM's pretrain_gpt.py: `python -m megatron_ext.pretrain_gpt <flags>`.

Megatron-LM flags become Hydra overrides (megatron_ext/config/mlm_flags.py says what each flag
does here, megatron_ext/config/mlm_args.py how they are read); `key=value` arguments are
applied after them. Launch it the way Megatron-LM is launched (torchrun / srun), or alone with
`--nproc N` for N local workers. `--flag-table` prints docs/megatron_flags.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Mapping, Optional, Sequence

from hydra.errors import HydraException

from megatron_ext.checkpointing.tracker import iteration_dir, latest_iteration
from megatron_ext.config.mlm_args import MlmArgsError, flag_table_markdown, translate
from megatron_ext.config.validate import ConfigError
from megatron_ext.platform.launch_env import detect_launch


def _named(error: ConfigError, sources: Mapping[str, str]) -> str:
    """A broken rule per line, led by the flag the user typed where a flag set the field."""
    return "\n".join(
        f"{sources[field]} ({field}): {rule}" if field in sources else f"{field}: {rule}"
        for field, rule in error.violations
    )


def saved_args(load: str, step: Optional[int]) -> Optional[argparse.Namespace]:
    """The `args` of checkpoint `step` (default: the latest) under `load`; None without one."""
    iteration = step if step is not None else latest_iteration(load)
    if iteration is None or not iteration_dir(load, iteration).is_dir():
        return None
    # Late: torch and megatron-core, only for a command line that reads a checkpoint's args.
    from megatron_ext.checkpointing.torch_dist import load_common

    return load_common(load, iteration).get("args")


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if list(argv) == ["--flag-table"]:
        print(flag_table_markdown(), end="")
        return
    if list(argv) in (["-h"], ["--help"]):
        print(__doc__.strip())
        return
    sources: Mapping[str, str] = {}
    try:
        translation = translate(argv, saved_args)
        sources = translation.sources
        launch = detect_launch()
        if launch is None or launch.rank == 0:  # under torchrun / srun every rank reads the flags
            for line in translation.notices:
                print(f"notice: {line}", file=sys.stderr)
        # Late: the trainer pulls in torch and megatron-core; mapping flags does not need them.
        from megatron_ext.train import exit_on_fault, run_from_overrides

        exit_on_fault(run_from_overrides(translation.overrides))
    # Bad flags, broken rules between fields, and Hydra's refusals of a passed-through override
    # (unknown key, wrong type) all happen before anything is written: exit code 2.
    except MlmArgsError as error:
        _fail(str(error))
    except ConfigError as error:
        _fail(_named(error, sources))
    except HydraException as error:
        _fail(" ".join(str(error).split()))


def _fail(message: str) -> None:
    print("\n".join(f"error: {line}" for line in message.splitlines()), file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
