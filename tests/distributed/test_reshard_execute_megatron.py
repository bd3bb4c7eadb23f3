"""The executor in a 4-rank gloo world: every destination element ends up with the value the
logical tensor has there.

Each state element gets a value computed from its logical coordinates (tensor, state, flat
index in the logical tensor), so the expected destination is known without a reference run.

  - Plain tensors: each rank's source pieces as tensors in a dict, moved by `execute` into
    NaN-filled destination pieces, as point-to-point messages and through shared memory,
    under small budgets (hundreds of rounds as messages, tens through shared memory) and an
    unlimited one (one round); fp32 and bf16
    (mixed dtypes in one packed buffer), a growing and a shrinking world, experts, and a plan
    run on a sub-group (plan rank r = group rank r). The staging each rank used equals
    `peak_bytes` (messages) or its largest round of sends (shared memory), and the plan and
    rounds hash the same on every rank.
  - Megatron: the trainer's own model, DDP and DistributedOptimizer, built layout after layout
    in the same processes (tp2·pp2 -> pp2·dp2 -> tp2·dp2 -> dp4 -> back to tp2·pp2; and
    tp2·pp2 -> pp2·dp2 in bf16, with fp32 main params), each destination poisoned with NaN
    before `execute` moves params, main params, exp_avg, exp_avg_sq and step into it through
    `MegatronState`. Values are written and checked through megatron's own metadata (sharded
    state dict boxes, the optimizer's param ranges), not through the VPS pieces the executor
    uses, and the check must see the poison before the transfer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import zlib
from pathlib import Path

import pytest

from megatron_ext.parallel.layout import ParallelLayout as L

WORLD = 4
SMALL_BUDGET = 16 << 10
# Each transport under a budget that makes many rounds, and under one that makes one round.
# Shared memory pays two barriers a round: tens of rounds (its arenas reused) rather than hundreds.
BUDGETS = {"messages": (SMALL_BUDGET, 1 << 40), "shared memory": (64 << 10, 1 << 40)}
SUBGROUP = [1, 2, 3]
STEP_VALUE = 7.0


def preset(name: str, **changes):
    """A preset model with the run's padded vocabulary fixed (divisible by every tp used)."""
    from megatron_ext.config.store import MODEL_PRESETS

    return dataclasses.replace(MODEL_PRESETS[name], vocab_size=256, **changes)


def cases():
    """name -> (model, layout A, layout B), plain-tensor transfers. (fp32 tp2·pp2 -> pp2·dp2
    is the megatron chain's first step.)"""
    return {
        "tp2pp2->pp2dp2 bf16": (preset("llama_tiny", precision="bf16"), L(tp=2, pp=2), L(pp=2, dp=2)),
        "dp2->dp4 (world grows)": (preset("llama_tiny"), L(dp=2), L(dp=4)),
        "tp2dp2->tp2 (world shrinks, gqa)": (preset("llama_tiny_gqa"), L(tp=2, dp=2), L(tp=2)),
        "ep2dp4->ep2tp2dp2 (moe)": (preset("llama_moe_tiny"), L(dp=4, ep=2), L(tp=2, dp=2, ep=2)),
    }


# The trainer's layouts, in turn: each is the destination of the previous one.
CHAIN = [L(tp=2, pp=2), L(pp=2, dp=2), L(tp=2, dp=2), L(dp=4), L(tp=2, pp=2)]


# --- logical values ----------------------------------------------------------------------------


def logical(name, state: str, shape, dtype):
    """The whole logical tensor of (name, state): distinct integers, exact in `dtype`."""
    import torch

    if state == "step":
        return torch.full(tuple(shape), STEP_VALUE, dtype=dtype)
    seed = zlib.crc32(repr((name.key, name.index, state)).encode())
    span = 256 if dtype == torch.bfloat16 else 1 << 24
    count = int(torch.Size(shape).numel())
    return ((seed + torch.arange(count, dtype=torch.int64)) % span).to(dtype).view(tuple(shape))


def box_values(piece, box=None):
    import torch

    full = logical(piece.name, piece.state, piece.shape, getattr(torch, piece.dtype))
    return full[tuple(slice(a, b) for a, b in (box or piece.box))]


# --- plain tensors ------------------------------------------------------------------------------


