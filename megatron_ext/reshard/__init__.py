"""Live reshard (DynaTrain's Virtual Parameter Space): change TP / PP / DP / EP / CP of a running
job with every training state carried over.

    boxes.py     box geometry: intersection, subtraction, flat range -> contiguous boxes
    skeleton.py  megatron's model + DDP for any rank of any layout, on meta tensors and fake groups
    vps.py       every rank's pieces of every training state, from megatron's own metadata, one
                 skeleton per pipeline stage; the holders of a box, by position and replica
    plan.py      rank_plan(model, A, B, rank): a rank's own part of the minimal transfer plan by
                 box intersection; plan(model, A, B): the world's, their union (pure, cached)
    plan_scale.py  a rank plan's time and memory at cluster scale, bytes against the minimum
    execute.py   schedule(rank plan, budget): agreement and this rank's memory-budgeted rounds;
                 execute(): one packed message per peer per round
    transport.py how the messages travel: shared memory within a host, else point-to-point
    state_access.py  read/write a piece in megatron's params and distributed-optimizer states
    live.py      reshard(trainer, layout): prepare (plan, and build the layout ahead through the
                 layout controller, in the background), switch, move, roll back on failure,
                 within the same workers
    pool.py      the worker pool: moves to another number of workers (standby workers join,
                 leaving workers hand over their state and wait)
    request.py   a request file read and checked for its shape; renamed .done or .rejected
    plugin.py    `plugins=[reshard]`: a schedule, a polled request file; reshard_to(trainer,
                 layout) from Python

    from megatron_ext.parallel.layout import ParallelLayout
    from megatron_ext.reshard.plan import plan
    print(plan(model, ParallelLayout(tp=2, pp=2), ParallelLayout(pp=2, dp=2)).summary())

The layouts themselves (megatron_ext/parallel/) are the core's, and so is changing them: a move
prepares, installs, commits or rolls back the Trainer's layout through its layout controller
(megatron_ext/training/layout_controller.py), what a plugin that declares CHANGES_LAYOUT gets.
"""
