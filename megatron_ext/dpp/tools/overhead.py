"""What a pipelined step spends beyond the layers as timed alone, measured on the DPP runtime.

    python -m torch.distributed.run --nproc-per-node 2 -m megatron_ext.dpp.tools.overhead --cost cost.json

(`python -m megatron_ext.dpp.tools.calibrate` runs it after timing the layers.) Two processes form a
PP=2 run of the model with the DPP plugin, as training does, and measure:
- point-to-point: an activation (tokens x 1 x hidden) sent to the other stage and back, for
  several token counts; half the median round trip is one transfer (`p2p_latency_s`,
  `p2p_s_token`);
- the ops: steps of one-group plans of a GitHub-like batch in several shapes (DPP's balanced
  mesh with 1, 4 and 16 slices per long sequence, its even mesh, ChunkFlow-like fixed chunks),
  recompute off and on, timed op by op; per kind, the op's time against the cost model's time
  of its layers (and head) gives a scale per chunk size and the loop's fixed seconds per op
  (`runtime_scale_tokens`, `runtime_*_scales`, `chunk_*_s`): inside a step the layers may run
  slower than timed alone (with the calibration's best round 1.4-1.7x, its median 1.0-1.1x on
  this machine), and the loop builds inputs, embeds and posts sends around them;
- the step's fixed work: the step's time less the span of its ops (gradient finalisation, the
  last sends; `step_fixed_s`, the median).
The terms are fitted on one batch's plans; a second batch's plans (other lengths) are held out.
The errors of the simulated step time against the measured one are reported for both, with
and without the terms, and per plan shape with per-size and with one scale per op kind. The
JSON's cost model gains these terms in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config
from scipy.optimize import nnls

from megatron_ext.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.dpp.planning.chunking import chunk_batch
from megatron_ext.dpp.planning.costmodel import CostModel, scale_weights
from megatron_ext.dpp.planning.lengths import get_distribution, sample_batch
from megatron_ext.dpp.planning.plan import StepPlan
from megatron_ext.dpp.planning.planner import StaticConfig, _renumber, _static_chunks
from megatron_ext.dpp.planning.schedule import longest_first, one_f_one_b, units
from megatron_ext.dpp.planning.simulate import simulate
from megatron_ext.dpp.plugin import DppConfig, DppPlugin
from megatron_ext.dpp.runtime.loop import DppStep, PlannedBatch
from megatron_ext.dpp.runtime.memory import Timeline
from megatron_ext.dpp.tools.calibrate import default_vocab
from megatron_ext.platform.launch import join_world
from megatron_ext.training.step import forward_step
from megatron_ext.training.trainer import Trainer

P2P_TOKENS = (16, 256, 1024, 4096)


@dataclass(frozen=True)
class OpSample:
    plan: int
    stage: int
    kind: str  # "F" | "B"
    chunk: int
    measured_s: float
    layers_s: float  # the cost model's time of the op without the loop's own
    tokens: int = 0  # the chunk's


@dataclass(frozen=True)
class StepSample:
    plan: int
    measured_s: float
    span_s: float  # the first op's start to the last op's end, over both stages


def fit_p2p(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(latency s, s per token) of a transfer: non-negative least squares over (tokens, s)."""
    (latency, per_token), _ = nnls(np.array([[1.0, n] for n, _ in samples]), np.array([s for _, s in samples]))
    return float(latency), float(per_token)


LOOP_TERMS = ("runtime_fwd_scale", "chunk_fwd_s", "runtime_bwd_scale", "chunk_bwd_s", "step_fixed_s")
# The chunk sizes of the per-size in-step factors: the measured plans' chunks span 64-4096 tokens.
SCALE_TOKENS = (128, 512, 2048)
# The plan shapes measured (`shape_chunks`): DPP's balanced mesh from few large chunks to many
# small ones, its even mesh, and ChunkFlow-like fixed 512-token chunks (at seq_len 4096).
SHAPES = (("balanced", 1), ("balanced", 4), ("balanced", 16), ("even", 16), ("chunkflow", 8))


def bare(cost: CostModel) -> CostModel:
    """`cost` with the layers as timed alone: no loop terms, scales 1, no p2p."""
    return dataclasses.replace(cost, runtime_fwd_scale=1.0, runtime_bwd_scale=1.0, chunk_fwd_s=0.0, chunk_bwd_s=0.0,
                               step_fixed_s=0.0, p2p_latency_s=0.0, p2p_s_token=0.0, runtime_scale_tokens=None,
                               runtime_fwd_scales=None, runtime_bwd_scales=None)


