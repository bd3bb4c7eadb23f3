"""`plugins=[lora]`: fine-tune LoRA adapters on a frozen base, many jobs packed at once.

    # one packed, planned execution of a Hydra sweep (not one process per combination)
    python -m megatron_ext.train -m experiment=lora_sweep lora.rank=8,16,64 optim.lr=1e-4,3e-4
    # a plain multi-job config: lora.jobs (or a YAML file lora.jobs_file) lists the jobs, each
    # entry overriding the job the rest of the config describes
    python -m megatron_ext.train experiment=lora_sweep lora.jobs_file=my_jobs.yaml

A job is a `LoraJob` (job.py): the adapter from this section (rank, alpha, dropout, targets),
its optimisation from `optim` (lr, weight decay, clipping, schedule), its batches and length
from `train` / `model.seq_length`, its steps from `train.iters`. The run is sweep.py's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron_ext.config.sweep import Sweep
from megatron_ext.lora.config import SECTION
from megatron_ext.plugin import Plugin, Runner, register_plugin


@register_plugin
class LoraPlugin(Plugin):
    """Selecting `lora` makes the entrypoint run a packed sweep (sweep.run_sweep) instead of the
    Trainer's single job: many jobs, each with its own optimizer and lifetime, share one base
    pass, which the Trainer's one-model/one-optimizer loop does not express."""

    section = SECTION

    @classmethod
    def multirun(cls, sweep: Sweep, first: Any) -> Optional[tuple[Any, Callable[[], Any]]]:
        # A sweep of LoRA jobs is one packed execution, not one run per combination.
        from megatron_ext.lora.sweep import multirun_jobs, run_sweep  # heavy: torch, when a worker or a sweep uses the plugin

        cfg, jobs = multirun_jobs(sweep, first)
        return cfg, lambda: run_sweep(cfg, jobs)

    def runner(self) -> Runner:
        # The sweep's own loop ends on a pre-emption signal as any process does (it has no
        # step boundary shared by the jobs).
        from megatron_ext.lora.sweep import jobs_of, run_sweep  # heavy: torch, when a worker or a sweep uses the plugin

        return Runner(lambda cfg: run_sweep(cfg, jobs_of(cfg)), stops_at_a_step=False)
