"""Drop-in for Megatron-LM's pretrain_gpt.py: `python -m megatron_ext.pretrain_gpt <flags>`.

Megatron-LM flags become Hydra overrides (see megatron_ext/config/mlm_args.py for the mapping
and its decisions); `key=value` arguments are applied after them. Launch it the way Megatron-LM
is launched (torchrun / srun), or alone with `--nproc N` for N local workers.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from hydra.errors import HydraException

from megatron_ext.config.mlm_args import MlmArgsError, mlm_args_to_overrides
from megatron_ext.config.validate import ConfigError


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        overrides = mlm_args_to_overrides(argv)
        # Late: the trainer pulls in torch and megatron-core; mapping flags does not need them.
        from megatron_ext.train import run_from_overrides

        run_from_overrides(overrides)
    # Bad flags, broken rules between fields, and Hydra's refusals of a passed-through override
    # (unknown key, wrong type) all happen before anything is written: one line, exit code 2.
    except (MlmArgsError, ConfigError, HydraException) as error:
        message = str(error) if isinstance(error, ConfigError) else " ".join(str(error).split())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
