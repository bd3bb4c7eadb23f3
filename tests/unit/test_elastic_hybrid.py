"""Elastic axes of the hybrid model (Mamba heads, Mamba head channels, MoE experts, expert FFN
width, plus attention heads, FFN and hidden on its single-sublayer layers), checked against the
parent and against standalone hybrid models built from the exported tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megatron_ext.elastic.hybrid_axes  # noqa: F401  (registers the hybrid layer adapters)
from megatron_ext.config.schema import ParallelConfig
from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.elastic import slicing
from megatron_ext.elastic.importance import calibrate
from megatron_ext.elastic.permute import reorder
from megatron_ext.elastic.slicing import sliced_state_dict
from megatron_ext.elastic.space import ElasticSpace
from megatron_ext.models.hybrid import build_hybrid_model, hybrid_stack_spec, hybrid_transformer_config
from megatron_ext.models.init import init_weights_layout_independent

PARENT = dataclasses.replace(
    MODEL_PRESETS["hybrid_tiny"], seq_length=32, init_method_std=0.1, head_dim=16, spec="local"
)
VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
POSITIONS = torch.arange(32)[None].expand(2, -1)
# Homogeneous budgets: every kind at one size (hybrid_tiny: hidden 64, 4 heads in 2 groups,
# FFN 128, 8 Mamba heads of 16 in 2 groups, 4 experts of width 64, top-2).
BUDGETS = {
    "75": {"hidden": 48, "heads": 4, "ffn": 96, "mamba_heads": 6, "mamba_head_dim": 12, "moe_experts": 3, "moe_ffn": 48},
    "50": {"hidden": 32, "heads": 2, "ffn": 64, "mamba_heads": 4, "mamba_head_dim": 8, "moe_experts": 2, "moe_ffn": 32},
}


def build(cfg=PARENT):
    config = hybrid_transformer_config(cfg, ParallelConfig(), on_cpu=True)
    model = build_hybrid_model(cfg, config, hybrid_stack_spec(cfg, on_cpu=True), VOCAB, True, True)
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS, POSITIONS, None)


@pytest.fixture
def parent(one_rank_world):
    model = build()
    init_weights_layout_independent([model], model.config, 0)
    return model


def test_attached_full_width_is_the_parent_bitwise(parent):
    before = logits(parent)
    space = ElasticSpace(parent)
    assert {"mamba_heads", "mamba_head_dim", "moe_experts", "moe_ffn", "heads", "ffn"} <= set(space.kinds)
    assert torch.equal(logits(parent), before)


def export(parent, space, sizes):
    """The standalone hybrid submodel at `sizes` from the elastic parent's sliced tensors."""
    with space.at(sizes):
        state = sliced_state_dict(parent)
        experts = space.by_name["moe_experts/5"].dropped_experts()
    state = {k: v for k, v in state.items() if not any(f"local_experts.{j}." in k for j in experts)}
    sub_cfg = dataclasses.replace(PARENT, **space.export_fields(sizes))
    sub = build(sub_cfg)
    sub.load_state_dict(state, strict=True)
    return sub, sub_cfg


def reordered(parent) -> tuple[ElasticSpace, dict]:
    """The parent's space after calibration and the one-time reorder, and the orders applied."""
    space = ElasticSpace(parent)
    calibrate(space.axes, [TOKENS], lambda t: parent(t, POSITIONS, None))
    return space, reorder(space.axes)


def test_reorder_keeps_logits_and_every_budget_exports_exactly(parent):
    before = logits(parent)
    space, orders = reordered(parent)
    moved = {space.by_name[n].kind for n, o in orders.items() if o != sorted(o)}
    assert {"mamba_heads", "mamba_head_dim", "moe_experts", "moe_ffn"} <= moved, moved
    # Permuted channels reassociate fp32 sums: equal up to rounding at the logits' own scale.
    torch.testing.assert_close(logits(parent), before, atol=1e-5 * before.abs().max().item(), rtol=0)

    for name, sizes in BUDGETS.items():
        with space.at(sizes):
            elastic = logits(parent)
        sub, _ = export(parent, space, sizes)
        assert torch.equal(logits(sub), elastic), name
        assert not torch.allclose(elastic, before, atol=1e-3), name  # the budget did cut
        counted = sum(p.numel() for n, p in sub.named_parameters() if "word_embeddings" not in n and "output_layer" not in n)
        embeddings = sizes["hidden"] * VOCAB * 2  # untied input and output embeddings
        assert space.params(sizes) == counted + embeddings, name


def test_a_cut_expert_count_routes_tokens_to_the_kept_experts_only(parent):
    """The router's probabilities and map over the kept experts are padded back to the parent's
    4: every dispatcher sees the parent's layout (megatron's alltoall dispatcher reshapes the map
    by the parent's count, and failed on the cut one; under EP the allgather one takes each
    rank's experts' columns), the experts past the cut get no token, and both dispatchers run
    the same computation."""
    alltoall = build(dataclasses.replace(PARENT, moe_token_dispatcher="alltoall"))
    init_weights_layout_independent([alltoall], alltoall.config, 0)
    out = {}
    for name, model in (("allgather", parent), ("alltoall", alltoall)):
        space = ElasticSpace(model)
        tokens_per_expert = []
        experts = space.by_name["moe_experts/5"].moe.experts
        handle = experts.register_forward_pre_hook(lambda m, args: tokens_per_expert.append(args[1].tolist()))  # noqa: B023 (removed below)
        with space.at(BUDGETS["50"]):
            out[name] = logits(model)
        handle.remove()
        (routed,) = tokens_per_expert
        assert routed[2:] == [0, 0] and sum(routed) == 2 * TOKENS.numel(), (name, routed)  # top-2 of the kept 2
    assert torch.equal(out["alltoall"], out["allgather"])


