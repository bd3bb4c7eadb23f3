"""Every hook of the plugin protocol is called, in order, with what it promises.

A recording plugin is registered in a child process (plugins contribute a config section, which
must exist before the first config is composed), trains, saves, and resumes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.distributed

RECORDER = textwrap.dedent(
    """
    import json, sys
    from dataclasses import dataclass

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.plugin import Plugin, register_plugin

    CALLS = []

    @dataclass
    class RecorderConfig:
        tag: str = "default"

    @register_plugin
    class Recorder(Plugin):
        name = "recorder"
        config_class = RecorderConfig
        needs_step_loss = True  # on_step_end reads metrics["loss"]

        def check(self, cfg, world_size):
            CALLS.append(["check", world_size])

        def check_layout(self, cfg, world_size):
            CALLS.append(["check_layout", cfg.parallel.pp])

        def setup(self, trainer):
            CALLS.append(["setup", self.cfg.tag])

        def layer_spec(self, spec, trainer):
            CALLS.append(["layer_spec", type(spec).__name__])
            return spec

        def after_model_built(self, chunks, trainer):
            CALLS.append(["after_model_built", len(chunks)])
            return chunks

        def forward_backward_func(self, trainer):
            inner = get_forward_backward_func()

            def counted(**kwargs):
                CALLS.append(["forward_backward", kwargs["forward_only"]])
                return inner(**kwargs)

            return counted

        def on_step_begin(self, trainer, step):
            CALLS.append(["on_step_begin", step])

        def on_step_end(self, trainer, step, metrics):
            CALLS.append(["on_step_end", step, round(metrics["loss"], 3) > 0])

        def state_dict(self):
            return {"last": CALLS[-1][0]}

        def load_state_dict(self, state):
            CALLS.append(["load_state_dict", state])

        def on_train_end(self, trainer):
            CALLS.append(["on_train_end"])

    if __name__ == "__main__":
        from megatron_ext.train import run_from_overrides

        run_from_overrides(sys.argv[2:])
        with open(sys.argv[1], "w") as f:
            json.dump(CALLS, f)
    """
)

COMMON = [
    "experiment=none",
    "plugins=[recorder]",
    "recorder.tag=from_cli",
    "train.eval_interval=2",
    "train.eval_iters=1",
    "logging.progress_bar=false",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


def run_recorder(tmp_path, name: str, *overrides: str) -> list:
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(script), str(out), *COMMON, f"data.cache_dir={tmp_path / 'cache'}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_hook_is_called(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_recorder(tmp_path, "first", "train.iters=2", f"checkpoint.save={ckpt}")
    assert first == [
        ["check", 1],  # in the launching process, before any worker starts
        ["check_layout", 1],  # the run's first layout
        ["setup", "from_cli"],
        ["layer_spec", "ModuleSpec"],
        ["after_model_built", 1],
        ["on_step_begin", 1],
        ["forward_backward", False],
        ["on_step_end", 1, True],
        ["on_step_begin", 2],
        ["forward_backward", False],
        ["on_step_end", 2, True],
        ["forward_backward", True],  # evaluation at step 2
        ["on_train_end"],
    ]
    resumed = run_recorder(
        tmp_path, "resumed", "train.iters=3", f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}"
    )
    # The state saved at step 2 (its last call then was the evaluation) comes back on resume.
    assert ["load_state_dict", {"last": "forward_backward"}] in resumed
    assert ["on_step_begin", 3] in resumed and ["on_step_begin", 1] not in resumed


def test_unknown_plugin_is_a_config_error(tmp_path):
    from megatron_ext.config import compose_config
    from megatron_ext.config.validate import ConfigError, validate

    cfg = compose_config(["experiment=none", "plugins=[no_such_plugin]"])
    with pytest.raises(ConfigError, match="plugins"):
        validate(cfg, 1)