def fit_loop(ops: Sequence[OpSample], steps: Sequence[StepSample], scale_tokens: Sequence[int] | None = None) -> dict:
    """Per op kind, the scale of the layers' time and the loop's fixed seconds (non-negative
    least squares of the measured op time on the layers' time: the seconds of a step add up,
    so large ops weigh more), and the step's fixed seconds (the median of the step less the
    span of its ops). With `scale_tokens`, one scale per chunk size (`CostModel.runtime_scale`:
    each op's layers' time split over the sizes by `scale_weights` of its chunk's tokens),
    least squares relative to each op's time."""
    out: dict = {}
    if scale_tokens:  # a size no op comes near has no data: the nearest measured size stands for it
        near = np.sum([scale_weights(scale_tokens, o.tokens) for o in ops], axis=0)
        scale_tokens = tuple(n for n, w in zip(scale_tokens, near) if w > 0)
    for kind in ("F", "B"):
        mine = [o for o in ops if o.kind == kind]
        weights = [scale_weights(scale_tokens, o.tokens) if scale_tokens else [1.0] for o in mine]
        X = np.array([[o.layers_s * w for w in ws] + [1.0] for o, ws in zip(mine, weights)])
        y = np.array([o.measured_s for o in mine])
        # Per size, relative to each op's time: an op's noise is a fraction of it, and the small
        # chunks' scales would otherwise be left to the large ops' noise.
        w = 1.0 / y if scale_tokens else np.ones_like(y)
        *scales, fixed = nnls(X * w[:, None], y * w)[0]
        name = "fwd" if kind == "F" else "bwd"
        if scale_tokens:
            out[f"runtime_{name}_scales"] = tuple(float(x) for x in scales)
        else:
            out[f"runtime_{name}_scale"] = float(scales[0])
        out[f"chunk_{name}_s"] = float(fixed)
    if scale_tokens:
        out["runtime_scale_tokens"] = tuple(scale_tokens)
    out["step_fixed_s"] = max(0.0, statistics.median(s.measured_s - s.span_s for s in steps))
    return out


def op_time_s(cost: CostModel, plan: StepPlan, layers: int, stage: int, kind: str, chunk: int, recompute: int) -> float:
    """The time of one op of a plan under `cost`."""
    c, last = plan.chunks[chunk], stage == plan.pp - 1
    return cost.forward_s(c, layers, last) if kind == "F" else cost.backward_s(c, layers, recompute, last)


def step_errors(cost: CostModel, plans: Sequence[StepPlan], steps: Sequence[StepSample]) -> dict[str, float]:
    """Relative error of the simulated step time against each measured step (mean, max), and
    the signed mean (positive: predicted slower than measured)."""
    signed = [simulate(plans[s.plan], cost, check=False).iter_s / s.measured_s - 1 for s in steps]
    errors = np.abs(signed)
    return {"step_mean": float(np.mean(errors)), "step_max": float(np.max(errors)), "step_signed_mean": float(np.mean(signed))}


def shape_errors(cost: CostModel, plans: Sequence[StepPlan], steps: Sequence[StepSample],
                 shapes: Sequence[str]) -> dict[str, dict[str, float]]:
    """`step_errors` per plan shape (`shapes[i]` names plan i)."""
    return {name: step_errors(cost, plans, [s for s in steps if shapes[s.plan] == name])
            for name in dict.fromkeys(shapes[s.plan] for s in steps)}


def op_errors(cost: CostModel, ops: Sequence[OpSample]) -> dict[str, float]:
    """Mean relative error of each op's time under `cost`'s loop terms against the measured."""
    errors: dict[str, list[float]] = {"F": [], "B": []}
    for o in ops:
        fixed = cost.chunk_fwd_s if o.kind == "F" else cost.chunk_bwd_s
        errors[o.kind].append(abs((cost.runtime_scale(o.kind, o.tokens) * o.layers_s + fixed) / o.measured_s - 1))
    return {f"{k.lower()}wd_op_mean": float(np.mean(v)) for k, v in errors.items() if v}


# --- measuring (2 processes) ----------------------------------------------------------------