def run_plain() -> dict:
    import torch.distributed as dist

    from megatron_ext.reshard.plan import plan

    report = {}
    for name, (model, a, b) in cases().items():
        p = plan(model, a, b)
        for route, budgets in BUDGETS.items():
            for budget in budgets:
                report[f"{name} @{budget} {route}"] = transfer(p, budget, route)
    # One rank cannot create its shared-memory arena: every rank sends messages instead.
    from megatron_ext.reshard import transport

    model, a, b = cases()["dp2->dp4 (world grows)"]
    shm_dir = transport.SHM_DIR
    if dist.get_rank() == 1:
        transport.SHM_DIR = Path("/nonexistent")
    report["dp2->dp4, rank 1 without /dev/shm: messages"] = transfer(plan(model, a, b), 1 << 40, "shared memory")
    transport.SHM_DIR = shm_dir
    # Plan ranks 0, 1, 2 are world ranks 1, 2, 3; world rank 0 takes no part.
    group = dist.new_group(SUBGROUP)
    model, a, b = preset("llama_tiny"), L(dp=3), L(tp=2)
    if dist.get_rank() in SUBGROUP:
        for route, (budget, _) in BUDGETS.items():
            name = f"dp3->tp2 (world shrinks) on world ranks 1-3 {route}"
            report[name] = transfer(plan(model, a, b), budget, route, group)
    return report


def transfer(p, budget: int, transport: str, group=None) -> dict:
    """Plain tensors holding each piece's logical values, moved by `execute` into NaN-filled
    destination pieces: what arrived wrong, the staging used and predicted, the round count."""
    import torch
    import torch.distributed as dist

    from megatron_ext.reshard.boxes import box_shape
    from megatron_ext.reshard.execute import execute, peak_bytes, rounds

    rank, steps = dist.get_rank(group), rounds(p, budget)
    have = {s: box_values(s).clone() for s in p.sources if s.rank == rank}
    want = {
        t: torch.full(box_shape(t.box), float("nan"), dtype=getattr(torch, t.dtype))
        for t in p.targets
        if t.rank == rank
    }

    def read(piece, box):
        return have[piece][_relative(piece.box, box)]

    def write(piece, box, values):
        want[piece][_relative(piece.box, box)].copy_(values)

    executed = execute(p, steps, read, write, group, shared_memory=transport == "shared memory")
    wrong = [
        f"{t.name.key}{list(t.name.index)} {t.state} {t.box}"
        for t, values in want.items()
        if not torch.equal(values, box_values(t))
    ]
    fingerprint = hashlib.sha256(repr((p.digest, steps)).encode()).hexdigest()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, fingerprint, group=group)
    return {
        "rounds": len(steps),
        "wrong": wrong[:5],
        "staged": executed.staged_bytes,
        "transport": executed.transport,
        "predicted": peak_bytes(p, steps)[rank],
        # shared memory stages only what a rank sends: its arena holds its largest round's sends
        "predicted_sent": max((step.sent(rank) for step in steps), default=0),
        "same_plan_everywhere": len(set(everyone)) == 1,
    }


def _relative(outer, box):
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, outer))


# --- megatron -----------------------------------------------------------------------------------


def build(model, layout):
    from megatron_ext.config.schema import Config
    from megatron_ext.training.trainer import Trainer

    trainer = Trainer(Config(model=model, parallel=layout.to_config()))
    trainer._init_layout()
    trainer.vocab_size = model.vocab_size
    trainer.model, trainer.model_config = trainer.build_model(trainer.cfg.parallel)
    trainer.optimizer = trainer.build_optimizer(trainer.model, trainer.model_config, trainer.cfg.parallel)
    return trainer


def megatron_tensors(trainer):
    """(chunk, parameter name) -> (tensor, its optimizer or None, [(logical name, shape, box,
    flat start)] of its shards) from megatron's sharded state dict."""
    from megatron.core.utils import unwrap_model

    from megatron_ext.models.logical import local_box, local_shards
    from megatron_ext.reshard.vps import tensor_holder

    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    found = {}
    for i, chunk in enumerate(trainer.model):
        module = unwrap_model(chunk)
        tensors = [*module.named_parameters(), *module.named_buffers()]
        for name, shape, sh in local_shards([chunk]):
            param, tensor, start = tensor_holder(tensors, sh.data)
            opt = next((o for o in optimizers if tensor in o.model_param_gbuf_map), None)
            entry = found.setdefault((i, param), (tensor, opt, []))
            entry[2].append((name, shape, local_box(sh), start))
    return found


def expected(tensor, shards, state: str, dtype):
    """What `tensor` (its TP shard, flattened) should hold for `state`: NaN where no shard is."""
    import torch

    out = torch.full((tensor.numel(),), float("nan"), dtype=dtype)
    for name, shape, box, start in shards:
        values = logical(name, state, shape, dtype)[box].reshape(-1)
        out[start : start + values.numel()] = values
    return out


def states_of(tensor, opt) -> dict:
    """state -> (megatron's tensor, the flat range of the parameter it holds). fp32 models'
    main params are views of the params; others have their own fp32 copy."""
    import torch

    found = {"param": (tensor.detach().view(-1), (0, tensor.numel()))}
    if opt is not None:
        owned = opt._get_model_param_range_map(tensor)["param"]
        moments = opt._get_main_param_and_optimizer_states(tensor)
        kinds = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
        if tensor.dtype != torch.float32:
            kinds["main_param"] = "param"
        for state, key in kinds.items():
            found[state] = (moments[key].view(-1), (owned.start, owned.end))
    return found


