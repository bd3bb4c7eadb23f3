"""The parallel layout as a core value.

    layout.py   ParallelLayout: how a world's ranks are cut (tp, pp, dp, ep, cp), dp resolved
                once; megatron's rank order; validity by the runtime's rules
    groups.py   a layout's megatron process groups: creating and destroying them
    ddp.py      megatron's DistributedDataParallel around a rank's model chunks, as a layout sets it
    release.py  a left layout's objects dropped off the training thread, after the stall
    world.py    a torch world built in background threads before the process enters it (a
                worker pool that changes its number of workers)
"""

from megatron_ext.parallel.layout import ParallelLayout

__all__ = ["ParallelLayout"]
