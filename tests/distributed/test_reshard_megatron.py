"""The Virtual Parameter Space against real megatron: pieces computed in one process, without the
ranks, equal what real models and distributed optimizers report inside a 4-rank gloo world.

Each worker builds, layout after layout, the trainer's own model, DDP and DistributedOptimizer,
and reports for every tensor it holds: the box (megatron's sharded state dict), where it sits in
its parameter, and the flat range megatron's optimizer gave this rank. It also reports its
megatron coordinates, and the pieces the VPS computes for another layout while this one is live
(the ambient parallel state must not leak into the VPS).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import pytest

from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.parallel.layout import ParallelLayout as L
from megatron_ext.reshard.vps import rank_pieces

WORLD = 4
TINY = dataclasses.replace(MODEL_PRESETS["llama_tiny"], vocab_size=256)
MOE = dataclasses.replace(MODEL_PRESETS["llama_moe_tiny"], vocab_size=256)
# (model, layout) pairs the 4 ranks build in turn: both ends of tp1->tp2 and tp2pp2->pp2dp2,
# interleaved pipeline, context parallelism, and experts (with expert-TP = TP, and over CP).
LAYOUTS = [
    (TINY, L(dp=4)),
    (TINY, L(tp=2, dp=2)),
    (TINY, L(tp=2, pp=2)),
    (TINY, L(pp=2, dp=2)),
    (TINY, L(pp=2, vpp=2, dp=2)),
    (TINY, L(cp=2, dp=2)),
    (MOE, L(dp=4, ep=2)),
    (MOE, L(tp=2, dp=2, ep=2)),
    (MOE, L(cp=2, dp=2, ep=4)),
]
# While (TINY, tp2·pp2) is live, each rank also computes its VPS pieces for this layout.
PROBE = (2, L(pp=2, dp=2))
# Adam's two moments share their boxes; fp32 models have no separate main params.
STATES = ("param", "exp_avg")


def rows(pieces) -> list:
    """Pieces as JSON-comparable rows, whichever side of the process boundary they come from."""
    kept = [p for p in pieces if p.state in STATES]
    fields = [[p.name.key, p.name.index, p.state, p.box, p.chunk, p.param, p.offset] for p in kept]
    return sorted(json.loads(json.dumps(fields)))


# --- the worker: one rank of a torchrun world ------------------------------------------------


def real_pieces(trainer) -> list:
    from megatron.core.utils import unwrap_model

    from megatron_ext.models.logical import local_box, local_shards
    from megatron_ext.reshard.boxes import flat_range_boxes, numel
    from megatron_ext.reshard.vps import Piece, tensor_holder

    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    found = []
    for i, chunk in enumerate(trainer.model):
        module = unwrap_model(chunk)
        tensors = [*module.named_parameters(), *module.named_buffers()]
        for name, shape, sh in local_shards([chunk]):
            param, tensor, start = tensor_holder(tensors, sh.data)
            box = tuple((s.start, s.stop) for s in local_box(sh))
            found.append(Piece(0, name, "param", box, tuple(shape), "", i, param, start))
            for opt in optimizers:
                if tensor not in opt.model_param_gbuf_map:
                    continue
                owned = opt._get_model_param_range_map(tensor)["param"]  # megatron's own
                a, b = owned.start, owned.end
                lo, hi = max(a, start), min(b, start + numel(box))
                for sub, pos in flat_range_boxes(box, lo - start, hi - start):
                    offset = start + pos - a
                    found.append(Piece(0, name, "exp_avg", sub, tuple(shape), "", i, param, offset))
    return rows(found)


def coords() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp_cp": ps.get_data_parallel_rank(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
    }


def every_layout(world: int) -> list:
    """Every (model, layout) of exactly `world` ranks that the runtime accepts: tp, pp (even, or
    uneven with a smaller first stage), vpp, cp, dp and, for the MoE model, ep."""
    found = []
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for model in (TINY, MOE):
        for tp, pp, cp in itertools.product(divisors, repeat=3):
            if world % (tp * pp * cp):
                continue
            dp = world // (tp * pp * cp)
            firsts = [None] if model.num_layers % pp == 0 else list(range(1, model.num_layers))
            for first in firsts:
                for vpp in (None, 2) if pp > 1 else (None,):
                    for ep in ([1] if model is TINY else [d for d in divisors if (dp * cp) % d == 0 and d > 1]):
                        layout = L(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp, first_stage_layers=first)
                        if not layout.violations(model):
                            found.append((model, layout))
    return found


def worker(out_dir: str, world_layouts: str = "") -> None:
    import torch.distributed as dist

    from megatron_ext.config.schema import Config, TrainConfig
    from megatron_ext.platform import cpu_compat
    from megatron_ext.training.trainer import Trainer

    cpu_compat.apply()
    dist.init_process_group("gloo")
    rank, report = dist.get_rank(), []
    layouts = every_layout(dist.get_world_size()) if world_layouts else LAYOUTS
    for i, (model, layout) in enumerate(layouts):
        # One micro-batch per DP rank, so that any dp divides the global batch.
        train = TrainConfig(global_batch_size=None)
        trainer = Trainer(Config(model=model, parallel=layout.to_config(), train=train))
        trainer._init_layout()
        trainer.vocab_size = model.vocab_size
        trainer.model, trainer.model_config = trainer.build_model(trainer.cfg.parallel)
        trainer.optimizer = trainer.build_optimizer(trainer.model, trainer.model_config, trainer.cfg.parallel)
        entry = {"coords": coords(), "pieces": real_pieces(trainer)}
        if i == PROBE[0]:
            entry["probe"] = rows(rank_pieces(model, PROBE[1], rank))
        report.append(entry)
        trainer.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(*sys.argv[1:])


# --- the test --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list:
    from _torchrun import rank_reports, torchrun

    out = tmp_path_factory.mktemp("reshard_real")
    torchrun(__file__, WORLD, str(out))
    return rank_reports(out, WORLD)


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[str(layout) for _, layout in LAYOUTS])
def test_vps_pieces_equal_real_megatron(reports, index):
    model, layout = LAYOUTS[index]
    for rank in range(WORLD):
        real = reports[rank][index]
        assert layout.rank_coords(rank) == real["coords"]
        assert rows(rank_pieces(model, layout, rank)) == real["pieces"]


@pytest.mark.distributed
def test_vps_does_not_depend_on_the_live_parallel_state(reports):
    model, live = LAYOUTS[PROBE[0]]
    for rank in range(WORLD):
        assert reports[rank][PROBE[0]]["probe"] == rows(rank_pieces(model, PROBE[1], rank))


@pytest.mark.slow  # 6 and 8 gloo ranks on a 2-core machine, every layout: minutes
@pytest.mark.distributed
@pytest.mark.parametrize("world", [6, 8])
def test_vps_pieces_equal_real_megatron_for_every_layout(tmp_path, world):
    from _torchrun import rank_reports, torchrun

    torchrun(__file__, world, str(tmp_path), "every", timeout=1800)
    reports = rank_reports(tmp_path, world)
    layouts = every_layout(world)
    assert len(layouts) >= 8  # the enumeration itself is exercised, not empty
    for index, (model, layout) in enumerate(layouts):
        for rank in range(world):
            real = reports[rank][index]
            assert layout.rank_coords(rank) == real["coords"], (str(layout), rank)
            assert rows(rank_pieces(model, layout, rank)) == real["pieces"], (str(layout), rank)
