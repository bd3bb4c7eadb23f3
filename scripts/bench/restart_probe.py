"""A restarted job, timed: new worker processes resume from a checkpoint in a new layout.

    python scripts/bench/restart_probe.py model=llama_100m parallel.dp=4 launcher.nproc=4 \
        checkpoint.load=runs/ckpt

This is what changing the layout of a job costs today once it has saved a checkpoint and
stopped: a fresh launch (`launcher.nproc` processes, like `python -m megatron_ext.train`), the
imports, joining the world, and `Trainer.setup()`, which builds the model, DDP and optimizer in
the new layout and loads the checkpoint. The workers stop when every rank is ready for its next
step. The last line printed is JSON: `{"ready_at": <time.time() when every rank was ready>}`;
`reshard.py` subtracts the time at which it started this process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def worker(overrides: list[str]) -> float:
    """One new rank: join the world, resume, wait for the others; the wall-clock time then."""
    import torch.distributed as dist

    from megatron_ext.config import compose_config
    from megatron_ext.platform.launch import join_world
    from megatron_ext.training.trainer import Trainer

    cfg = compose_config(overrides)
    join_world(cfg.launcher.device)
    trainer = Trainer(cfg, [])
    try:
        trainer.setup()
        dist.barrier()
        return time.time()
    finally:
        trainer.close()
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    from megatron_ext.config import compose_config
    from megatron_ext.platform.launch import launch_local
    from megatron_ext.platform.launch_env import detect_launch

    launcher = compose_config(argv).launcher
    if detect_launch() is None and launcher.nproc > 1:
        port = launcher.master_port
        ready_at = launch_local(launcher.nproc, worker, (argv,), launcher.master_addr, port)[0]
    else:
        ready_at = worker(argv)
    print(json.dumps({"ready_at": ready_at}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
