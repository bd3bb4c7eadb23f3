"""The packed LoRA runtime: K jobs trained at once on one frozen megatron-core base.

    layers.py      multi-adapter LoRA on megatron's tensor-parallel linears
    kernels/       the adapters' shrink and expand over row segments (reference, grouped, Triton)
    base.py        the frozen GPTModel a pack trains on, with the LoRA wrappers attached
    loss.py        the base's loss over its own TP group
    batching.py    each job's micro-batches and one packed micro-batch of them
    optim.py       each job's own AdamW, schedule and gradient clipping
    active_job.py  a job while it holds a slot, and its result
    packed.py      PackedTrainer: one base forward/backward per step for every active job
    groups.py      the process groups of a plan's packs, each at its own TP degree
    execute.py     a plan run on this world: packs on separate ranks at the same time
    checkpoint.py  one job's training checkpoint, for an exact resume
    resume.py      a sweep's checkpoints and the re-launch that continues it
"""
