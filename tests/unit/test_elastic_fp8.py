"""FP8 quantisation-aware distillation: per-tensor scales of the parent survive slicing (a
budget's FP8 tensors are slices of the nested FP8 parent's, bitwise, and equal what the student
reads during QAD), also through the nested FP8 checkpoint and the standalone one sliced from it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_ext.elastic import fp8, slicing
from megatron_ext.elastic.importance import calibrate
from megatron_ext.elastic.permute import reorder
from megatron_ext.elastic.space import ElasticSpace
from tests.unit.test_elastic_slicing import BUDGETS, PADDED, PARENT, POSITIONS, TOKENS, build_parent, logits, world  # noqa: F401


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



def test_nested_fp8_checkpoint_slices_to_standalone_fp8_submodels(world, tmp_path):  # noqa: F811
    """save_nested with the parent's scales -> slice_nested_fp8 per budget: the standalone
    checkpoint's codes are the in-memory quantised parent's slices byte for byte, its scales the
    parent's, and the dequantised submodel read back from it runs the elastic forward of that
    budget with QAD on, bitwise."""
    model, space = reordered()
    keys = fp8.enable(model)
    parent_scales = fp8.scales(model)
    in_memory = fp8.fp8_state(model.state_dict(), parent_scales)
    slicing.save_nested(tmp_path / "nested", model, PARENT, PADDED, BUDGETS, fp8_scales=parent_scales)
    stored = load_file(str(tmp_path / "nested" / slicing.NESTED_WEIGHTS))
    assert all(stored[k].dtype == fp8.FP8 for k in keys)
    for budget, sizes in BUDGETS.items():
        out = slicing.slice_nested_fp8(tmp_path / "nested", budget, tmp_path / budget)
        sub_state = load_file(str(out / slicing.NESTED_WEIGHTS))
        expected = sliced_values(model, space, sizes, {k: in_memory[k].float() for k in keys})
        for k in keys:
            assert sub_state[k].dtype == fp8.FP8
            assert torch.equal(sub_state[k].view(torch.uint8), expected[k].to(fp8.FP8).view(torch.uint8)), k
            assert torch.equal(sub_state[k + fp8.SCALE_SUFFIX], parent_scales[k])
        with space.at(sizes):
            qad = logits(model)
        sub, cfg = slicing.slice_nested(out, budget)
        assert cfg.hidden_size == sizes["hidden"]
        assert torch.equal(logits(sub), qad), budget
    # The dequantised budget is not the unquantised one: the equality above is about FP8 values.
    fp8.disable(model)
    with space.at(BUDGETS["50"]):
        assert not torch.allclose(logits(model), qad, rtol=0, atol=1e-6)


def test_fp8_export_refuses_a_checkpoint_without_scales_and_unknown_scales(world, tmp_path):  # noqa: F811
    model, _ = reordered()
    slicing.save_nested(tmp_path / "plain", model, PARENT, PADDED, BUDGETS)
    with pytest.raises(ValueError, match="not an FP8 nested checkpoint"):
        slicing.slice_nested_fp8(tmp_path / "plain", "50", tmp_path / "sub")
    assert not (tmp_path / "sub").exists()
    with pytest.raises(ValueError, match=r"no tensor \['decoder.nope.weight'\]"):
        slicing.save_nested(tmp_path / "bad", model, PARENT, PADDED, BUDGETS, fp8_scales={"decoder.nope.weight": torch.tensor(1.0)})
    assert not (tmp_path / "bad").exists()


def qad_step(model, space, optimizer, budgets) -> None:
    """One optimizer step as the plugin runs it: every micro-batch's forward and backward (one per
    budget) inside one `fixed_scales` window, the optimizer step after it."""
    optimizer.zero_grad()
    with fp8.fixed_scales(model):
        for sizes in budgets:
            with space.at(sizes):
                model.train()(TOKENS, POSITIONS, None).float().pow(2).mean().backward()
    optimizer.step()


def read_in_window(model, module) -> torch.Tensor:
    with fp8.fixed_scales(model), torch.no_grad():
        return module.weight.detach().clone()


def test_scales_are_reduced_once_per_linear_per_step(world, monkeypatch):  # noqa: F811
    """Three micro-batches at three budgets read every linear at least three times, the scale is
    computed once per linear in the step's window; outside a window every read recomputes it."""
    model, space = reordered()
    keys = fp8.enable(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    calls = []
    counting = fp8.scale_of
    monkeypatch.setattr(fp8, "scale_of", lambda *a, **k: calls.append(a[0]) or counting(*a, **k))
    qad_step(model, space, optimizer, BUDGETS.values())
    assert len(calls) == len(keys) == 8
    assert len({id(w) for w in calls}) == len(keys)  # each linear's whole weight once
    calls.clear()
    logits(model)  # no window: per read, as before (a forward reads some linears twice: 12 reads)
    logits(model)
    assert len(calls) >= 2 * len(keys)


def test_a_step_reads_the_scale_of_the_weights_the_optimizer_left(world):  # noqa: F811
    """After an optimizer step the next window's reads use the new weights' scale (a stale one,
    kept from the step before, quantises on another grid: checked to differ)."""
    model, space = reordered()
    fp8.enable(model)
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    whole = fc1._parameters["weight"]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        before = fp8.scale_of(whole)
        qad_step(model, space, optimizer, [BUDGETS["full"], BUDGETS["50"]])
        after = fp8.scale_of(whole)
        assert after != before, "the step left the amax: vacuous"
        read = read_in_window(model, fc1)
        assert torch.equal(read, fp8.fake_quantize(whole, after).detach())
        assert not torch.equal(read, fp8.fake_quantize(whole, before).detach())


def test_one_window_fixes_the_scales_of_every_model_chunk(world, monkeypatch):  # noqa: F811
    """Under virtual pipeline stages a rank holds several model chunks: one window over all of
    them computes each linear's scale once, however often each chunk is read inside."""
    chunks = [build_parent(), build_parent()]
    keys = [key for chunk in chunks for key in fp8.enable(chunk)]
    calls = []
    counting = fp8.scale_of
    monkeypatch.setattr(fp8, "scale_of", lambda *a, **k: calls.append(a[0]) or counting(*a, **k))
    with fp8.fixed_scales(chunks), torch.no_grad():
        for chunk in [*chunks, *chunks]:
            logits(chunk)
    assert len(calls) == len(keys) == 16
    assert len({id(w) for w in calls}) == len(keys)  # each chunk's every linear once