@pytest.mark.slow  # a megatron dist checkpoint save + load costs 5-20 s on the shared CPUs
def test_exported_budget_survives_a_megatron_checkpoint_round_trip(parent, tmp_path):
    space, _ = reordered(parent)
    sizes = BUDGETS["50"]
    with space.at(sizes):
        elastic = logits(parent)
    sub, sub_cfg = export(parent, space, sizes)
    slicing.save_megatron(tmp_path, sub, sub_cfg, VOCAB)
    loaded, loaded_cfg = slicing.load_megatron(tmp_path)
    assert (loaded_cfg.arch, loaded_cfg.mamba_num_heads, loaded_cfg.num_experts) == ("hybrid", 4, 2)
    assert torch.equal(logits(loaded), elastic)


BAD = {
    "mamba_heads_not_multiple_of_groups": ({"mamba_heads": 5}, "multiple of 2"),
    "fewer_experts_than_topk": ({"moe_experts": 1}, "fewer than the router's top-k"),
    "head_dim_too_large": ({"mamba_head_dim": 32}, r"in \(0, 16\]"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_sizes_the_layers_cannot_take_are_refused(parent, case):
    sizes, message = case
    space = ElasticSpace(parent)
    with pytest.raises(ValueError, match=message):
        space.apply(sizes)
    assert space.active() == space.full()  # refused before anything changed


def test_cost_counts_the_parent_and_has_a_gradient_per_axis(parent):
    """The router's cost gap needs every kind's size to move the cost (a kind whose params
    ignored its size would get no gradient and drift)."""
    space = ElasticSpace(parent)
    assert space.params(space.full()) == sum(p.numel() for p in parent.parameters())
    sizes = {k: torch.tensor(float(v), requires_grad=True) for k, v in BUDGETS["75"].items()}
    (space.params(sizes) + space.active_params(sizes)).backward()
    assert all(v.grad is not None and v.grad > 0 for v in sizes.values()), {k: v.grad for k, v in sizes.items()}
    experts = space.by_name["moe_experts/5"]
    assert experts.active_params(space.full()) < experts.params(space.full())  # top-2 of 4 experts


def test_the_plugin_teacher_of_a_hybrid_run_is_the_hybrid(parent):
    """The elastic plugin rebuilds the teacher from `model.arch` (it once built a GPT)."""
    from types import SimpleNamespace

    from megatron_ext.elastic.plugin import ElasticPlugin

    space = ElasticSpace(parent)
    plugin = ElasticPlugin.__new__(ElasticPlugin)
    plugin.orders = {a.name: list(range(len(a.score))) for a in space.axes}
    plugin.space = space  # the student: the teacher takes its pipeline stage (pre/post process)
    cfg = dataclasses.replace(PARENT, pretrained=None)
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(model=cfg, train=SimpleNamespace(seed=0)), model_config=parent.config, on_cpu=True, vocab_size=VOCAB
    )
    teacher = plugin._build_teacher(trainer)
    assert type(teacher) is type(parent)
    assert set(teacher.state_dict()) == set(parent.state_dict())


@pytest.mark.parametrize(
    "parallel, elastic, message",
    # Virtual pipeline stages distil GPT parents, FP8 too (tests/distributed/test_elastic_plugin.py,
    # test_elastic_fp8_tp.py); hybrid parents have none: the runtime refuses parallel.vpp for them
    # (config/validate.py). Under EP the peers must draw together (test_elastic_budget_share.py).
    [({"vpp": None, "cp": 1, "ep": 2}, {}, r"elastic.budget_share=1 must be a multiple of parallel.ep=2")],
    ids=["ep"],
)
def test_layouts_the_plugin_cannot_distil_are_refused_at_setup(parallel, elastic, message):
    from types import SimpleNamespace

    from megatron_ext.elastic.config import ElasticConfig
    from megatron_ext.elastic.plugin import ElasticPlugin

    trainer = SimpleNamespace(cfg=SimpleNamespace(parallel=SimpleNamespace(**parallel), model=SimpleNamespace(arch="gpt"),
                                                  plugins=["elastic"]))
    with pytest.raises(ValueError, match=message):
        ElasticPlugin(ElasticConfig(**elastic)).setup(trainer)


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_hidden_axis_gate_gets_a_gradient_at_every_budget(parent, budget):
    """The router learns an axis from its gate's gradient. The hidden axis's gate sits on the
    output layer, which every budget reads: not on a layer's tensor that a budget may cut away
    (hybrid_tiny's last touched tensor is its last expert's, dropped at 50%)."""
    space = ElasticSpace(parent)
    for axis in space.axes:
        axis.gate = torch.ones((), requires_grad=True)
    with space.at(BUDGETS[budget]):
        parent.train()(TOKENS, POSITIONS, None).float().logsumexp(-1).mean().backward()
    hidden = [a for a in space.axes if a.kind == "hidden"]
    assert hidden and all(a.gate.grad is not None and a.gate.grad.abs() > 0 for a in hidden)
    space.clear_gates()
