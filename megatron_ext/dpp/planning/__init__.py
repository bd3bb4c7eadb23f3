"""DPP's planning: a StepPlan per global batch from the lengths of its documents and a cost model.
Pure values; the simulator runs plans without torch.distributed.

    plan.py       Chunk, Segment, Group, StepPlan: what the planner produces and the runtime runs
    lengths.py    sequence-length distributions (data/: measured histograms) and a batch sampler
    costmodel.py  a chunk's time and memory on a pipeline stage
    chunking.py   workload-balanced sequence chunking (InfiniPipe Alg. 1)
    schedule.py   non-interleaved 1F1B over chunks of unequal size
    recompute.py  stage-aware, chunk-level activation recomputation (the ILP)
    simulate.py   discrete-event execution of a StepPlan under a cost model
    planner.py    the DPP planner and the static baselines it is compared with
    gantt.py      a step's Gantt chart, simulated or measured
"""
