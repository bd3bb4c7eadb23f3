"""A DPP step equals a single-process reference step on the same global batch.

Workers run one step of a hand-made plan (split slices, a hybrid chunk, packed chunks, one or
two 1F1B groups, per-stage per-chunk recompute) with the DPP runtime on megatron's GPT model,
DDP and p2p, and save every gradient (by global layer) and the step's loss. The reference is
the trainer's model on one process, with megatron's own attention, each sequence forwarded
whole; its summed token losses over the token count, one backward.

The default run is PP=2 with a hand-made plan (recompute on some chunks, two groups) and with
the real planner's plan; PP=2 without recompute, PP=3, PP=4 and PP=2 x DP=2 are marked slow.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.dpp.planning.costmodel import ACTIVATION_ERROR
from megatron_ext.dpp.planning.plan import Chunk, Group, Op, Segment as S, StepPlan

VOCAB = 256
# GQA (8 heads, 2 KV groups), untied output layer.
MODEL = dataclasses.replace(MODEL_PRESETS["llama_tiny_gqa"], vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=96)
# Sequence lengths of the global batch (positions; each document has one token more).
LENGTHS = (37, 9, 14, 6, 5, 3, 11)
# Chunks in forward order: sequence 0 in three slices, its tail packed with sequence 5
# (hybrid); sequence 2 in two slices, its tail packed with sequence 4; sequences 1, 3 packed;
# sequence 6 alone.
CHUNKS = (
    Chunk(0, "split", (S(0, 0, 14),)),
    Chunk(1, "split", (S(0, 14, 12),)),
    Chunk(2, "hybrid", (S(0, 26, 11), S(5, 0, 3))),
    Chunk(3, "split", (S(2, 0, 8),)),
    Chunk(4, "hybrid", (S(2, 8, 6), S(4, 0, 5))),
    Chunk(5, "packed", (S(1, 0, 9), S(3, 0, 6))),
    Chunk(6, "packed", (S(6, 0, 11),)),
)
UNITS = ((0, 1, 2), (3, 4), (5,), (6,))  # chunks chained by shared sequences


def one_f_one_b(units, pp: int, recompute) -> Group:
    """Non-interleaved 1F1B: forwards in unit order, backwards unit by unit with slices
    reversed; stage s runs a backward once it is forwarded there and pp - 1 - s more are."""
    fwd = [c for u in units for c in u]
    bwd = [c for u in units for c in reversed(u)]
    stages = []
    for s in range(pp):
        ops, f, done = [], 0, set()
        for b in bwd:
            while f < len(fwd) and (b not in done or f - len([o for o in ops if o.kind == "B"]) <= pp - 1 - s):
                ops.append(Op("F", fwd[f], recompute(s, fwd[f])))
                done.add(fwd[f])
                f += 1
            ops.append(Op("B", b))
        stages.append(tuple(ops))
    return Group(tuple(stages))


def layers_per_stage(pp: int) -> int:
    return 2


def make_plan(pp: int, recompute: bool, groups: int) -> StepPlan:
    def count(stage, chunk):
        return (chunk + stage) % (layers_per_stage(pp) + 1) if recompute else 0

    parts = [UNITS] if groups == 1 else [UNITS[:2], UNITS[2:]]
    return StepPlan(pp, LENGTHS, CHUNKS, tuple(one_f_one_b(p, pp, count) for p in parts))


# Lengths of a batch the real planner cuts (its slices are at least 64 tokens): sequence 0 in
# slices, sequence 2 in slices with a hybrid tail, the short ones packed.
PLANNED_LENGTHS = (300, 40, 90, 25, 18, 12, 60, 130)


def planning_cost(pp: int):
    from megatron_ext.dpp.planning.costmodel import CostModel

    return CostModel(alpha=2e-5, beta=2e-8, gamma=1e-4, act_bytes_token=6000, ckpt_bytes_token=300,
                     kv_bytes_token=512, head_bytes_token=1500, state_bytes_param=16, layer_params=50000,
                     num_layers=layers_per_stage(pp) * pp)


def planned(pp: int, token_multiple: int = 1) -> StepPlan:
    """The DPP planner's plan of PLANNED_LENGTHS under a budget that makes it recompute."""
    from megatron_ext.dpp.planning.planner import plan_step

    return plan_step(PLANNED_LENGTHS, planning_cost(pp), pp, 4e6, "dpp", token_multiple=token_multiple)


# A static packed plan with uniform recompute (one of each stage's two layers) over chunks that
# hold a long whole sequence: its attention backward's transient outweighs what the layer
# releases before it, so the peak comes in a backward, above what the chunks keep.
PACKED_LENGTHS = (1100, 300, 250, 120, 90, 60)
PACKED_CONTEXT = 1200


def packed(pp: int) -> StepPlan:
    from megatron_ext.dpp.planning.planner import StaticConfig, plan_static

    return plan_static(PACKED_LENGTHS, StaticConfig("packed", PACKED_CONTEXT, PACKED_CONTEXT, recompute=1), planning_cost(pp), pp)


