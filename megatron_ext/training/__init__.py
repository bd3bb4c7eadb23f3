"""The Trainer, its step, metrics and preemption handling."""
