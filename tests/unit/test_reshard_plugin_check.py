"""The reshard plugin refuses settings that cannot work before any worker starts."""

from __future__ import annotations

import pytest

from megatron_ext.config.validate import ConfigError
from megatron_ext.train import run_from_overrides

BASE = ["experiment=none", "launcher.nproc=4", "parallel.tp=2", "plugins=[reshard]", "train.iters=2"]

REFUSED = {
    "budget": ("reshard.memory_budget_mb=0", "reshard.memory_budget_mb"),
    "negative lead": ("reshard.prepare_steps_ahead=-1", "reshard.prepare_steps_ahead"),
    "layout the model cannot run": ("reshard.schedule=[{step: 2, layout: {tp: 3}}]", "parallel.tp"),
}


@pytest.mark.parametrize("override, field", REFUSED.values(), ids=REFUSED.keys())
def test_refused_before_launching(override, field):
    with pytest.raises(ConfigError) as refused:
        run_from_overrides([*BASE, override])
    assert refused.value.field == field
