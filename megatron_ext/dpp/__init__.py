"""dpp: dynamic pipeline parallelism for long, skewed sequence lengths (InfiniPipe).

    planning/   a step plan per global batch: chunks, 1F1B groups, recompute counts, from a
                cost model; pure values, simulated without torch.distributed
    runtime/    a plan run on megatron-core's p2p layer: chunk attention, document batches,
                the schedule loop, activation metering, planning ahead of training
    tools/      command lines that fit the cost model on this machine
    plugin.py   `plugins=[dpp]`: the planner and runtime in place of megatron's schedule
"""
