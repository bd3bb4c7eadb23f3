"""The Trainer, its step, checkpoints, metrics and preemption handling."""
