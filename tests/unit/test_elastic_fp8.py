"""FP8 quantisation-aware distillation: per-tensor scales of the parent survive slicing (a
budget's FP8 tensors are slices of the nested FP8 parent's, bitwise, and equal what the student
reads during QAD)."""

from __future__ import annotations

import torch

from megatron_ext.elastic import fp8, slicing
from megatron_ext.elastic.importance import calibrate
from megatron_ext.elastic.permute import reorder
from megatron_ext.elastic.space import ElasticSpace
from tests.unit.test_elastic_slicing import BUDGETS, POSITIONS, TOKENS, build_parent, world  # noqa: F401


def reordered():
    model = build_parent()
    space = ElasticSpace(model)
    calibrate(space.axes, [TOKENS], lambda t: model(t, POSITIONS, None))
    reorder(space.axes)
    return model, space


@torch.no_grad()
def sliced_values(model, space, sizes, values: dict) -> dict:
    """Slices at `sizes` of tensors shaped like the parent's weights (read through the model's
    own slicing rules: `values` are copied in for the read, the weights restored after)."""
    params = dict(model.named_parameters())
    saved = {k: params[k].detach().clone() for k in values}
    try:
        for k, v in values.items():
            params[k].copy_(v)
        with space.at(sizes):
            state = slicing.sliced_state_dict(model)
        return {k: state[k] for k in values}
    finally:
        for k, v in saved.items():
            params[k].copy_(v)


def test_a_budgets_fp8_tensors_are_slices_of_the_nested_fp8_parent(world):  # noqa: F811
    model, space = reordered()
    keys = fp8.enable(model)
    assert len(keys) == 8  # qkv, proj, fc1, fc2 of two layers
    parent_scales = fp8.scales(model)
    nested = fp8.fp8_state(model.state_dict(), parent_scales)
    as_float = {k: nested[k].float() for k in keys}  # FP8 values are exact in fp32
    for sizes in BUDGETS.values():
        with space.at(sizes):
            qad = slicing.sliced_state_dict(model)  # what the student reads during QAD
        fp8.disable(model)
        with space.at(sizes):
            raw = slicing.sliced_state_dict(model)
        fp8.enable(model)
        sub = fp8.fp8_state(raw, parent_scales)  # quantise after slicing, with the parent's scales
        from_nested = sliced_values(model, space, sizes, as_float)
        for k in keys:
            assert sub[k].shape == qad[k].shape
            assert torch.equal(sub[k].view(torch.uint8), from_nested[k].to(fp8.FP8).view(torch.uint8)), k
            assert torch.equal(sub[k + fp8.SCALE_SUFFIX], nested[k + fp8.SCALE_SUFFIX])
            assert torch.equal(qad[k], fp8.dequantize(sub[k], parent_scales[k], qad[k].dtype)), k
    # The smallest budget's own scales would differ (a slice's amax is smaller): not vacuous.
    assert any(fp8.scale_of(raw[k]) != parent_scales[k] for k in keys)

