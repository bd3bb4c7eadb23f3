"""Checkpoints on disk, below the models and the training loop that save and load them.

    torch_dist.py  megatron's torch_dist checkpoints: model, optimizer and RNG states saved
                   atomically (staged, then published), loaded into any layout
    relaid.py      where a run keeps its rewrite of a checkpoint its layout cannot read
    megatron_lm.py what the plain entries mean: Megatron-LM's top-level keys (args, iteration,
                   the scheduler in samples, ...) and the runtime's view of them; no torch
    tracker.py     where a checkpoint directory keeps each iteration and the newest one; no torch
                   (the launcher reads it before any worker starts)

This package imports nothing itself, so `tracker` stays free of torch.
"""