def shape_chunks(lengths: Sequence[int], cost: CostModel, mesh: str, k: int, seq_len: int) -> tuple:
    """Chunks of a batch in one of the planners' shapes: the DPP chunking on its "balanced"
    (equal-time) or "even" mesh of k slices, or "chunkflow": fixed chunks of seq_len / k
    tokens with short sequences packed to them (the ChunkFlow-like policy's)."""
    if mesh == "chunkflow":
        return _static_chunks(lengths, StaticConfig("chunkflow", seq_len, seq_len // k), cost)
    if mesh not in ("balanced", "even"):
        raise ValueError(f"dpp: unknown plan shape {mesh!r}; known: balanced, even, chunkflow")
    return chunk_batch(lengths, cost, k, mesh == "balanced")


def synthetic_plans(cost: CostModel, layers: int, seq_len: int, docs: int, seed: int,
                    shapes: Sequence[tuple[str, int]]) -> list[StepPlan]:
    """One-group plans of a GitHub-like batch for each (mesh, slice number) of `shapes`
    (`shape_chunks`), longest first, without and with every layer recomputed (no memory
    budget: only time is measured)."""
    lengths = list(sample_batch(get_distribution("github"), docs, seq_len, np.random.default_rng(seed)).lengths)
    plans = []
    for mesh, k in shapes:
        chunks = shape_chunks(lengths, cost, mesh, k, seq_len)
        order = longest_first(units(chunks), lambda c: cost.layer_forward_s(chunks[c]))  # noqa: B023 (called here)
        for recompute in (0, layers):
            rec = {(p, c.id): recompute for p in range(2) for c in chunks}
            plans.append(_renumber(chunks, [one_f_one_b(order, 2, rec)], 2, lengths))
    return plans


def shape_labels(shapes: Sequence[tuple[str, int]]) -> list[str]:
    """The label of each plan of `synthetic_plans` for `shapes`."""
    return [f"{mesh} k{k}{' recompute' if r else ''}" for mesh, k in shapes for r in (False, True)]


def _p2p_samples(hidden: int, rank: int, rounds: int) -> list[tuple[int, float]]:
    """(tokens, the median one-way seconds over `rounds` round trips) per token count."""
    out = []
    for n in P2P_TOKENS:
        x, times = torch.randn(n, 1, hidden), []
        for _ in range(rounds):
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            times.append((time.perf_counter() - t) / 2)
        out.append((n, statistics.median(times)))
    return out


def measure(cost: CostModel, model: str, seq_len: int, docs: int, seed: int, shapes: Sequence[tuple[str, int]],
            rounds: int) -> dict:
    """Run in both processes of a PP=2 world; returns the samples on rank 0 (None elsewhere)."""
    preset: ModelConfig = dataclasses.replace(MODEL_PRESETS[model], seq_length=256)
    plugin = DppPlugin(DppConfig(max_seq_len=seq_len))
    trainer = Trainer(Config(model=preset, parallel=ParallelConfig(pp=2, use_distributed_optimizer=False),
                             train=TrainConfig(iters=1, eval_interval=0), plugins=["dpp"]), [plugin])
    trainer.setup()
    rank = dist.get_rank()
    layers = preset.num_layers // 2
    fitted = synthetic_plans(cost, layers, seq_len, docs, seed, shapes)
    plans = fitted + synthetic_plans(cost, layers, seq_len, docs, seed + 1, shapes)
    gen = torch.Generator().manual_seed(seed)  # any token ids do: time does not depend on them
    documents = {p.seq_lengths: tuple(torch.randint(0, default_vocab(model), (n + 1,), generator=gen) for n in p.seq_lengths)
                 for p in plans}
    timeline = Timeline()
    step = DppStep(plugin.context, None, timeline)

    def run(plan: StepPlan) -> tuple[float, list]:
        for m in trainer.model:
            m.zero_grad_buffer()
        timeline.clear()
        dist.barrier()
        t = time.perf_counter()
        step(PlannedBatch(plan, documents[plan.seq_lengths]), forward_step, trainer.model)
        dist.barrier()
        return time.perf_counter() - t, [(*r[:4], r[4] - t, r[5] - t) for r in timeline.records]

    run(plans[0])  # warm-up
    records = []
    for _ in range(rounds):
        for i, plan in enumerate(plans):
            records.append((i, *run(plan)))
    p2p = _p2p_samples(get_model_config(trainer.model[0]).hidden_size, rank, rounds=15)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    trainer.close()
    if rank != 0:
        return {}
    steps, ops = [], []
    for r, (i, wall, _) in enumerate(records):
        mine = [op for g in gathered for op in g[r][2]]
        steps.append(StepSample(i, wall, max(o[5] for o in mine) - min(o[4] for o in mine)))
        recompute = {(s, c): k for s, kind, c, k, _, _ in mine if kind == "F"}
        ops += [OpSample(i, s, kind, c, b - a, op_time_s(bare(cost), plans[i], layers, s, kind, c, recompute[(s, c)]),
                         plans[i].chunks[c].tokens)
                for s, kind, c, _, a, b in mine]
    return {"plans": plans, "fit_plans": len(fitted), "steps": steps, "ops": ops, "p2p": p2p,
            "shapes": shape_labels(shapes) * 2}


def with_overhead(cost: CostModel, samples: dict,
                  scale_tokens: Sequence[int] | None = SCALE_TOKENS) -> tuple[CostModel, dict]:
    """`cost` with its p2p and loop terms fitted on the first batch's plans (one in-step scale
    per chunk size of `scale_tokens`; None: one per op kind); errors on both batches (the
    second one held out), overall and per plan shape, beside those of the layers alone and of
    one scale per op kind."""
    split = samples["fit_plans"]
    fitted_on = lambda items: [x for x in items if x.plan < split]  # noqa: E731
    held_out = lambda items: [x for x in items if x.plan >= split]  # noqa: E731
    latency, per_token = fit_p2p(samples["p2p"])

    def fitted(tokens: Sequence[int] | None) -> CostModel:
        return dataclasses.replace(bare(cost), p2p_latency_s=latency, p2p_s_token=per_token,
                                   **fit_loop(fitted_on(samples["ops"]), fitted_on(samples["steps"]), tokens))

    model, single = fitted(scale_tokens), fitted(None)
    plans, steps, ops, shapes = samples["plans"], samples["steps"], samples["ops"], samples["shapes"]
    errors = {
        "layers_only_train": step_errors(bare(cost), plans, fitted_on(steps)),
        "layers_only_held_out": step_errors(bare(cost), plans, held_out(steps)),
        "train": {**step_errors(model, plans, fitted_on(steps)), **op_errors(model, fitted_on(ops))},
        "held_out": {**step_errors(model, plans, held_out(steps)), **op_errors(model, held_out(ops))},
        "one_scale_held_out": {**step_errors(single, plans, held_out(steps)), **op_errors(single, held_out(ops))},
        "held_out_per_shape": shape_errors(model, plans, held_out(steps), shapes),
        "one_scale_held_out_per_shape": shape_errors(single, plans, held_out(steps), shapes),
    }
    return model, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost", required=True, help="a calibrate.py JSON; its cost model gains the overhead terms in place")
    ap.add_argument("--model", default="llama_tiny")
    ap.add_argument("--seq-len", type=int, default=4096, help="the longest sequence of the plans")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--shapes", nargs="+", default=[f"{mesh}:{k}" for mesh, k in SHAPES],
                    help="plan shapes MESH:K (mesh balanced, even or chunkflow; K slices; see shape_chunks)")
    ap.add_argument("--scale-tokens", type=int, nargs="*", default=list(SCALE_TOKENS),
                    help="chunk sizes of the per-size in-step scales; none: one scale per op kind")
    ap.add_argument("--rounds", type=int, default=2, help="steps of each plan (the plans round-robin)")
    args = ap.parse_args()

    join_world("cpu")
    t = time.perf_counter()
    stored = json.loads(Path(args.cost).read_text())
    shapes = [(mesh, int(k)) for mesh, k in (s.split(":") for s in args.shapes)]
    samples = measure(CostModel(**stored["cost_model"]), args.model, args.seq_len, args.docs, args.seed, shapes, args.rounds)
    if samples:
        model, errors = with_overhead(CostModel(**stored["cost_model"]), samples, args.scale_tokens or None)
        stored["cost_model"] = dataclasses.asdict(model)
        stored["overhead"] = {"errors": errors, "p2p_samples": samples["p2p"], "measure_s": time.perf_counter() - t,
                              "steps": [dataclasses.asdict(s) for s in samples["steps"]],
                              "ops": [dataclasses.asdict(o) for o in samples["ops"]]}
        Path(args.cost).write_text(json.dumps(stored, indent=2))
        print(json.dumps({k: getattr(model, k) for k in ("p2p_latency_s", "p2p_s_token", "chunk_fwd_s", "chunk_bwd_s", "step_fixed_s")}, indent=1))
        print("step time relative error:", json.dumps(errors, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
