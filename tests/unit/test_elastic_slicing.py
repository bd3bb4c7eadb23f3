"""Elastic GPT: reorder, elastic forward and export checked against the parent and against
standalone megatron models built from the exported tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_ext.config.schema import ModelConfig
from megatron_ext.elastic import slicing
from megatron_ext.elastic.importance import calibrate
from megatron_ext.elastic.permute import reorder
from megatron_ext.elastic.space import ElasticSpace
from megatron_ext.models.init import init_weights_layout_independent
from megatron_ext.platform.launch import join_world

PARENT = ModelConfig(
    name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
    num_query_groups=2, seq_length=32, vocab_size=100, tie_embeddings=True, spec="local",
    init_method_std=0.3,  # peaked output distributions: a teacher worth distilling from
)
PADDED = 128
BUDGETS = {
    "full": {"hidden": 64, "heads": 4, "ffn": 128},
    "75": {"hidden": 48, "heads": 4, "ffn": 96},
    "50": {"hidden": 32, "heads": 2, "ffn": 64},
}
TOKENS = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
POSITIONS = torch.arange(32)[None].expand(2, -1)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS, POSITIONS, None)


@pytest.fixture(scope="module")
def world():
    join_world("cpu")
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def build_parent():
    """The parent, drawn from a fixed seed (a megatron model holds process groups: no deepcopy)."""
    from megatron_ext.models.convert.world import build_model

    (model,) = build_model(PARENT, PADDED)
    init_weights_layout_independent([model], model.config, 0)
    return model


@pytest.fixture(scope="module")
def elastic(world):
    """(reordered elastic model, its space, the parent's logits before anything changed)."""
    model = build_parent()
    before = logits(model)
    space = ElasticSpace(model)
    calibrate(space.axes, [TOKENS], lambda t: model(t, POSITIONS, None))
    reorder(space.axes)
    return model, space, before


def test_attached_full_width_is_the_parent_bitwise(world):
    model = build_parent()
    before = logits(model)
    ElasticSpace(model)
    assert torch.equal(logits(model), before)


def test_reorder_keeps_the_parents_logits(elastic):
    model, space, before = elastic
    moved = [a.name for a in space.axes if not torch.equal(a.order(), torch.arange(a.full))]
    assert moved, "calibration ranked nothing out of index order: the check would be vacuous"
    # Permuted channels reassociate fp32 sums: equal up to rounding at the logits' own scale.
    scale = before.abs().max().item()
    torch.testing.assert_close(logits(model), before, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_exported_submodel_equals_elastic_forward_bitwise(elastic, budget, tmp_path):
    model, space, _ = elastic
    with space.at(BUDGETS[budget]):
        expected = logits(model)
    sub, cfg = slicing.export_submodel(model, PARENT, space, BUDGETS[budget], PADDED, budget)
    assert torch.equal(logits(sub), expected)
    assert slicing.param_count(sub) == space.params(BUDGETS[budget])
    slicing.save_megatron(tmp_path / "ckpt", sub, cfg, PADDED)
    loaded, loaded_cfg = slicing.load_megatron(tmp_path / "ckpt")
    assert loaded_cfg.hidden_size == BUDGETS[budget]["hidden"]
    assert torch.equal(logits(loaded), expected)


def test_smaller_budgets_are_prefixes_of_larger(elastic, tmp_path):
    model, space, _ = elastic
    slicing.save_nested(tmp_path / "nested", model, PARENT, PADDED, BUDGETS)
    states = {b: slicing.slice_nested(tmp_path / "nested", b)[0].state_dict() for b in BUDGETS}
    groups, head = PARENT.num_query_groups, PARENT.hidden_size // PARENT.num_attention_heads
    for small, large in (("50", "75"), ("75", "full"), ("50", "full")):
        for key, s in states[small].items():
            if not isinstance(s, torch.Tensor):
                continue
            big = states[large][key]
            if key.endswith("linear_qkv.weight"):  # per query group: [q heads; k; v]
                s, big = s.view(groups, -1, s.shape[-1]), big.view(groups, -1, big.shape[-1])
                q = s.shape[1] - 2 * head
                assert torch.equal(s[:, :q], big[:, :q, : s.shape[-1]]), key
                assert torch.equal(s[:, q:], big[:, -2 * head :, : s.shape[-1]]), key
                continue
            if key.endswith("linear_proj.weight"):  # columns: heads per query group
                s = s.view(s.shape[0], groups, -1)
                big = big.view(big.shape[0], groups, -1)
            if key.endswith("linear_fc1.weight"):  # gate and up halves
                s, big = torch.stack(s.chunk(2)), torch.stack(big.chunk(2))
            assert torch.equal(s, big[tuple(slice(0, n) for n in s.shape)]), key


def test_nested_checkpoint_slices_equal_the_elastic_model(elastic, tmp_path):
    model, space, _ = elastic
    slicing.save_nested(tmp_path / "nested", model, PARENT, PADDED, BUDGETS)
    sub, _ = slicing.slice_nested(tmp_path / "nested", "75")
    with space.at(BUDGETS["75"]):
        assert torch.equal(logits(sub), logits(model))


def test_heterogeneous_submodel_exports_per_layer_and_equals_the_elastic_forward(elastic):
    model, space, _ = elastic
    sizes = {"hidden": 48, "ffn/0": 32, "ffn/1": 128, "heads/0": 2, "heads/1": 4}
    with space.at(sizes):
        expected = logits(model)
        assert model.decoder.layers[0].mlp.linear_fc2.weight.shape == (48, 32)
    with pytest.raises(ValueError, match="sizes differ between layers"):
        slicing.export_submodel(model, PARENT, space, sizes, PADDED)
    sub = slicing.export_heterogeneous(model, PARENT, space, sizes, PADDED)
    assert sub.decoder.layers[0].mlp.linear_fc1.weight.shape == (2 * 32, 48)
    assert sub.decoder.layers[0].self_attention.linear_qkv.weight.shape == (2 * 16 + 2 * 2 * 16, 48)
    assert slicing.param_count(sub) == space.params(sizes)
    assert torch.equal(logits(sub), expected)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"heads": 3}, r"heads/0: size 3 is not a multiple of 2"),
        ({"ffn": 0}, r"ffn/0: size 0"),
        ({"hidden": 65}, r"hidden: size 65"),
        ({"experts": 2}, r"unknown axis or kind \['experts'\]"),
    ],
    ids=["heads-break-query-groups", "empty-ffn", "wider-than-parent", "unknown-kind"],
)
def test_bad_sizes_are_refused_before_anything_changes(elastic, sizes, message):
    model, space, _ = elastic
    before = space.active()
    with pytest.raises(ValueError, match=message):
        space.apply(sizes)
    assert space.active() == before