def documents(lengths) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n + 1,), generator=g) for n in lengths]


def model_config(pp: int):
    return dataclasses.replace(MODEL, num_layers=layers_per_stage(pp) * pp)


# name: (world size, pp, plan): `hand` plans recompute (chunk + stage) % 3 layers or none;
# `planned` is the real planner's; `dp2` gives each of two replicas its own share and plan.
CASES = {
    "pp2": (2, 2, "hand"),
    "pp2_recompute_two_groups": (2, 2, "hand_recompute_two_groups"),
    "pp2_planned": (2, 2, "planned"),
    "pp2_packed_recompute": (2, 2, "packed"),
    "pp3_recompute": (3, 3, "hand_recompute"),
    "pp3_planned": (3, 3, "planned"),
    "pp4_recompute_two_groups": (4, 4, "hand_recompute_two_groups"),
    "pp4": (4, 4, "hand"),
    "pp4_planned": (4, 4, "planned"),
    "pp2_dp2_recompute": (4, 2, "dp2_recompute"),
}
DEFAULT = ("pp2_recompute_two_groups", "pp2_planned", "pp2_packed_recompute")
METERED = ("planned", "packed")  # plan kinds whose activation bytes are also counted


def case_lengths(name: str) -> tuple[int, ...]:
    return {"planned": PLANNED_LENGTHS, "packed": PACKED_LENGTHS}.get(CASES[name][2], LENGTHS)


def case_plan(name: str, mine: list[int]) -> StepPlan:
    _, pp, kind = CASES[name]
    if kind == "planned":
        return planned(pp)
    if kind == "packed":
        return packed(pp)
    if kind.startswith("dp2"):
        return share_plan(mine, pp, recompute=True)
    return make_plan(pp, "recompute" in kind, 2 if "two_groups" in kind else 1)




# --- the worker: one rank of a torchrun world ------------------------------------------------


def global_grads(model_chunks) -> dict[str, torch.Tensor]:
    """Every gradient this rank holds, keyed by its name in a one-stage model (megatron's global
    layer number replaces the stage-local index)."""
    from megatron.core.utils import unwrap_model

    grads = {}
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for name, param in model.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
            grads[".".join(parts)] = param.main_grad.detach().clone()
    return grads


def worker(out_dir: str, world: int, only: tuple[str, ...] = ()) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.config.schema import Config, ParallelConfig
    from megatron_ext.dpp.planning.simulate import memory_peaks
    from megatron_ext.dpp.plugin import DppPlugin
    from megatron_ext.dpp.runtime.batch import dp_share
    from megatron_ext.dpp.runtime.loop import DppStep, PlannedBatch, validate_plan
    from megatron_ext.dpp.runtime.memory import ActivationMeter, fit_activation_bytes
    from megatron_ext.platform.launch import join_world
    from megatron_ext.training.step import forward_step, global_mean_loss
    from megatron_ext.training.trainer import Trainer

    join_world("cpu")
    for name, (case_world, pp, _) in CASES.items():
        if case_world != world or (only and name not in only):
            continue
        lengths = case_lengths(name)
        docs = documents(lengths)
        plugin = DppPlugin()
        # Whole reduced grads on every replica (the distributed optimizer keeps only its shard).
        parallel = ParallelConfig(pp=pp, use_distributed_optimizer=False)
        trainer = Trainer(Config(model=model_config(pp), parallel=parallel), [plugin])
        trainer._init_layout()
        trainer.vocab_size = VOCAB
        trainer.model, trainer.model_config = trainer.build_model(trainer.cfg.parallel)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        mine = dp_share(lengths, dp, dp_rank)
        plan = case_plan(name, mine)
        validate_plan(plan, [layers_per_stage(pp)] * pp)
        report = {}
        step = plugin.step
        if CASES[name][2] in METERED:  # also count the stage's activation bytes exactly
            cost, _ = fit_activation_bytes(trainer.model, plugin.context, planning_cost(pp))
            state = cost.model_state_bytes(layers_per_stage(pp), False, False)
            stage = parallel_state.get_pipeline_model_parallel_rank()
            predicted = float(memory_peaks(plan, cost, [layers_per_stage(pp)] * pp)[stage] - state)
            step = DppStep(plugin.context, ActivationMeter(trainer.model))
        losses = step(PlannedBatch(plan, tuple(docs[i] for i in mine)), forward_step, trainer.model)
        if step.meter is not None:
            report = {"measured_act_bytes": step.meter.peak_bytes, "predicted_act_bytes": predicted}
        report.update(grads=global_grads(trainer.model), loss=global_mean_loss(losses))
        torch.save(report, Path(out_dir, f"{name}_rank{dist.get_rank()}.pt"))
        trainer.close()
    dist.destroy_process_group()


