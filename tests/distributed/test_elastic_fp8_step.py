"""The elastic plugin computes each FP8 scale once per call of megatron's schedule: a training
step (every micro-batch's forward and backward) or an evaluation, never per read.

One process, in this process (no workers: the plugin's calls are counted where they run), GPT
parent of 8 quantised linears, two micro-batches per step. Without the plugin's window every
read recomputes (and under TP reduces) the scale: 24 computations per step (measured); with a
window kept across steps, a step after the first would compute none and read the scale of the
weights before the optimizer's update.
"""

from __future__ import annotations

import pytest

from test_elastic_plugin import COMMON

pytestmark = [pytest.mark.slow]

LINEARS = 8  # qkv, proj, fc1, fc2 of two layers


def test_each_step_and_evaluation_computes_every_scale_once(tmp_path, monkeypatch):
    from megatron_ext.elastic import fp8
    from megatron_ext.elastic.plugin import ElasticPlugin
    from megatron_ext.train import run_from_overrides
    from megatron_ext.training.trainer import Trainer

    computed: list = []
    scale_of = fp8.scale_of
    monkeypatch.setattr(fp8, "scale_of", lambda *a, **k: computed.append(a[0]) or scale_of(*a, **k))
    per_step, per_eval = [], []
    step_begin, step_end, evaluate = ElasticPlugin.on_step_begin, ElasticPlugin.on_step_end, Trainer.evaluate

    def begin(self, trainer, step):
        step_begin(self, trainer, step)
        computed.clear()

    def end(self, trainer, step, metrics):
        per_step.append([id(w) for w in computed])
        step_end(self, trainer, step, metrics)

    def evaluation(self):
        computed.clear()
        try:
            return evaluate(self)
        finally:
            per_eval.append([id(w) for w in computed])

    monkeypatch.setattr(ElasticPlugin, "on_step_begin", begin)
    monkeypatch.setattr(ElasticPlugin, "on_step_end", end)
    monkeypatch.setattr(Trainer, "evaluate", evaluation)
    run_from_overrides(
        [*COMMON, f"data.cache_dir={tmp_path / 'cache'}", "elastic.fp8=true", "train.iters=3",
         "train.eval_interval=2", "train.eval_iters=1"]
    )
    assert len(per_step) == 3 and len(per_eval) == 2  # iteration 2's and the final evaluation
    for ids in [*per_step, *per_eval]:
        assert len(ids) == len(set(ids)) == LINEARS, len(ids)