@pytest.mark.parametrize("think_budget", [0, 6], ids=["no-thinking", "budget-6"])
def test_think_small_answer_large_equals_the_two_exported_models(elastic, think_budget):
    """The elastic phases on shared weights produce what the standalone small model thinks and
    the standalone large model answers after prefilling prompt + that trace."""
    from megatron_ext.elastic.think_then_answer import generate_elastic
    from megatron_ext.generation.generate import SamplingConfig, generate

    model, space, _ = elastic
    prompt, end_think = TOKENS[0, :8].tolist(), 99
    got = generate_elastic(model, space, prompt, 100, BUDGETS["50"], BUDGETS["full"], end_think, think_budget, 5)
    small, _ = slicing.export_submodel(model, PARENT, space, BUDGETS["50"], PADDED)
    large, _ = slicing.export_submodel(model, PARENT, space, BUDGETS["full"], PADDED)
    trace = generate(small, prompt, 100, SamplingConfig(max_new_tokens=think_budget, stop_token_ids=(end_think,))) if think_budget else []
    trace = trace if trace[-1:] == [end_think] else trace + [end_think]
    answer = generate(large, prompt + trace, 100, SamplingConfig(max_new_tokens=5))
    assert (got.trace, got.answer) == (trace, answer)
    assert got.phases["think"].new_tokens == len(trace) and got.phases["answer"].prefill_tokens == len(prompt) + len(trace)


def test_hugging_face_export_reads_back_to_the_same_logits(elastic, tmp_path):
    """safetensors + config.json with the parent's head size, read by the project's HF reader."""
    from megatron_ext.models.convert.load import load_logical
    from megatron_ext.models.convert.llama import HFAsLogical
    from megatron_ext.models.convert.source import open_pretrained
    from megatron_ext.models.convert.world import build_model

    model, space, _ = elastic
    sub, cfg = slicing.export_submodel(model, PARENT, space, BUDGETS["75"], PADDED)
    slicing.save_hf(tmp_path / "hf", sub, cfg, PARENT.vocab_size)
    read = open_pretrained(str(tmp_path / "hf"))
    assert (read.config.hidden_size, read.config.head_dim) == (48, 16)
    (loaded,) = chunks = build_model(read.config, PADDED)
    load_logical(chunks, HFAsLogical(read.tensors, read.config, PADDED))
    vocab = PARENT.vocab_size  # Hugging Face has no padding rows: they come back as zeros
    assert torch.equal(logits(loaded)[..., :vocab], logits(sub)[..., :vocab])
