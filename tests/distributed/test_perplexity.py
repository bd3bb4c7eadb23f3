"""Perplexity through megatron's forward-only schedule equals cross-entropy computed directly
from the model's logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.evaluation import perplexity, text_windows
from megatron_ext.models.gpt import build_gpt_model, layer_spec, transformer_config
from megatron_ext.models.init import init_weights_layout_independent

SEQ = 32


@pytest.fixture
def tiny_model(one_rank_world):
    model_cfg = ModelConfig(seq_length=SEQ)
    config = transformer_config(model_cfg, ParallelConfig(), on_cpu=True)
    model = build_gpt_model(model_cfg, config, layer_spec(model_cfg, False), 384, True, True)
    init_weights_layout_independent([model], config, seed=11)
    return model


def test_perplexity_matches_direct_cross_entropy(tiny_model):
    ids = list("Perplexity is the exponential of the mean negative log-likelihood.".encode()) * 2
    with torch.no_grad():
        logits = tiny_model(torch.tensor([ids[:-1]])[:, :SEQ], torch.arange(SEQ)[None], None)
    # The reference: every window scored on its own, the last one shorter.
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, SEQ):
        window = ids[start : start + SEQ + 1]
        with torch.no_grad():
            out = tiny_model(torch.tensor([window[:-1]]), torch.arange(len(window) - 1)[None], None)
        nll += F.cross_entropy(out[0].float(), torch.tensor(window[1:]), reduction="sum").item()
        count += len(window) - 1
    assert logits.shape[1] == SEQ
    assert perplexity([tiny_model], ids, SEQ) == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_text_windows_cover_every_prediction_once():
    ids = list(range(70))
    windows = text_windows(ids, 32)
    labels = torch.cat([w["labels"][w["loss_mask"].bool()] for w in windows])
    assert labels.tolist() == ids[1:]
