"""The plugins against the model-space options of gpt-oss and DeepSeek-V3 (multi-token
prediction, sliding windows, softmax offsets, multi-latent attention): each plugin x option is
refused before launch (one line naming the option's field and the plugin), or handled, which
the run checks below show.

- dpp: its chunk attention is block-diagonal causal attention with a plain softmax, and it
  packs sequences into chunks: none of them.
- elastic: its heads axis does not slice per-head softmax offsets, its axes do not reach the MTP
  layers or MLA; a sliding window it handles (the mask is per layer, not per weight).
- lora: a packed job's loss is its own (MTP's is one over the pack); each job's adapter is written
  for a Hugging Face base (PEFT), whose families have no window and no softmax offsets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ext.config import compose_config
from megatron_ext.config.validate import ConfigError

MLA = [
    "model.multi_latent_attention=true", "model.num_query_groups=null", "model.q_lora_rank=32", "model.kv_lora_rank=16", "model.qk_head_dim=16",
    "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16",
]
# option -> (overrides, the field a refusal names)
OPTIONS = {
    "mtp": (["model.mtp_num_layers=1"], "model.mtp_num_layers"),
    "window": (["model.window_size=[8,0]"], "model.window_size"),
    "softmax_off_by_one": (["model.softmax_type=off-by-one"], "model.softmax_type"),
    "softmax_learnable": (["model.softmax_type=learnable"], "model.softmax_type"),
    "mla": (MLA, "model.multi_latent_attention"),
}
PLUGINS = {"dpp": ["experiment=none", "plugin=dpp"], "elastic": ["experiment=none", "plugin=elastic"], "lora": ["experiment=lora_sweep"]}
# (plugin, option) -> what the refusal says besides the field and the plugin; None: handled.
VERDICTS = {
    ("dpp", "mtp"): "shifted tokens would cross from one sequence into the next",
    ("dpp", "window"): "sliding windows are not supported",
    ("dpp", "softmax_off_by_one"): "softmax_type=off-by-one) are not supported",
    ("dpp", "softmax_learnable"): "softmax_type=learnable) are not supported",
    ("dpp", "mla"): "multi-latent attention is not supported",
    ("elastic", "mtp"): "multi-token prediction (its layers are not sliced",
    ("elastic", "window"): None,
    ("elastic", "softmax_off_by_one"): "softmax_type=off-by-one: one per head, not sliced with the heads axis",
    ("elastic", "softmax_learnable"): "softmax_type=learnable: one per head",
    ("elastic", "mla"): "multi-latent attention (no axes for it)",
    ("lora", "mtp"): "multi-token prediction's loss is one over the whole pack",
    ("lora", "window"): "Hugging Face base (PEFT), which has no sliding window",
    ("lora", "softmax_off_by_one"): "which has no softmax offsets (softmax_type=off-by-one)",
    ("lora", "softmax_learnable"): "which has no softmax offsets (softmax_type=learnable)",
    ("lora", "mla"): "multi-latent attention has not",
}
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.seq_length=32", "launcher.nproc=1",
]


def preflight_of(plugin: str, option: str) -> None:
    """The launcher's own checks (the config's rules, then the plugin's) of a tiny config."""
    from megatron_ext.config.validate import validate
    from megatron_ext.plugin import build_plugins

    cfg = compose_config([*PLUGINS[plugin], *TINY, *OPTIONS[option][0]])
    validate(cfg, 1)
    for p in build_plugins(cfg.plugins, cfg):
        p.check(cfg, 1)
        p.check_layout(cfg, 1)


def test_the_table_covers_every_plugin_and_option():
    assert set(VERDICTS) == {(p, o) for p in PLUGINS for o in OPTIONS}


REFUSED = [case for case, verdict in VERDICTS.items() if verdict is not None]
HANDLED = [case for case, verdict in VERDICTS.items() if verdict is None]


@pytest.mark.parametrize("plugin, option", REFUSED, ids=["-".join(case) for case in REFUSED])
def test_a_plugin_refuses_the_options_it_cannot_handle(plugin, option):
    with pytest.raises(ConfigError) as refused:
        preflight_of(plugin, option)
    assert refused.value.field == OPTIONS[option][1]
    assert refused.value.rule.startswith(plugin) and VERDICTS[plugin, option] in refused.value.rule
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("plugin, option", HANDLED, ids=["-".join(case) for case in HANDLED])
def test_a_plugin_accepts_the_options_it_handles(plugin, option):
    preflight_of(plugin, option)


# --- elastic with a sliding window ------------------------------------------------------------


@pytest.mark.parametrize("skip_freq", [None, 2], ids=["every_layer", "every_other_layer"])
def test_elastic_slices_a_windowed_model_and_keeps_its_window(one_rank_world, skip_freq):
    """The elastic forward of a windowed parent at half size equals the exported standalone
    submodel, which keeps the window (on the same layers: no axis drops layers); the same
    weights without the window give other logits."""
    from megatron_ext.elastic import slicing
    from megatron_ext.elastic.importance import calibrate
    from megatron_ext.elastic.permute import reorder
    from megatron_ext.elastic.space import ElasticSpace
    from megatron_ext.models.convert.world import build_model
    from megatron_ext.models.init import init_weights_layout_independent
    from tests.unit.test_elastic_slicing import PADDED, PARENT, POSITIONS, TOKENS, logits

    parent = dataclasses.replace(PARENT, window_size=[8, 0], window_attn_skip_freq=skip_freq)
    (model,) = build_model(parent, PADDED)
    init_weights_layout_independent([model], model.config, 0)
    space = ElasticSpace(model)
    calibrate(space.axes, [TOKENS], lambda t: model(t, POSITIONS, None))
    reorder(space.axes)
    half = {"hidden": 32, "heads": 2, "ffn": 64}
    with space.at(half):
        expected = logits(model)
    sub, cfg = slicing.export_submodel(model, parent, space, half, PADDED, "half")
    assert (cfg.window_size, cfg.window_attn_skip_freq) == ([8, 0], skip_freq)
    assert torch.equal(logits(sub), expected)
    (unwindowed,) = build_model(dataclasses.replace(cfg, window_size=None, window_attn_skip_freq=None), PADDED)
    unwindowed.load_state_dict(sub.state_dict())
    assert not torch.allclose(logits(unwindowed), expected, atol=1e-3)


def test_elastic_trains_a_windowed_model(tmp_path):
    from megatron_ext.train import run_from_overrides

    summary = run_from_overrides([
        "experiment=none", "plugin=elastic", *TINY, "model.window_size=[8,0]", "logging.progress_bar=false",
        "train.micro_batch_size=1", "train.global_batch_size=2", "train.iters=4", "train.eval_interval=0",
        "elastic.uniform_steps=2", "elastic.calibration_batches=2", "elastic.grid={hidden: [32,64], heads: [2,4], ffn: [64,128]}",
        f"elastic.export_dir={tmp_path / 'export'}", f"data.cache_dir={tmp_path / 'cache'}",
    ])
    assert len(summary["losses"]) == 4 and all(torch.isfinite(torch.tensor(summary["losses"])))
    assert (tmp_path / "export" / "nested" / "model.safetensors").is_file()
