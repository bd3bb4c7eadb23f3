"""Packed multi-adapter LoRA fine-tuning on one frozen megatron-core base (PLoRA).

    planning/    which jobs share a pack, on how many devices at which TP/DP, in what order:
                 pure values and models, no torch.distributed
    runtime/     the packs trained: multi-adapter layers and kernels, per-job data and
                 optimizers, the packed trainer, process groups, checkpoints and resume
    job.py       LoraJob: one job of a sweep (adapter, data, optimisation), read by both
    sweep.py     jobs from a config or a Hydra multirun, planned and executed, per-job outputs
    calibrate.py the planner's cost model fitted to timed passes of the packed runtime
    export.py    adapters to and from PEFT and megatron dist_checkpointing folders
    datasets.py  what a job's `dataset` names (its SFT files, a weighted mix, a task) and its data
    tasks.py     small instruction tasks built from the Python standard library
    plugin.py    `plugins=[lora]`: a packed sweep (sweep.py) in place of the Trainer's training
"""
