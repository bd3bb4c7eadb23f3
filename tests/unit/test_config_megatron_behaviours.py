"""The rules for the sample-based schedule, mock data and async save: one named bad config per
rule, and the good combinations beside them."""

from __future__ import annotations

import pytest

from megatron_ext.config import Config
from megatron_ext.config.validate import violations


def make(**fields) -> Config:
    cfg = Config()
    for path, value in fields.items():
        section, name = path.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


SAMPLES = {"train.train_samples": 64, "train.global_batch_size": 16, "train.micro_batch_size": 4}

# id -> (fields, blamed field, key phrase)
BAD = {
    "samples_with_warmup_iters": (
        {**SAMPLES, "optim.lr_warmup_iters": 2}, "train.train_samples",
        "optim.lr_warmup_iters counts iterations, but train.train_samples",
    ),
    "samples_with_decay_iters": (
        {**SAMPLES, "optim.lr_decay_iters": 3}, "train.train_samples",
        "optim.lr_decay_iters counts iterations",
    ),
    "iters_with_warmup_samples": (
        {"optim.lr_warmup_samples": 32}, "train.train_samples", "optim.lr_warmup_samples counts samples",
    ),
    "iters_with_decay_samples": (
        {"optim.lr_decay_samples": 32}, "train.train_samples", "optim.lr_decay_samples counts samples",
    ),
    "samples_below_a_batch": (
        {**SAMPLES, "train.train_samples": 15}, "train.train_samples", "at least one global batch (16)",
    ),
    "samples_below_derived_batch": (
        {"train.train_samples": 7, "train.global_batch_size": None, "train.micro_batch_size": 4},
        "train.train_samples", "at least one global batch (8)",
    ),
    "samples_zero": (
        {"train.train_samples": 0}, "train.train_samples", "positive integer or null",
    ),
    "warmup_samples_past_decay": (
        {**SAMPLES, "optim.lr_warmup_samples": 64}, "optim.lr_warmup_samples",
        "(64) must be >= 0 and < the lr decay samples (64)",
    ),
    "async_save_without_dir": (
        {"checkpoint.async_save": True}, "checkpoint.async_save", "needs checkpoint.save",
    ),
    "mock_and_data_path": (
        {"data.mock": True, "data.data_path": ["corpus"]}, "data.mock", "exclusive",
    ),
}

GOOD = {
    "samples": SAMPLES,
    "samples_with_sample_schedule": {**SAMPLES, "optim.lr_warmup_samples": 16, "optim.lr_decay_samples": 48},
    # Megatron-LM's zero warmup default counts in either unit.
    "samples_with_zero_warmup_iters": {**SAMPLES, "optim.lr_warmup_iters": 0},
    "iters_with_zero_warmup_samples": {"optim.lr_warmup_samples": 0},
    "async_save": {"checkpoint.async_save": True, "checkpoint.save": "ckpt"},
    "mock": {"data.mock": True},
}


@pytest.mark.parametrize("fields, field, phrase", BAD.values(), ids=BAD.keys())
def test_bad_config_names_field_and_rule(fields, field, phrase):
    found = violations(make(**fields), 2, "cpu")
    assert any(f == field and phrase in rule for f, rule in found), found


@pytest.mark.parametrize("fields", GOOD.values(), ids=GOOD.keys())
def test_good_config_passes(fields):
    assert violations(make(**fields), 2, "cpu") == []
