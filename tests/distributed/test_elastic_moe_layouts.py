"""The elastic MoE axes (expert count, expert FFN width) under tensor parallelism (TP=2 with
sequence parallelism, megatron-core 0.16's only MoE-under-TP layout) and expert parallelism (EP=2
over two data-parallel replicas) are the one-process axes: the same importance orders, and at
every budget the same logits as the one-process elastic model, which equals the sliced submodel
(`tests/unit/test_elastic_hybrid.py`), and the same reordered parent joined from the ranks (what
the nested checkpoint stores, every expert under its global index) to the bit.

The tiny hybrid MoE parent ("M*M-ME", 4 experts of FFN width 64, top-2) in fp64. The budgets cut
the experts to 3 (under EP rank 1 keeps one of its two experts) and to 2 (rank 1 keeps none: its
dispatcher must route it no token), and the expert FFN width to 48 and 16 (under TP rank 1 keeps
16 of its 32 neurons, or none). Under EP each replica calibrates on, and runs, its own half of
the batches (its experts see the other's tokens through the dispatcher), as one process runs all
of them; under TP both ranks run all.

Tolerance: fp64, runs that differ in summation order only (row-parallel outputs, the experts'
partial outputs reduce-scattered over TP, scores summed over ranks): logits measured 7e-16
relative apart under TP and equal to the bit under EP. Without the moves of experts between the
EP ranks the cut logits are 0.2 relative off; without REAP's sum of an expert's partial outputs
over TP, or without the hidden scores' sum over the sequence-parallel ranks, the orders differ;
without the routing's padding to the parent's expert count the EP run fails (all measured).

This file is also the worker script torchrun starts.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.unit.test_elastic_hybrid import BUDGETS, PARENT, VOCAB  # noqa: E402

BATCHES = [torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
POSITIONS = torch.arange(32)[None].expand(2, -1)
SIZES = [{"moe_experts": 3, "moe_ffn": 48}, {"moe_experts": 2, "moe_ffn": 16}, BUDGETS["75"], BUDGETS["50"]]
LAYOUTS = {"tp2_sp": {"tp": 2, "sequence_parallel": True}, "ep2": {"ep": 2}}
REL = 1e-10


def build(parallel: dict):
    from megatron_ext.config.schema import ParallelConfig
    from megatron_ext.models.hybrid import build_hybrid_model, hybrid_stack_spec, hybrid_transformer_config
    from megatron_ext.models.init import init_weights_layout_independent

    config = hybrid_transformer_config(PARENT, ParallelConfig(**parallel), on_cpu=True)
    # fp64 throughout: megatron sizes some buffers (the MoE router's) by params_dtype.
    config = dataclasses.replace(config, params_dtype=torch.float64, pipeline_dtype=torch.float64)
    model = build_hybrid_model(PARENT, config, hybrid_stack_spec(PARENT, on_cpu=True), VOCAB, True, True)
    init_weights_layout_independent([model], model.config, 0)
    return model.double().eval()


@torch.no_grad()
def elastic_run(parallel: dict) -> dict:
    """Calibrate on this replica's batches, reorder, and the logits of its batches at every
    size (whole vocabulary), in the current megatron world."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_ext.elastic.gather import whole_parent
    from megatron_ext.elastic.importance import calibrate
    from megatron_ext.elastic.permute import reorder
    from megatron_ext.elastic.space import ElasticSpace

    model = build(parallel)
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mine = BATCHES[rank::dp]
    space = ElasticSpace(model)
    calibrate(space.axes, mine, lambda t: model(t, POSITIONS, None), parallel_state.get_data_parallel_group())
    orders = reorder(space.axes)
    logits = {}
    for i, sizes in enumerate([space.full()] + SIZES):
        with space.at(sizes):
            logits[i] = [gather_from_tensor_model_parallel_region(model(t, POSITIONS, None)) for t in mine]
    # What the nested checkpoint stores (every budget is sliced out of it at TP=1).
    return {"orders": orders, "logits": logits, "parent": whole_parent(model)}


def worker(out: str, layout: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.platform.launch import join_world

    parallel = LAYOUTS[layout]
    join_world("cpu")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.get("tp", 1), expert_model_parallel_size=parallel.get("ep", 1)
    )
    model_parallel_cuda_manual_seed(0)
    try:
        torch.save(elastic_run(parallel), Path(out) / f"rank{dist.get_rank()}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(*sys.argv[1:])


@pytest.mark.slow  # two torchrun workers importing megatron on the shared cores
@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_axes_under_layout_equal_one_process(one_rank_world, tmp_path, layout):
    sys.path.insert(0, str(Path(__file__).parent))
    from _torchrun import torchrun

    torchrun(__file__, 2, str(tmp_path), layout, timeout=300)
    one_process = elastic_run({})
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    moved = [n for n, o in one_process["orders"].items() if n.startswith("moe") and o != sorted(o)]
    assert {n.split("/")[0] for n in moved} == {"moe_experts", "moe_ffn"}, "no MoE axis reordered: vacuous"
    for r in ranks:
        assert r["orders"] == one_process["orders"]
    # Under EP replica r ran batch r; under TP both ranks ran both.
    per_batch = {i: [r["logits"][i] for r in ranks] for i in one_process["logits"]}
    for i, want in one_process["logits"].items():
        got = [b for rank in per_batch[i] for b in rank] if layout == "ep2" else per_batch[i][0]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert float((g - w).abs().max()) <= REL * float(w.abs().max()), (layout, i)
    parent = ranks[0]["parent"]
    assert parent.keys() == one_process["parent"].keys() and any(".local_experts.3." in k for k in parent)
    for key, want in one_process["parent"].items():
        assert torch.equal(parent[key], want), key
    full, cut = one_process["logits"][0][0], one_process["logits"][2][0]
    assert not torch.allclose(full, cut, atol=1e-3), "the cut changed nothing: vacuous"
