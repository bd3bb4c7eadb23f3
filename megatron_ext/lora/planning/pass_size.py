"""`lora.max_pass_tokens: auto`: how many tokens one packed forward/backward should hold here.

Packing K jobs into one pass makes K small base GEMMs one large one, which pays until the
device runs near its best rate per token; beyond that a larger pass mostly holds more
activations (each doubling of a pass doubles them: K = 8 jobs of 4 x 128 tokens in one pass
reach 2x the peak memory of one job on a CPU) for a few percent of speed. So `auto` caps a pass
at the knee of the device's rate: the smallest pass within KNEE of the best rate per token.

Where the size comes from, in order: the cost-model file (`lora.cost_model`, whose calibration
times passes of growing size: calibrate.measure_pass_rates), else CPU_PASS_TOKENS on a CPU, else
no cap (no GPU was measured; the planner's memory model keeps packs within memory there). A micro-batch larger than the cap runs as a pass of its
own, so the cap never splits a job's micro-batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from megatron_ext.platform.device import resolve_device

AUTO = "auto"
KNEE = 0.85
# This project's CPU (one thread, scripts/bench/lora.py's 4-layer LLaMA, 128-token samples): the
# measured knee moves between 512 and 1,024 tokens from run to run (the rates' noise is about
# +-10%); 1,024-token passes ran at 0.90-0.97 of the best rate (`pass_rates` of
# scripts/bench/results/lora_throughput.json: knee 512, 1,024 at 0.97).
CPU_PASS_TOKENS = 1024

Setting = Union[int, str, None]


def knee(rates: Mapping[int, float], fraction: float = KNEE) -> int:
    """The smallest pass size (tokens) whose rate (tokens/s) is at least `fraction` of the best."""
    if not rates:
        raise ValueError("pass-size knee: no measured rates")
    best = max(rates.values())
    return min(size for size, rate in rates.items() if rate >= fraction * best)


def check_setting(value: Setting) -> Optional[str]:
    """What is wrong with a `lora.max_pass_tokens` value, or None."""
    if value is None or value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"lora.max_pass_tokens must be {AUTO!r}, null or >= 1 tokens, got {value!r}"
    return None


def resolve(value: Setting, cost_model: Optional[str], cuda: Optional[bool] = None) -> Optional[int]:
    """The cap the runtime and the planner use for `lora.max_pass_tokens` = `value`."""
    problem = check_setting(value)
    if problem:
        raise ValueError(problem)
    if value != AUTO:
        return value
    calibrated = load_pass_tokens(cost_model) if cost_model else None
    if calibrated is not None:
        return calibrated
    if cuda is None:
        cuda = torch.cuda.is_available()
    return None if cuda else CPU_PASS_TOKENS


def pass_cap(cfg) -> Optional[int]:
    """`lora.max_pass_tokens` of a run's Config as the runtime and the planner take it."""
    cuda = resolve_device(cfg.launcher.device).type == "cuda"
    return resolve(cfg.lora.max_pass_tokens, cfg.lora.cost_model, cuda)


def load_pass_tokens(path: Union[str, Path]) -> Optional[int]:
    """The calibrated pass size of a cost-model file (None when it was not measured)."""
    try:
        value = json.loads(Path(path).read_text()).get("pass_tokens")
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"lora.cost_model={path}: not a calibration file ({error})") from error
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"lora.cost_model={path}: pass_tokens must be a positive integer, got {value!r}")
    return value
