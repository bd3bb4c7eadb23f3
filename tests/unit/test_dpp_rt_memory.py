"""The activation meter counts what autograd saves exactly: by storage, without parameters,
until backward frees it; the K/V prefix cache counts once with what attention saves."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.dpp.runtime.attention import PrefixKVCache
from megatron_ext.dpp.runtime.memory import ActivationMeter


def test_saved_storages_count_once_and_parameters_not_at_all():
    w = torch.nn.Parameter(torch.randn(8, 8))
    meter = ActivationMeter([torch.nn.ParameterList([w])])
    x = torch.randn(16, 8, requires_grad=True)
    with meter.track(chunk=3):
        h = x @ w  # saves x (counted) and w (a parameter: not counted)
        # mul saves h and a scalar; pow saves a view of h (the same storage: counted once)
        y = (h * h[:4].sum()).sum() + (h[8:] ** 2).sum()
    expected = x.untyped_storage().nbytes() + h.untyped_storage().nbytes() + 4
    assert meter.live_bytes == meter.peak_bytes == expected
    assert meter.by_chunk == {3: expected}
    y.backward()
    del y, h
    assert meter.live_bytes == 0 and meter.peak_bytes == expected


def test_cached_kv_shares_storage_with_saved_tensors():
    meter = ActivationMeter([])
    cache = PrefixKVCache()
    cache.hold = meter.hold
    k, v = torch.randn(5, 1, 2, 4, requires_grad=True), torch.randn(5, 1, 2, 4, requires_grad=True)
    with meter.track(chunk=0):
        out = (k * v).sum()  # saves k and v
        cache.put((0, 1), 0, k, v)
    assert meter.live_bytes == 2 * 5 * 2 * 4 * 4
    out.backward()
    del out
    assert meter.live_bytes == 2 * 5 * 2 * 4 * 4  # still held by the cache
    cache.done((0, 1), 0)
    assert meter.live_bytes == 0


def dpp_model(preset: str, **changes):
    """A two-layer one-stage model of `preset` with the DPP layer spec, DDP-wrapped: (bare
    model, DDP model, its config, its ChunkContext)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_ext.config.schema import ParallelConfig
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.dpp.plugin import prepare_model
    from megatron_ext.dpp.runtime.attention import ChunkContext, dpp_layer_spec
    from megatron_ext.models.arch import architecture

    model_cfg = dataclasses.replace(MODEL_PRESETS[preset], vocab_size=64, hidden_size=32, ffn_hidden_size=48, num_layers=2,
                                    seq_length=32, **changes)
    arch, context = architecture(model_cfg), ChunkContext()
    config = arch.transformer_config(model_cfg, ParallelConfig(), True)
    spec = dpp_layer_spec(arch.spec(model_cfg, True), context)
    model = arch.build(model_cfg, config, spec, 64, pre_process=True, post_process=True, vp_stage=None)
    prepare_model([model], context)
    return model, DistributedDataParallel(config, DistributedDataParallelConfig(), model), config, context


def test_fitting_activation_bytes_leaves_the_model_as_it_was_when_a_forward_raises(one_rank_world):
    """A forward that raises half-way through the fit (here: the third one, after two
    backwards have accumulated gradients) leaves the recompute count, the chunk context, the
    model's input, its hooks and its gradients as they were; bad token counts are refused first."""
    from megatron_ext.dpp.planning.costmodel import CostModel
    from megatron_ext.dpp.runtime.memory import fit_activation_bytes

    model, ddp, config, context = dpp_model("llama_tiny")
    config.recompute_num_layers = 1  # what the caller had set
    cost = CostModel(alpha=1e-6, beta=1e-9, gamma=1e-4)
    with pytest.raises(ValueError, match="token counts must be positive"):
        fit_activation_bytes([ddp], context, cost, tokens=(16, 0))
    forwards = []

    def out_of_memory_in_the_third_forward(module, args):
        forwards.append(1)
        if len(forwards) == 3:
            raise MemoryError("stands in for an allocator failure")

    model.decoder.layers[-1].register_forward_pre_hook(out_of_memory_in_the_third_forward)
    with pytest.raises(MemoryError):
        fit_activation_bytes([ddp], context, cost, tokens=(16, 24))
    assert config.recompute_num_layers == 1
    assert not model.decoder.layers[-1].self_attention.core_attention._backward_pre_hooks  # the fit's probe
    assert context.segments is None and len(context.cache) == 0
    assert model.decoder.input_tensor is None
    assert all(not p.main_grad.any() for p in model.parameters())


def test_fitting_activation_bytes_leaves_the_moe_aux_loss_scale_as_it_was(one_rank_world):
    """Megatron's schedules copy the MoE aux-loss scale into a process-global tensor that a
    backward outside them would create with another shape (the training step then fails)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_ext.dpp.planning.costmodel import CostModel
    from megatron_ext.dpp.runtime.memory import fit_activation_bytes

    _, ddp, _, context = dpp_model("llama_moe_tiny", moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.01)
    cost = CostModel(alpha=1e-6, beta=1e-9, gamma=1e-4)
    for before in (None, torch.ones(1)):  # unset, and as megatron's schedules set it
        MoEAuxLossAutoScaler.main_loss_backward_scale = before
        fit_activation_bytes([ddp], context, cost, tokens=(16, 24))
        assert MoEAuxLossAutoScaler.main_loss_backward_scale is before
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


@pytest.mark.parametrize("precision,optimizer,distributed,dp,expected", [
    ("fp32", "adam", False, 4, 4 + 4 + 8),  # parameter, fp32 gradient, two moments
    ("fp32", "sgd", True, 2, 4 + 4 + 4 / 2),
    ("bf16", "adam", True, 4, 2 + 4 + (4 + 8) / 4),  # plus an fp32 master copy, sharded
])
def test_state_bytes_per_param(precision, optimizer, distributed, dp, expected):
    from megatron_ext.dpp.runtime.memory import state_bytes_per_param

    assert state_bytes_per_param(precision, optimizer, distributed, dp) == expected


def test_state_bytes_of_an_unknown_optimizer_are_refused():
    from megatron_ext.dpp.runtime.memory import state_bytes_per_param

    with pytest.raises(ValueError, match="lion"):
        state_bytes_per_param("fp32", "lion", False, 1)


def test_one_stage_model_states_are_its_parameters(one_rank_world):
    from megatron_ext.dpp.planning.costmodel import CostModel
    from megatron_ext.dpp.runtime.memory import fit_model_states

    model, ddp, _, _ = dpp_model("llama_tiny")
    counted = fit_model_states([ddp], CostModel(alpha=1e-6, beta=1e-9, gamma=1e-4), bytes_per_param=16.0)
    assert counted.model_state_bytes(2, True, True) == 16.0 * sum(p.numel() for p in model.parameters())
    assert counted.layer_params == sum(p.numel() for p in model.decoder.layers[1].parameters())
