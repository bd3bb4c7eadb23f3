"""Render an sbatch script from a template in this folder.

    python scripts/slurm/render.py train_multinode --nodes 4 --gpus-per-node 8 --time 04:00:00 \
        --partition gpu --account proj parallel.tp=8 'checkpoint.save=/scratch/my run' \
        -o job.sbatch
    sbatch job.sbatch [more Hydra overrides]

--dry-run prints the script instead of writing it. Templates are plain sbatch files whose
`${lower_case}` words are placeholders; every other `$` is left to the shell, so templates keep
using `$SLURM_JOB_ID` and `${OMP_NUM_THREADS:-...}` as usual.
"""

from __future__ import annotations

import argparse
import re
import shlex
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

TEMPLATE_DIR = Path(__file__).resolve().parent


class SbatchTemplate(string.Template):
    # Only ${lower_case} is a placeholder: never $name, never $$, never upper case.
    flags = 0
    pattern = r"""
        \$(?:
            (?P<escaped>(?!))
          | (?P<named>(?!))
          | \{(?P<braced>[a-z][a-z0-9_]*)\}
          | (?P<invalid>(?!))
        )
    """


@dataclass(frozen=True)
class Job:
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_gpu: int = 8
    # sbatch --time: minutes, MM:SS, HH:MM:SS or D-HH:MM:SS.
    time: str = "01:00:00"
    job_name: str = "megatron_ext"
    partition: Optional[str] = None
    account: Optional[str] = None
    # Hydra overrides for megatron_ext.train, quoted for the shell when rendered.
    overrides: Sequence[str] = ()

    def check(self) -> None:
        """Values land in #SBATCH lines, where a stray character silently changes the job."""
        for name in ("nodes", "gpus_per_node", "cpus_per_gpu"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", self.time):
            raise ValueError(f"time must look like 90, 01:30:00 or 1-00:00:00, got {self.time!r}")
        for name in ("job_name", "partition", "account"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[\w.\-]+", value):
                raise ValueError(f"{name} may hold letters, digits, '_', '.', '-'; got {value!r}")

    def placeholders(self) -> dict[str, str]:
        options = [f"#SBATCH --{name}={value}" for name, value in
                   (("partition", self.partition), ("account", self.account)) if value]
        return {
            "nodes": str(self.nodes),
            "gpus_per_node": str(self.gpus_per_node),
            "cpus_per_gpu": str(self.cpus_per_gpu),
            "cpus_per_node": str(self.cpus_per_gpu * self.gpus_per_node),
            "time": self.time,
            "job_name": self.job_name,
            "sbatch_options": "\n".join(options),
            "overrides": shlex.join(self.overrides),
        }


def template_path(name: str) -> Path:
    """A template of this folder by name (train_srun) or any file by path."""
    path = Path(name)
    return path if path.suffix else TEMPLATE_DIR / f"{name}.sbatch"


def render(template: str, job: Job) -> str:
    """The sbatch script: `template`'s text with `job`'s values in place."""
    job.check()
    try:
        return SbatchTemplate(template).substitute(job.placeholders())
    except KeyError as missing:
        name = missing.args[0]
        raise ValueError(f"the template uses an unknown placeholder ${{{name}}}") from None


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("template", help="train_multinode, train_srun, or a path")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for megatron_ext.train")
    parser.add_argument("--nodes", type=int, default=Job.nodes)
    parser.add_argument("--gpus-per-node", type=int, default=Job.gpus_per_node)
    parser.add_argument("--cpus-per-gpu", type=int, default=Job.cpus_per_gpu)
    parser.add_argument("--time", default=Job.time)
    parser.add_argument("--job-name", default=Job.job_name)
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("-o", "--output", help="file to write (default: <job-name>.sbatch)")
    parser.add_argument("--dry-run", action="store_true", help="print the script, write nothing")
    args = parser.parse_intermixed_args(argv)
    job = Job(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_gpu=args.cpus_per_gpu,
        time=args.time, job_name=args.job_name, partition=args.partition,
        account=args.account, overrides=args.overrides,
    )
    try:
        script = render(template_path(args.template).read_text(), job)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if args.dry_run:
        sys.stdout.write(script)
        return
    output = Path(args.output or f"{args.job_name}.sbatch")
    output.write_text(script)
    print(f"wrote {output}; submit with: sbatch {shlex.quote(str(output))}")


if __name__ == "__main__":
    main()