def share_plan(mine: list[int], pp: int, recompute: bool) -> StepPlan:
    """A plan for a replica's share: each of its sequences whole, in its own chunk, except the
    longest, split in two (its tail packed with the shortest, when there are three or more)."""
    lengths = tuple(LENGTHS[i] for i in mine)
    order = sorted(range(len(mine)), key=lambda i: -lengths[i])
    longest, rest = order[0], order[1:]
    half = lengths[longest] // 2
    chunks = [Chunk(0, "split", (S(longest, 0, half),))]
    tail = (S(longest, half, lengths[longest] - half),)
    if len(rest) >= 2:
        shortest = rest.pop()
        tail += (S(shortest, 0, lengths[shortest]),)
    chunks.append(Chunk(1, "hybrid" if len(tail) > 1 else "split", tail))
    chunks += [Chunk(len(chunks) + j, "packed", (S(i, 0, lengths[i]),)) for j, i in enumerate(rest)]
    units = [(0, 1)] + [(c.id,) for c in chunks[2:]]

    def count(stage, chunk):
        return (chunk + stage) % (layers_per_stage(pp) + 1) if recompute else 0

    return StepPlan(pp, lengths, tuple(chunks), (one_f_one_b(units, pp, count),))


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), tuple(sys.argv[3:]))


# --- the test --------------------------------------------------------------------------------


def named_grads(model_chunks) -> dict[str, torch.Tensor]:
    from megatron.core.utils import unwrap_model

    return {name: p.main_grad.detach().clone() for name, p in unwrap_model(model_chunks[0]).named_parameters()}


def reference(pp: int, lengths, grads_of=named_grads, model=None) -> tuple[dict, float]:
    """Gradients (as `grads_of(model chunks)` keys them) and loss of the whole batch on one
    process with megatron's own attention (the model of `model_config(pp)`, or `model`)."""
    import torch.distributed as dist

    from megatron_ext.config.schema import Config
    from megatron_ext.dpp.runtime.batch import chunk_inputs
    from megatron_ext.platform.launch import join_world
    from megatron_ext.training.trainer import Trainer

    join_world("cpu")
    try:
        trainer = Trainer(Config(model=model or model_config(pp)))
        trainer._init_layout()
        trainer.vocab_size = VOCAB
        trainer.model, trainer.model_config = trainer.build_model(trainer.cfg.parallel)
        model = trainer.model[0]
        docs, total, tokens = documents(lengths), 0.0, sum(lengths)
        for i, n in enumerate(lengths):
            batch = chunk_inputs(Chunk(0, "packed", (S(i, 0, n),)), docs)
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum()
            loss.backward()
            total += loss.item()
        grads = {key: grad / tokens for key, grad in grads_of(trainer.model).items()}
        trainer.close()
        return grads, total / tokens
    finally:
        dist.destroy_process_group()


def launch_of(name: str) -> tuple[int, tuple[str, ...]]:
    """(world size, the cases one torchrun launch runs): the default cases run together, the
    slow ones by world size."""
    world = CASES[name][0]
    if name in DEFAULT:
        return world, DEFAULT
    return world, tuple(n for n, c in CASES.items() if c[0] == world and n not in DEFAULT)


def launcher(out: Path, script: str, launch_of):
    """`run(name)`: starts the torchrun launch `launch_of(name)` (world size, its cases) of the
    worker `script` once, writing into `out`, and returns `out`."""
    from _torchrun import torchrun

    done = set()

    def run(name: str) -> Path:
        world, names = launch_of(name)
        if names not in done:
            torchrun(script, world, str(out), str(world), *names)
            done.add(names)
        return out

    return run


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return launcher(tmp_path_factory.mktemp("dpp_runtime"), __file__, launch_of)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in CASES]
)
def test_dpp_step_equals_single_process_reference(launched, name):
    out = launched(name)
    world, pp, _ = CASES[name]
    ref_grads, ref_loss = reference(pp, case_lengths(name))
    seen = set()
    for rank in range(world):
        got = torch.load(out / f"{name}_rank{rank}.pt")
        if got["loss"] is not None:
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-5)
        for key, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref_grads[key], rtol=1e-5, atol=1e-6, msg=f"{name}: grad of {key}")
            seen.add(key)
    assert seen == set(ref_grads), f"{name}: parameters without a checked gradient: {set(ref_grads) - seen}"


# The simulator's per-stage activation peak (planner cost model, activation terms fitted to the
# runtime on single whole sequences and bare attention segments) against the exact count of a
# pipelined step: of split, hybrid and packed chunks (DPP's plan), and of a static packed plan
# with uniform recompute. The tolerance is the model's stated error, which planners keep free.
MEMORY_TOLERANCE = ACTIVATION_ERROR


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in CASES if CASES[n][2] in METERED]
)
def test_simulated_activation_peak_matches_the_exact_count(launched, name):
    out = launched(name)
    for rank in range(CASES[name][0]):
        got = torch.load(out / f"{name}_rank{rank}.pt")
        assert got["predicted_act_bytes"] == pytest.approx(got["measured_act_bytes"], rel=MEMORY_TOLERANCE), f"stage of rank {rank}"
