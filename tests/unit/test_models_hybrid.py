"""The pure-PyTorch Mamba2 mixer and the hybrid MambaModel built on it.

References: the chunked SSD scan against the token-by-token recurrence (float64, so only the
order of additions differs); the cached decode (conv state + SSM state, and megatron's KV cache
for the attention layers) against the full-sequence forward of the same tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.config.schema import Config, ParallelConfig
from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.config.validate import violations
from megatron_ext.models.hybrid import build_hybrid_model, hybrid_stack_spec, hybrid_transformer_config
from megatron_ext.models.init import init_weights_layout_independent
from megatron_ext.models.mamba2 import MixerSubmodules, TorchMambaMixer, mamba_shape
from megatron_ext.models.ssd import ssd_chunked, ssd_recurrence

TINY = MODEL_PRESETS["hybrid_tiny"]
VOCAB = 128

# --- the scan ----------------------------------------------------------------------------------

# name -> (length, heads, groups, chunk_size, with an initial state)
SCANS = {
    "chunk1": (12, 4, 2, 1, False),
    "chunk_divides": (32, 4, 2, 8, False),
    "ragged_last_chunk": (37, 4, 2, 16, True),
    "chunk_longer_than_sequence": (9, 6, 3, 64, True),
    "one_group": (20, 4, 1, 7, False),
    "head_per_group": (20, 3, 3, 5, True),
}


def random_scan_inputs(length: int, heads: int, groups: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, p, n = 2, 5, 6
    x = torch.randn(b, length, heads, p, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(b, length, heads, generator=g, dtype=torch.float64))
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 3
    B = torch.randn(b, length, groups, n, generator=g, dtype=torch.float64)
    C = torch.randn(b, length, groups, n, generator=g, dtype=torch.float64)
    state = torch.randn(b, heads, p, n, generator=g, dtype=torch.float64)
    return x, dt, A, B, C, state


@pytest.mark.parametrize("case", SCANS.values(), ids=SCANS.keys())
def test_chunked_scan_equals_recurrence(case):
    length, heads, groups, chunk, with_state = case
    x, dt, A, B, C, state = random_scan_inputs(length, heads, groups)
    initial = state if with_state else None
    y_ref, final_ref = ssd_recurrence(x, dt, A, B, C, initial)
    y, final = ssd_chunked(x, dt, A, B, C, chunk, initial)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


def test_scan_depends_on_the_initial_state():
    """Guards the test above: an ignored initial state would pass it for zero states only."""
    x, dt, A, B, C, state = random_scan_inputs(10, 4, 2)
    y0, _ = ssd_chunked(x, dt, A, B, C, 4)
    y1, _ = ssd_chunked(x, dt, A, B, C, 4, state)
    assert not torch.allclose(y0, y1)


# --- the mixer ---------------------------------------------------------------------------------


def tiny_config(**changes):
    model = dataclasses.replace(TINY, **changes)
    return model, hybrid_transformer_config(model, ParallelConfig(), on_cpu=True)


def build_mixer(chunk_size: int) -> TorchMambaMixer:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    _, config = tiny_config()
    torch.manual_seed(0)
    mixer = TorchMambaMixer(
        config,
        MixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=config.hidden_size,
        chunk_size=chunk_size,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    return mixer.eval()


# name -> (sequence length, tokens prefilled before decoding one at a time, chunk size)
DECODES = {
    "decode_from_first_token": (11, 1, 4),
    "prefill_then_decode": (11, 6, 4),
    "prefill_ragged_chunk": (13, 9, 8),
}


@pytest.mark.parametrize("case", DECODES.values(), ids=DECODES.keys())
def test_mixer_decode_equals_full_forward(one_rank_world, case):
    length, prefill, chunk = case
    mixer = build_mixer(chunk)
    hidden = torch.randn(length, 2, mixer.shape.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = mixer(hidden)
        context = StaticInferenceContext(2, length)
        outputs = [mixer(hidden[:prefill], inference_context=context)[0]]
        context.increment_sequence_len_offset(prefill)
        for t in range(prefill, length):
            outputs.append(mixer(hidden[t : t + 1], inference_context=context)[0])
            context.increment_sequence_len_offset(1)
    torch.testing.assert_close(torch.cat(outputs), full, rtol=1e-5, atol=1e-5)


def test_mixer_state_carries_information(one_rank_world):
    """Guards the decode test: the last output must depend on the first token through the
    state, or a mixer that forgot its state could pass."""
    mixer = build_mixer(4)
    hidden = torch.randn(8, 1, mixer.shape.d_model, generator=torch.Generator().manual_seed(2))
    changed = hidden.clone()
    changed[0] += 1.0
    with torch.no_grad():
        assert not torch.allclose(mixer(hidden)[0][-1], mixer(changed)[0][-1])


BAD_SHAPES = {
    "heads_not_divisible_by_groups": (dict(mamba_num_heads=6, mamba_num_groups=4), 1, "divisible by mamba groups"),
    "groups_not_divisible_by_tp": (dict(mamba_num_groups=2), 4, "divisible by tensor parallel size"),
}


@pytest.mark.parametrize("case", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
def test_mixer_refuses_sizes_it_cannot_cut(case):
    changes, tp, message = case
    _, config = tiny_config()
    config = dataclasses.replace(config, **changes)
    with pytest.raises(ValueError, match=message):
        mamba_shape(config, config.hidden_size, tp)


# --- the hybrid model --------------------------------------------------------------------------


def build_tiny_hybrid():
    model_cfg, config = tiny_config(seq_length=32)
    model = build_hybrid_model(model_cfg, config, hybrid_stack_spec(model_cfg, on_cpu=True), VOCAB, True, True)
    init_weights_layout_independent([model], config, seed=3)
    return model.eval()


def test_hybrid_decode_equals_full_forward(one_rank_world):
    """Prefill + single-token steps through megatron's StaticInferenceContext (Mamba states in
    our mixer, KV cache in megatron's attention) give the full forward's logits."""
    model = build_tiny_hybrid()
    length, prefill = 14, 5
    tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(length)[None]
    with torch.no_grad():
        full = model(tokens, positions, None, runtime_gather_output=True)
        context = StaticInferenceContext(1, length)
        def run(a, b):
            return model(tokens[:, a:b], positions[:, a:b], None, inference_context=context, runtime_gather_output=True)

        steps = [run(0, prefill)]
        context.increment_sequence_len_offset(prefill)
        context.enable_decode_mode()
        for t in range(prefill, length):
            steps.append(run(t, t + 1))
            context.increment_sequence_len_offset(1)
    # The prefill returns the logits of its last token only (megatron's inference default).
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, prefill - 1 :], rtol=1e-5, atol=1e-5)


def test_hybrid_has_every_layer_kind(one_rank_world):
    model = build_tiny_hybrid()
    kinds = [type(layer).__name__ for layer in model.decoder.layers]
    assert kinds == ["MambaLayer", "TransformerLayer", "MambaLayer", "MLPLayer", "MambaLayer", "TransformerLayer"]
    assert type(model.decoder.layers[-1].mlp).__name__ == "MoELayer"
    assert isinstance(model.decoder.layers[0].mixer, TorchMambaMixer)


def test_checkpoint_keys_are_megatrons_mixer_layout(one_rank_world):
    """in_proj and conv1d are saved in their parts, under the keys megatron's MambaMixer uses,
    so checkpoints move between the two mixers and across TP sizes."""
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    model = build_tiny_hybrid()
    state = model.sharded_state_dict()
    apply_factories(state)
    keys = {t.key for t in nested_values(state) if hasattr(t, "key")}
    mixer = "decoder.layers.0.mixer."
    expected = [f"{mixer}in_proj.weight.{p}" for p in ("z", "x", "B", "C", "dt")]
    expected += [f"{mixer}conv1d.{w}.{p}" for w in ("weight", "bias") for p in ("x", "B", "C")]
    expected += [f"{mixer}{p}" for p in ("A_log", "dt_bias", "D", "norm.weight", "out_proj.weight")]
    expected += ["decoder.layers.0.mixer.in_proj.layer_norm_weight", "decoder.final_norm.weight"]
    assert set(expected) <= keys, sorted(set(expected) - keys)


# --- validation --------------------------------------------------------------------------------

# name -> (model changes, parallel changes, field, text in the message)
BAD_CONFIGS = {
    "pattern_missing": (dict(hybrid_pattern=None), {}, "model.hybrid_pattern", "needs model.hybrid_pattern"),
    "unknown_symbol": (dict(hybrid_pattern="M*X-ME"), {}, "model.hybrid_pattern", "unknown symbols 'X'"),
    "length_mismatch": (dict(hybrid_pattern="M*M-M"), {}, "model.hybrid_pattern", "has 5 layers"),
    "moe_without_experts": (dict(num_experts=None), {}, "model.hybrid_pattern", "set model.num_experts"),
    "experts_without_moe": (dict(hybrid_pattern="M*M-M-"), {}, "model.hybrid_pattern", "has no MoE layer"),
    "groups_vs_tp": (dict(mamba_num_groups=1, num_query_groups=2), dict(tp=2), "model.mamba_num_groups", "divisible by parallel.tp"),
    "heads_vs_groups": (dict(mamba_num_heads=6, mamba_num_groups=4), {}, "model.mamba_num_groups", "divisible by model.mamba_num_groups"),
    "vpp": (dict(num_layers=6), dict(pp=2, vpp=3), "model.arch", "interleaved pipeline"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_hybrid_configs_are_refused(case):
    model_changes, parallel_changes, field, text = case
    cfg = Config(
        model=dataclasses.replace(TINY, **model_changes),
        parallel=dataclasses.replace(ParallelConfig(), **parallel_changes),
    )
    world = cfg.parallel.tp * cfg.parallel.pp
    found = violations(cfg, world, "cpu")
    assert any(f == field and text in rule for f, rule in found), found


def test_presets_are_valid():
    for name in ("hybrid_tiny", "nemotron_nano_moe"):
        cfg = Config(model=MODEL_PRESETS[name])
        assert violations(cfg, 1, "cpu") == [], name