def set_logical(trainer, poison: bool) -> None:
    """Every param and Adam moment to its logical value (or NaN), every step to 7 (or -1)."""
    for tensor, opt, shards in megatron_tensors(trainer).values():
        for state, (local, (a, b)) in states_of(tensor, opt).items():
            if poison:
                local.fill_(float("nan"))
            else:
                local.copy_(expected(tensor, shards, state, local.dtype)[a:b])
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in opt.optimizer.state.values():
            state["step"].fill_(-1.0 if poison else STEP_VALUE)


def mismatches(trainer) -> list:
    """What differs from the logical values, and any parameter that has no shard to check."""
    import torch
    from megatron.core.utils import unwrap_model

    found = megatron_tensors(trainer)
    wrong = [
        f"chunk {i} {name} unchecked"
        for i, chunk in enumerate(trainer.model)
        for name, _ in unwrap_model(chunk).named_parameters()
        if (i, name) not in found
    ]
    for (chunk, param), (tensor, opt, shards) in found.items():
        for state, (local, (a, b)) in states_of(tensor, opt).items():
            if not torch.equal(local, expected(tensor, shards, state, local.dtype)[a:b]):
                wrong.append(f"chunk {chunk} {param} {state}")
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        if any(float(s["step"]) != STEP_VALUE for s in opt.optimizer.state.values()):
            wrong.append("step")
    return wrong


def run_megatron(model, chain: list) -> dict:
    """Layout after layout of `chain`: transition -> the mismatches before and after."""
    from megatron_ext.reshard.execute import execute, rounds
    from megatron_ext.reshard.plan import plan
    from megatron_ext.reshard.state_access import MegatronState, ensure_optimizer_states

    source = build(model, chain[0])
    ensure_optimizer_states(source.optimizer)
    set_logical(source, poison=False)
    report = {}
    for a, b in zip(chain, chain[1:]):
        source_state = MegatronState(source.model, source.optimizer)
        source.close()  # megatron's parallel state of A goes; its tensors stay
        target = build(model, b)
        ensure_optimizer_states(target.optimizer)
        set_logical(target, poison=True)
        poisoned = len(mismatches(target))
        p = plan(model, a, b)
        target_state = MegatronState(target.model, target.optimizer)
        execute(p, rounds(p, SMALL_BUDGET), source_state.read, target_state.write)
        report[f"{a} -> {b}"] = {"before": poisoned, "after": mismatches(target)[:5]}
        source = target
    source.close()
    return report


def worker(out_dir: str) -> None:
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.platform import cpu_compat

    cpu_compat.apply()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    start = time.perf_counter()
    parallel_state.initialize_model_parallel()  # the planner runs inside a job's parallel state
    plain = run_plain()
    parallel_state.destroy_model_parallel()
    middle = time.perf_counter()
    report = {
        "plain": plain,
        "megatron": run_megatron(preset("llama_tiny"), CHAIN),
        "megatron bf16": run_megatron(preset("llama_tiny", precision="bf16"), CHAIN[:2]),
    }
    report["seconds"] = [middle - start, time.perf_counter() - middle]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])


# --- the test ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list:
    from _torchrun import rank_reports, torchrun

    out = tmp_path_factory.mktemp("reshard_execute")
    torchrun(__file__, WORLD, str(out))
    return rank_reports(out, WORLD)


@pytest.mark.distributed
def test_plain_tensors_arrive_exactly_with_the_predicted_staging(reports):
    for rank, report in enumerate(reports):
        for name, result in report["plain"].items():
            assert result["wrong"] == [], (rank, name)
            assert name.endswith(result["transport"]), (rank, name)  # no silent fallback
            if result["transport"] == "messages":
                assert result["staged"] == result["predicted"], (rank, name)
            else:
                assert result["staged"] == result["predicted_sent"] <= result["predicted"], (rank, name)
            assert result["same_plan_everywhere"], name
    assert [any("world ranks 1-3" in name for name in r["plain"]) for r in reports] == [
        rank in SUBGROUP for rank in range(WORLD)
    ]
    small = [r for name, r in reports[0]["plain"].items() if f"@{SMALL_BUDGET} " in name]
    assert min(r["rounds"] for r in small) > 50  # the small budget really makes many rounds


@pytest.mark.distributed
def test_megatron_states_move_exactly_through_a_chain_of_layouts(reports):
    for rank, report in enumerate(reports):
        assert len(report["megatron"]) == len(CHAIN) - 1 and len(report["megatron bf16"]) == 1
        for transition, result in [*report["megatron"].items(), *report["megatron bf16"].items()]:
            assert result["before"] > 0, (rank, transition)  # the check sees the poison
            assert result["after"] == [], (rank, transition)
