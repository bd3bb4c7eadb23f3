"""What a person watching the run sees: a progress bar, log lines, TensorBoard, optional W&B.

Only one rank reports: the last rank of the world, which sits on the last pipeline stage and
therefore holds the loss.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from megatron_ext.config.schema import LoggingConfig


class MetricsReporter:
    def __init__(self, cfg: LoggingConfig, total_iters: int, start_iter: int, is_reporting_rank: bool):
        self.cfg = cfg
        self.active = is_reporting_rank
        self.total_iters = total_iters
        self._bar = None
        self._tb = None
        self._wandb = None
        self._window_tokens = 0
        self._window_start = time.perf_counter()
        self.tokens_total = 0
        self.train_seconds = 0.0
        self.losses: list[float] = []
        self.notes: list[str] = []
        if not self.active:
            return
        if cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_iters, initial=start_iter, desc="train", unit="it", file=sys.stdout,
                dynamic_ncols=True, mininterval=0.5,
            )
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=cfg.tensorboard_dir)
        if cfg.wandb_project:
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project)

    def step(self, iteration: int, metrics: dict, tokens: int, seconds: float) -> None:
        """Record a finished training step; `metrics` holds loss, lr, grad_norm, ..."""
        self.losses.append(metrics["loss"])
        self.tokens_total += tokens
        self.train_seconds += seconds
        self._window_tokens += tokens
        if not self.active:
            return
        tps = tokens / seconds if seconds > 0 else 0.0
        metrics = {**metrics, "tokens_per_s": tps}
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
            self._bar.update(1)
        if iteration % self.cfg.log_interval == 0:
            self._write_line(iteration, metrics)
        self._scalars("train", iteration, metrics)

    def eval(self, iteration: int, loss: float) -> None:
        if not self.active:
            return
        self._print(f"eval  iter {iteration:6d} | loss {loss:.4f}")
        self._scalars("eval", iteration, {"loss": loss})

    def note(self, line: str) -> None:
        self.notes.append(line)
        if self.active:
            self._print(line)

    def _write_line(self, iteration: int, m: dict) -> None:
        now = time.perf_counter()
        tps = self._window_tokens / max(now - self._window_start, 1e-9)
        self._window_tokens, self._window_start = 0, now
        self._print(
            f"iter {iteration:6d}/{self.total_iters} | loss {m['loss']:.4f} | lr {m['lr']:.3e}"
            f" | grad norm {m['grad_norm']:.3f} | tokens/s {tps:,.0f}"
        )

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def _scalars(self, prefix: str, iteration: int, metrics: dict) -> None:
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(f"{prefix}/{key}", value, iteration)
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in metrics.items()}, step=iteration)

    def summary(self, final_loss: Optional[float], eval_loss: Optional[float]) -> dict:
        tps = self.tokens_total / self.train_seconds if self.train_seconds else 0.0
        result = {
            "final_loss": final_loss,
            "eval_loss": eval_loss,
            "tokens": self.tokens_total,
            "train_seconds": round(self.train_seconds, 2),
            "tokens_per_s": round(tps, 1),
        }
        if self.active:
            if self._bar is not None:
                self._bar.close()
            parts = [f"{k} {v:.4f}" if "loss" in k and v is not None else f"{k} {v}" for k, v in result.items()]
            print("summary | " + " | ".join(parts), flush=True)
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()
        # Per-step losses and notes of this invocation, for tests and scripts; not printed.
        return {**result, "losses": self.losses, "notes": self.notes}
