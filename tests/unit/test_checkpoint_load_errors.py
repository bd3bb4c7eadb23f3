"""A checkpoint a rank cannot load (a shard cut short, another model's shapes) is one line naming
the field and the iteration folder, not torch's gathered traceback."""

from __future__ import annotations

import pytest

from megatron_ext.config.schema import ModelConfig
from megatron_ext.config.validate import ConfigError
from megatron_ext.models.convert.checkpoint import save_model_only
from megatron_ext.models.convert.world import build_model
from megatron_ext.checkpointing import torch_dist as ckpt

SMALL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2, vocab_size=100)


@pytest.fixture
def saved(one_rank_world, tmp_path):
    save_model_only(tmp_path, build_model(SMALL, padded_vocab=128), SMALL, 128)
    return tmp_path


def test_a_shard_cut_short_names_the_checkpoint(saved):
    shard = max(ckpt.iteration_dir(saved, 0).glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ConfigError) as error:
        ckpt.load_checkpoint(saved, 0, build_model(SMALL, padded_vocab=128), None, load_rng=True)
    message = str(error.value)
    assert "\n" not in message
    # what torch's reader stumbles on depends on where the cut falls
    assert message.startswith(f"checkpoint.load: {ckpt.iteration_dir(saved, 0)} cannot be loaded: ")
    assert any(cause in message for cause in ("cut short (EOFError)", "PytorchStreamReader failed"))


def test_another_model_shape_names_the_checkpoint(saved):
    wider = ModelConfig(**{**SMALL.__dict__, "hidden_size": 64})
    with pytest.raises(ConfigError) as error:
        ckpt.load_checkpoint(saved, 0, build_model(wider, padded_vocab=128), None, load_rng=True, field="model.pretrained")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"model.pretrained: {ckpt.iteration_dir(saved, 0)} cannot be loaded: CheckpointingException: Global shape mismatch")
