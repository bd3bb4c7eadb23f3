"""torch's initial Adam state, made before the first step that would create it lazily.

A checkpoint of an optimizer that has not updated yet (fp16 skips its first steps; a resume
template is a fresh optimizer) must hold the moments the next load asks for. Not CPU-specific.
"""

import torch


def materialise_initial_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without state torch's own initial Adam state (step 0, zero
    moments), which torch would create lazily in the first step: the next step is unchanged."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if len(optimizer.state[p]) == 0:
                optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
