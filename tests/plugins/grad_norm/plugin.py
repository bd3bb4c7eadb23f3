"""`plugins=[grad_norm]`: after every `every`-th step, the norm of each layer's gradient, logged
(one line) and, with `file`, appended to a JSON-lines file with megatron's own grad norm of the
step beside it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from megatron_ext.plugin import Plugin, PluginContext, register_plugin

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class GradNormConfig:
    every: int = 10
    file: str = ""


@register_plugin
class GradNormPlugin(Plugin):
    name = "grad_norm"
    config_class = GradNormConfig

    def check(self, cfg, world_size: int) -> None:
        from megatron_ext.config.validate import ConfigError

        if self.cfg.every < 1:
            raise ConfigError("grad_norm.every", f"must be at least 1, got {self.cfg.every}")

    def on_step_end(self, ctx: PluginContext, step: int, metrics: dict) -> None:
        if step % self.cfg.every:
            return
        norms = {name: math.sqrt(sq) for name, sq in _squared_norms(ctx.model).items()}
        total = math.sqrt(sum(n * n for n in norms.values()))
        ctx.note(f"step {step}: grad norm {total:.4g}; " + ", ".join(f"{k} {v:.4g}" for k, v in norms.items()))
        if self.cfg.file:
            with open(self.cfg.file, "a") as f:
                f.write(json.dumps({"step": step, "layers": norms, "total": total, "megatron": metrics.get("grad_norm")}) + "\n")


def _squared_norms(model_chunks: list) -> dict[str, float]:
    """Squared norm of the gradient (the DDP buffer's `main_grad`) by layer; the rest under
    "other". One rank's view: no model parallelism."""
    squares: dict[str, float] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            match = _LAYER.search(name)
            key = f"layer {match.group(1)}" if match else "other"
            squares[key] = squares.get(key, 0.0) + float(param.main_grad.double().pow(2).sum())
    return squares
