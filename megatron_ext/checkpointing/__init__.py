"""Checkpoints on disk, below the models and the training loop that save and load them.

    torch_dist.py  megatron's torch_dist checkpoints: model, optimizer and RNG states saved
                   atomically (staged, then published), loaded into any layout
    tracker.py     where a checkpoint directory keeps each iteration and the newest one; no torch
                   (the launcher reads it before any worker starts)

This package imports nothing itself, so `tracker` stays free of torch.
"""
