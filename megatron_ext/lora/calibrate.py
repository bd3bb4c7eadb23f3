"""Calibrate the linear cost model on this machine: time real packed passes of the packed
runtime (PackedTrainer of runtime/packed.py on megatron's GPTModel) for a grid of packs, fit the model on
part of them and report its error on the rest.

    fit, samples, rates = calibrate(model_cfg, vocab_size=512)   # needs a one-rank world (platform.launch)
    print(fit.heldout_error, pass_size.knee(rates))
    save_fit("cost.json", fit, len(samples), pass_size.knee(rates))   # lora.cost_model=cost.json

It also times one job's passes of growing size (`measure_pass_rates`): the knee of that rate is
what `lora.max_pass_tokens: auto` caps a packed pass at (planning/pass_size.py).

Time is the process's CPU time, not the wall clock: on a shared machine the wall clock counts
other people's work, while a one-thread worker's CPU time is the work its device does.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_ext.config.schema import ModelConfig
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.costmodel import Fit, PassWork, Sample, fit
from megatron_ext.lora.planning.workload import replica_work, shapes_of
from megatron_ext.lora.runtime.base import build_base
from megatron_ext.lora.runtime.batching import SyntheticData
from megatron_ext.lora.runtime.packed import PackedTrainer

ATTENTION = ("linear_qkv", "linear_proj")
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
PASS_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)


def calibration_packs(seq_lengths: Sequence[int] = (32, 128)) -> list[tuple[LoraJob, ...]]:
    """Packs of 1..8 jobs over micro-batches, sequence lengths, ranks and target sets."""
    packs = []
    for k, micro, seq, rank, targets in itertools.product((1, 2, 4, 8), (1, 4), seq_lengths, (8, 64), (ATTENTION, ALL)):
        if (k + micro + rank + len(targets) + seq // 32) % 3:
            continue  # a third of the grid: enough spread for six coefficients
        packs.append(
            tuple(
                LoraJob(name=f"c{i}", rank=rank if i % 2 == 0 else max(rank // 4, 1), target_modules=targets,
                        micro_batch_size=micro, global_batch_size=micro, seq_length=seq, steps=1, eval_iters=0)
                for i in range(k)
            )
        )
    return packs


def time_pass(model, wrappers, routing, jobs: Sequence[LoraJob], vocab_size: int, seconds: float = 0.3, repeats: int = 3) -> float:
    """CPU seconds of one packed pass of `jobs` (their optimizer steps included): the fastest of
    `repeats` runs of about `seconds` each, after a warm-up (the minimum drops interference)."""
    per_step = replica_work(jobs[0], 1).passes_per_step

    def run(steps: int) -> float:
        trainer = PackedTrainer(model, wrappers, routing, lambda job: SyntheticData(job, vocab_size), len(jobs))
        trainer.submit([j.replace(steps=steps) for j in jobs])
        start = time.process_time()
        trainer.run()
        return (time.process_time() - start) / (steps * per_step)

    steps = max(1, round(seconds / run(1)))
    return min(run(steps) for _ in range(repeats))


def measure_pass_rates(model, wrappers, routing, vocab_size: int, seq_length: int = 128,
                       sizes: Sequence[int] = PASS_SIZES, seconds: float = 0.3) -> dict[int, float]:
    """Tokens per CPU second of one job's packed pass at each size in `sizes` (tokens: micro-
    batches of size // seq_length samples of seq_length tokens), its optimizer step included."""
    rates = {}
    for size in sizes:
        samples = max(size // seq_length, 1)
        job = LoraJob(name="pass", micro_batch_size=samples, global_batch_size=samples, seq_length=seq_length, steps=1, eval_iters=0)
        rates[samples * seq_length] = samples * seq_length / time_pass(model, wrappers, routing, (job,), vocab_size, seconds)
    return rates


def calibrate(model_cfg: ModelConfig, vocab_size: int, seconds: float = 0.3) -> tuple[Fit, list[Sample], dict[int, float]]:
    """Measure the calibration packs, fit on two thirds, hold out every third; and the rate of
    passes of growing size (measure_pass_rates)."""
    model, wrappers, routing = build_base(model_cfg, vocab_size)
    samples = [Sample(tuple(p), 1, 1, time_pass(model, wrappers, routing, p, vocab_size, seconds)) for p in calibration_packs()]
    rates = measure_pass_rates(model, wrappers, routing, vocab_size, min(128, model_cfg.seq_length), seconds=seconds)
    train = [s for i, s in enumerate(samples) if i % 3 != 2]
    heldout = [s for i, s in enumerate(samples) if i % 3 == 2]
    shapes = shapes_of(dataclasses.replace(model_cfg, vocab_size=vocab_size))
    return fit(shapes, train, heldout), samples, rates


def fit_record(fit: Fit, samples: int, pass_tokens: Optional[int] = None) -> dict:
    """A fit as the plain values the output file (and the sweep benchmark's JSON) hold."""
    return {"coefficients": list(fit.model.coefficients), "train_error": fit.train_error,
            "heldout_error": fit.heldout_error, "heldout_max_error": fit.heldout_max_error, "samples": samples,
            "pass_tokens": pass_tokens}


def save_fit(path: str | Path, fit: Fit, samples: int, pass_tokens: Optional[int] = None) -> Path:
    """The calibration's output file (JSON), which `lora.cost_model` points the planner at;
    `pass_tokens` is what `lora.max_pass_tokens: auto` then caps a pass at (planning/pass_size.py)."""
    path = Path(path)
    path.write_text(json.dumps(fit_record(fit, samples, pass_tokens), indent=1) + "\n")
    return path


def load_coefficients(path: str | Path) -> tuple[float, ...]:
    """The cost-model coefficients of a `save_fit` file, refused with the file named when they
    are missing, of the wrong count, negative or not finite."""
    expected = len(PassWork(0, 0, 0.0, 0.0, 0.0, 0.0).features())
    try:
        values = json.loads(Path(path).read_text())["coefficients"]
        coefficients = tuple(float(v) for v in values)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"lora.cost_model={path}: not a calibration file with coefficients ({error})") from error
    if len(coefficients) != expected or not all(math.isfinite(c) and c >= 0 for c in coefficients):
        raise ValueError(f"lora.cost_model={path}: expected {expected} finite coefficients >= 0, got {list(values)}")
    return coefficients

