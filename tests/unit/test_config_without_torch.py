"""The configuration imports no torch, megatron or plugin module, by construction: composing a
config and checking it with the core's rules and every plugin's own checks (each plugin's
config.py) runs in a fresh process that never loads them. That is what makes bad input fast.

One fresh process composes and validates every case of the table, then reports the refusal of
each and the modules it loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

TINY = [
    "experiment=none", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=32", "launcher.nproc=1",
    # auto would ask torch whether it sees a GPU
    "launcher.device=cpu",
]
# name -> (overrides, the field the refusal names; None: accepted)
CASES = {
    "reshard_accepted": (["plugins=[reshard]", "launcher.nproc=2", "reshard.schedule=[{step: 2, layout: {tp: 2}}]"], None),
    "elastic_accepted": (["plugins=[elastic]"], None),
    "lora_accepted": (["plugins=[lora]"], None),
    "registered_accepted": (["plugins=[stride]"], None),
    "typo": (["train.itres=5"], "train.itres"),
    "all_four_plugins": (["plugins=[reshard,dpp,elastic,lora]"], "plugins"),
    "reshard_budget": (["plugins=[reshard]", "reshard.memory_budget_mb=0"], "reshard.memory_budget_mb"),
    "reshard_scheduled_layout": (["plugins=[reshard]", "reshard.schedule=[{step: 2, layout: {tp: 3}}]"], "parallel.tp"),
    "reshard_move_dpp_cannot_train": (["plugins=[reshard,dpp]", "launcher.nproc=2",
                                       "reshard.schedule=[{step: 2, layout: {cp: 2}}]"], "parallel.cp"),
    "dpp_policy": (["plugins=[dpp]", "dpp.policy=fastest"], "dpp.policy"),
    "dpp_cost_model": (["plugins=[dpp]"], "dpp.cost_model"),
    "elastic_layernorm": (["plugins=[elastic]", "model.normalization=LayerNorm"], "model.normalization"),
    "lora_moe": (["plugins=[lora]", "model.num_experts=4", "model.moe_ffn_hidden_size=64"], "model.num_experts"),
    "lora_sft_path": (["plugins=[lora]", "data=sft", "data.sft.path=[chat.jsonl]"], "data.sft.path"),
    "lora_sft_rendering": (["plugins=[lora]", "data=sft", "data.sft.path=[]"], None),
    "dpp_sft": (["plugins=[dpp]", "data=sft", "data.sft.path=[chat.jsonl]"], "data.sft.path"),
    # a plugin registered by its class (SCRIPT's): its own check and check_layout count
    "registered_check": (["plugins=[stride]", "stride.every=0"], "stride.every"),
    "registered_check_layout": (["plugins=[stride]", "parallel.tp=2", "launcher.nproc=2"], "parallel.tp"),
}

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from dataclasses import dataclass

    from megatron_ext.config import compose_config
    from megatron_ext.config.validate import ConfigError, validate_run
    from megatron_ext.plugin import Plugin, register_plugin

    @dataclass
    class StrideConfig:
        every: int = 10

    @register_plugin
    class Stride(Plugin):
        name = "stride"
        config_class = StrideConfig

        def check(self, cfg, world_size):
            if self.cfg.every < 1:
                raise ConfigError("stride.every", "must be at least 1")

        def check_layout(self, cfg, world_size):
            if cfg.parallel.tp > 1:
                raise ConfigError("parallel.tp", "stride runs without tensor parallelism")

    tiny, cases = json.loads(sys.argv[1])
    refused = {}
    for name, (overrides, _) in cases.items():
        try:
            cfg = compose_config([*tiny, *overrides])
            validate_run(cfg, cfg.launcher.nproc)
        except ConfigError as e:
            refused[name] = e.field
    print(json.dumps({"refused": refused, "modules": sorted(sys.modules)}))
    """
)


@pytest.fixture(scope="module")
def checked() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([TINY, CASES])], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_each_refusal_names_its_field(checked, case):
    assert checked["refused"].get(case) == CASES[case][1]


def test_no_torch_megatron_or_plugin_module_is_loaded(checked):
    ours = [m for m in checked["modules"] if m.startswith("megatron_ext.")]
    loaded = [m for m in checked["modules"] if m.split(".")[0] in ("torch", "megatron")]
    # the plugin protocol (megatron_ext.plugin) is SCRIPT's own import; the builtin plugins' are not
    loaded += [m for m in ours if m.endswith(".plugin") and m != "megatron_ext.plugin" or m.startswith("megatron_ext.training")]
    assert loaded == []


def test_importing_the_config_loads_no_torch():
    done = subprocess.run([sys.executable, "-c", "import megatron_ext.config, sys; assert 'torch' not in sys.modules"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


# command line -> the start of its one error line
COMMAND_LINES = {
    "typo": (["train.itres=5"], "error: train.itres: no such key"),
    # launcher.device=auto: without Transformer Engine the device decides nothing the rules check
    "rule": (["parallel.tp=3"], "error: parallel.tp: model.num_attention_heads (4) must be divisible by parallel.tp (3)"),
    # a multirun is composed before any plugin module is imported for it
    "multirun_typo": (["-m", "train.itres=5,6"], "error: train.itres: no such key"),
}


@pytest.mark.parametrize("overrides, said", COMMAND_LINES.values(), ids=COMMAND_LINES.keys())
def test_bad_command_lines_are_refused_without_torch(overrides, said):
    """`python -m megatron_ext.train ...`: the error names the key, exit 2, and no torch imported
    on the way (python -X importtime lists every module the process imports)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_ext.train", *overrides],
                          capture_output=True, text=True, timeout=120)
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and errors[0].startswith(said), errors
    assert [m for m in imported if m.split(".")[0] == "torch"] == []
