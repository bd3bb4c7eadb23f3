"""A live reshard leaves exactly the state a checkpoint save in layout A and a load in B leave.

One 4-rank gloo world runs the cases one after another (dense fp32, context parallelism, dense
bf16 with separate fp32 main params, interleaved pipeline, MoE across an expert-parallel change). Each case trains
a few steps in A, so that params, main params and Adam moments are non-trivial, saves a
checkpoint, then reshards live and compares, rank by rank and bitwise (torch.equal on the raw
bytes), every tensor megatron holds: params, the DistributedOptimizer's main param, exp_avg,
exp_avg_sq and step, plus the scheduler state, the optimizer's lr and the iteration and
consumed-samples counters.

  - Against the checkpoint route: a fresh trainer in B, its every tensor poisoned (NaN, step -1),
    loads the checkpoint through the trainer's own resume code. The poisoned state must differ
    from the live one in every entry (so the comparison sees what the load did not write), the
    loaded state must equal the live one.
  - Round trip: A -> B -> A returns the state of A, and A -> B -> A -> B the state of the first
    B. The moves to B install a layout built beforehand in the background (`LayoutController.prepare`), while
    A trained a step; the move back to A builds it at the switch: both ways are checked. Two training steps change every entry of A's state, so a reshard that left any tensor as
    a freshly built layout holds it (zero moments, step 0, initial weights) would fail.
  - Loss: the live run and the checkpoint run then train on, with bitwise equal losses. This
    also sees what the state leaves out, e.g. how the new model marks its tensor-parallel
    params for the grad norm.
  - MoE: every expert's weight, main param and moments, assembled per (layer, GLOBAL expert id =
    ep rank x local experts + local index) from all ranks, are the same before and after EP2 ->
    EP4, where ranks change which experts they hold; distinct experts differ, so a permutation
    of experts would fail.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from megatron_ext.config.schema import ParallelConfig as P

WORLD = 4
STEPS_BEFORE = 2
STEPS_AFTER = 2
BUDGET_MB = 1.0  # 4 to 9 transfer rounds per reshard
MOE_CASE = "moe ep2dp4->ep4dp4"
FIRST_FC1 = (0, "linear_fc1.weight", "param")  # (layer, expert param, state) told apart per expert
# name -> (model preset, precision, layout A, layout B)
CASES = {
    "tp2pp2->dp4": ("llama_tiny", "fp32", P(tp=2, pp=2), P(dp=4)),
    "tp2dp2->cp2dp2": ("llama_tiny", "fp32", P(tp=2, dp=2), P(cp=2, dp=2)),
    "tp2pp2->pp2dp2 bf16": ("llama_tiny", "bf16", P(tp=2, pp=2), P(pp=2, dp=2)),
    "pp2vpp2dp2->tp2dp2": ("llama_tiny", "fp32", P(pp=2, vpp=2, dp=2), P(tp=2, dp=2)),
    MOE_CASE: ("llama_moe_tiny", "fp32", P(ep=2), P(ep=4)),
}


# --- the worker: one rank of a torchrun world ------------------------------------------------


def config(case: str, cache: str, ckpt: str):
    from megatron_ext.config.schema import CheckpointConfig, Config, DataConfig, TrainConfig
    from megatron_ext.config.store import MODEL_PRESETS

    preset, precision, a, _ = CASES[case]
    return Config(
        model=dataclasses.replace(MODEL_PRESETS[preset], seq_length=64, precision=precision),
        parallel=a,
        data=DataConfig(cache_dir=cache),
        train=TrainConfig(iters=20, micro_batch_size=2, global_batch_size=8, eval_interval=0),
        checkpoint=CheckpointConfig(save=ckpt),
    )


def started(cfg):
    from megatron_ext.reshard.state_access import ensure_optimizer_states
    from megatron_ext.training.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.setup()
    ensure_optimizer_states(trainer.optimizer)  # every entry exists before the first step
    return trainer


def optimizers(trainer) -> list:
    return getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])


def local_states(trainer):
    """("chunk.name", param, {state: this rank's tensor}) for every parameter of this rank: the
    param itself and megatron's DistributedOptimizer entries of its local shard, if any."""
    from megatron.core.utils import unwrap_model

    for i, chunk in enumerate(trainer.model):
        for name, param in unwrap_model(chunk).named_parameters():
            states = {"param": param}
            for opt in optimizers(trainer):
                if param in opt.model_param_group_index_map:
                    main = opt._get_main_param_and_optimizer_states(param)
                    states.update({f"main {k}" if k == "param" else k: v for k, v in main.items()})
            yield f"{i}.{name}", param, states


def snapshot(trainer) -> dict:
    """Everything of this rank's training state, keyed by where it lives in this layout."""
    found = {
        f"{name} {state}": tensor.detach().clone()
        for name, _, states in local_states(trainer)
        for state, tensor in states.items()
    }
    found["scheduler"] = trainer.scheduler.state_dict()
    found["lr"] = [group["lr"] for group in trainer.optimizer.param_groups]
    found["counters"] = [trainer.state.iteration, trainer.state.consumed_samples]
    return found


def bits(tensor):
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def same(x, y) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
    return x == y


def differences(x: dict, y: dict) -> list:
    """The entries of two snapshots that differ bitwise (or exist in one only)."""
    return sorted(k for k in x.keys() | y.keys() if k not in x or k not in y or not same(x[k], y[k]))


def poison(trainer) -> None:
    """NaN into every param, main param and moment of this rank, -1 into every step."""
    for _, _, states in local_states(trainer):
        for state, tensor in states.items():
            tensor.detach().fill_(-1.0 if state == "step" else float("nan"))


def train(trainer) -> list:
    return [trainer.train_step_with_loss()["loss"] for _ in range(STEPS_AFTER)]


def through_checkpoint(cfg, target) -> tuple:
    """The checkpoint route: a fresh trainer in `target`, poisoned, then resumed from the
    checkpoint as `Trainer.setup` resumes (load, then data from the consumed samples)."""
    from megatron_ext.checkpointing import torch_dist as ckpt

    trainer = started(dataclasses.replace(cfg, parallel=target))
    poison(trainer)
    poisoned = snapshot(trainer)
    root = cfg.checkpoint.save
    trainer._load(root, STEPS_BEFORE, ckpt.load_common(root, STEPS_BEFORE))
    trainer._build_data()
    loaded = snapshot(trainer)
    losses = train(trainer)
    trainer.close()
    return poisoned, loaded, losses


def expert_pieces(trainer) -> list:
    """((layer, global expert, param, state), flat start, values) of this rank's expert shards."""
    import re

    from megatron.core import parallel_state

    local = trainer.cfg.model.num_experts // parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * local
    pieces = []
    for name, param, states in local_states(trainer):
        m = re.fullmatch(r"0\.decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)", name)
        if m is None:
            continue
        key = (int(m[1]), first + int(m[2]), m[3])
        for state, tensor in states.items():
            if state != "step":  # one counter for all parameters: compared in every case
                start = 0 if state == "param" else shard_start(trainer, param)
                pieces.append(((*key, state), start, tensor.detach().reshape(-1).clone()))
    return pieces


def shard_start(trainer, param) -> int:
    """Where this rank's optimizer shard begins in the flattened parameter (megatron's range)."""
    opt = next(o for o in optimizers(trainer) if param in o.model_param_gbuf_map)
    return opt._get_model_param_range_map(param)["param"].start


def experts_by_global_id(trainer):
    """On rank 0: every expert state assembled whole from all ranks' pieces, keyed by global
    expert id, and the pieces that disagreed where they overlap; None on the other ranks."""
    import torch
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(expert_pieces(trainer), gathered, dst=0)
    if gathered is None:
        return None
    pieces = [piece for rank in gathered for piece in rank]
    numel = {key[:3]: values.numel() for key, _, values in pieces if key[3] == "param"}
    whole, conflicts = {}, []
    for key, start, values in pieces:
        full = whole.setdefault(key, torch.full((numel[key[:3]],), float("nan"), dtype=values.dtype))
        region = full[start : start + values.numel()]
        if not (region.isnan().all() or same(region, values)):
            conflicts.append(str(key))
        region.copy_(values)
    return whole, conflicts


def expert_check(before, after) -> dict:
    """Rank 0's assembled expert states before and after the reshard, compared."""
    (x, conflicts_x), (y, conflicts_y) = before, after
    fc1 = [v for (layer, _, name, state), v in x.items() if (layer, name, state) == FIRST_FC1]
    return {
        "entries": len(x),
        "holes": [str(k) for k, v in [*x.items(), *y.items()] if v.isnan().any()],
        "conflicts": conflicts_x + conflicts_y,
        "differ": [str(k) for k in differences(x, y)],
        "distinct experts in layer 0": len({bytes(bits(w).numpy()) for w in fc1}),
    }


def busy_until_prepared(prepared) -> None:
    """Collectives on the default group in this thread until every rank's background
    preparation is done, as a running job's own collectives would be (checkpoint saves,
    loss logging): they must not pair up with the preparation's."""
    import torch
    import torch.distributed as dist

    while True:
        done = torch.tensor([int(prepared.done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        dist.all_gather_object([None] * dist.get_world_size(), dist.get_rank())
        if done.item():
            return


def refusal_of_different_plans(trainer, target) -> str:
    """What reshard says when rank 1 plans the move with another memory budget (other rounds)
    than the others."""
    import torch.distributed as dist

    from megatron_ext.reshard.live import reshard

    try:
        reshard(trainer, target, BUDGET_MB * (4 if dist.get_rank() == 1 else 1))
    except ValueError as e:
        return str(e)
    return "not refused"


def run_case(case: str, cache: str, ckpt: str) -> dict:
    from megatron_ext.reshard.live import prepare, reshard

    cfg = config(case, cache, ckpt)
    _, _, a, b = CASES[case]
    moe = case == MOE_CASE
    trainer = started(cfg)
    initial = snapshot(trainer)
    for _ in range(STEPS_BEFORE - 1):
        trainer.train_step()
    prepared = prepare(trainer, b, BUDGET_MB)  # B is built beside A while A trains a step
    trainer.train_step()
    busy_until_prepared(prepared)
    in_a = snapshot(trainer)
    trainer.save()
    experts_a = experts_by_global_id(trainer) if moe else None
    refused = refusal_of_different_plans(trainer, b)
    refused_kept = differences(in_a, snapshot(trainer))
    reshard(trainer, b, BUDGET_MB, prepared)
    live = snapshot(trainer)
    experts_b = experts_by_global_id(trainer) if moe else None
    reshard(trainer, a, BUDGET_MB)  # A built at the switch
    back = snapshot(trainer)
    reshard(trainer, b, BUDGET_MB, prepare(trainer, b, BUDGET_MB))
    again = snapshot(trainer)
    live_losses = train(trainer)
    trainer.close()
    poisoned, loaded, checkpoint_losses = through_checkpoint(cfg, b)
    return {
        "prebuilt": prepared.result().prebuilt is not None and prepared.result().prebuilt.installed,
        "entries in A": len(in_a),
        "trained differ": len(differences(initial, in_a)),
        "entries in B": len(live),
        "poisoned differ": len(differences(poisoned, live)),
        "live vs checkpoint": differences(live, loaded),
        "a->b->a": differences(in_a, back),
        "a->b->a->b": differences(live, again),
        "losses": [live_losses, checkpoint_losses],
        "experts": expert_check(experts_a, experts_b) if experts_a else None,
        "refused": refused,
        "refused kept": refused_kept,
    }


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    cache = str(Path(out_dir, "cache"))
    report = {case: run_case(case, cache, str(Path(out_dir, f"ckpt{i}"))) for i, case in enumerate(CASES)}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])


# --- the tests -----------------------------------------------------------------------------------

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list:
    from _torchrun import rank_reports, torchrun

    out = tmp_path_factory.mktemp("reshard_exact")
    torchrun(__file__, WORLD, str(out))
    return rank_reports(out, WORLD)


def each(reports):
    for rank, report in enumerate(reports):
        for case in CASES:
            yield (rank, case), report[case]


def test_live_reshard_equals_checkpoint_route_bitwise(reports):
    for where, r in each(reports):
        assert r["prebuilt"], where  # the first move installed a layout built in the background
        assert r["poisoned differ"] == r["entries in B"], where  # the check sees an unwritten entry
        assert r["live vs checkpoint"] == [], where


def test_ranks_that_planned_different_moves_are_refused_before_anything_moves(reports):
    for where, r in each(reports):
        assert "the ranks planned different moves" in r["refused"], where
        assert r["refused kept"] == [], where


def test_round_trip_returns_the_original_state_bitwise(reports):
    for where, r in each(reports):
        assert r["trained differ"] == r["entries in A"], where  # training moved every entry
        assert r["a->b->a"] == [], where
        assert r["a->b->a->b"] == [], where


def test_live_and_checkpoint_runs_train_on_with_equal_losses(reports):
    for where, r in each(reports):
        live, checkpoint = r["losses"]
        assert len(live) == STEPS_AFTER and len(set(live)) == STEPS_AFTER, where
        assert live == checkpoint, where  # exact float equality


def test_experts_keep_their_state_by_global_id(reports):
    r = reports[0][MOE_CASE]["experts"]
    assert r["distinct experts in layer 0"] == 4  # so a permutation of experts would show
    assert r["entries"] > 0 and r["holes"] == [] and r["conflicts"] == []
    assert r["differ"] == []
