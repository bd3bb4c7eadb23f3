"""What a person watching the run sees: a progress bar, log lines, TensorBoard, optional W&B.

Only one rank reports (rank 0; the loss is broadcast to every rank). Megatron-LM's logging
switches add to the log line and TensorBoard: the parameter norm and the zeros in the gradients
(`train/params_norm`, `train/num_zeros_in_grad`), the model's TFLOP/s per rank
(`train/throughput`, Megatron-LM's count of operations), the step's phases (`timers/...-time`),
memory (`memory/...`) and the validation perplexity (`eval/ppl`, exp of the loss capped at 20 as
Megatron-LM caps it). Memory on a GPU is the CUDA allocator's (Megatron-LM's four numbers); on
the CPU there is no allocator to ask, so it is the reporting process's resident set and its peak
as the operating system counts them.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Optional

import psutil
import torch
from tqdm import tqdm

from megatron_ext.config.schema import LoggingConfig
from megatron_ext.platform.device import current_device

# Megatron-LM caps the exponent of the reported perplexity.
PPL_MAX_LOSS = 20.0


def perplexity(loss: float) -> float:
    return math.exp(min(PPL_MAX_LOSS, loss))


def memory_stats() -> dict[str, float]:
    """This process's memory: the CUDA allocator's counters, or on the CPU the resident set."""
    if current_device().type == "cuda":
        stats = torch.cuda.memory_stats()
        return {
            "reserved_bytes": stats["reserved_bytes.all.current"],
            "allocated_bytes": stats["allocated_bytes.all.current"],
            "max_allocated_bytes": stats["allocated_bytes.all.peak"],
            "allocated_count": stats["allocation.all.current"],
        }
    return {
        "rss_bytes": psutil.Process().memory_info().rss,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
    }


class MetricsReporter:
    def __init__(
        self,
        cfg: LoggingConfig,
        total_iters: int,
        start_iter: int,
        is_reporting_rank: bool,
        world_size: int = 1,
    ):
        self.cfg = cfg
        self.active = is_reporting_rank
        self.total_iters = total_iters
        self.world_size = world_size
        self._window_seconds = 0.0
        # Operations of the window's steps over the whole world (None: not counted for this model).
        self._window_flops: Optional[float] = 0.0
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
            self._bar = tqdm(
                total=total_iters, initial=start_iter, desc="train", unit="it", file=sys.stdout,
                dynamic_ncols=True, mininterval=0.5,
            )
        if cfg.tensorboard_dir:
            # heavy: tensorboard (~0.1 s a rank), only with logging.tensorboard_dir
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=cfg.tensorboard_dir)
        if cfg.wandb_project:
            import wandb  # optional: wandb

            self._wandb = wandb.init(project=cfg.wandb_project)

    def step(
        self,
        iteration: int,
        metrics: dict,
        tokens: int,
        seconds: float,
        timers: Optional[dict] = None,
        flops: Optional[float] = None,
    ) -> None:
        """Record a finished training step; `metrics` holds loss, lr, the step's global batch
        and the samples consumed, grad_norm (not on a step the fp16 loss scaler skipped) and
        what the logging switches add (params_norm, num_zeros_in_grad); `timers`: seconds per
        phase; `flops`: the step's operations over the whole world (None: not counted for
        this model). `metrics` holds the loss only where the losses were read after this step
        (`record_losses`): always on log steps."""
        self.tokens_total += tokens
        self.train_seconds += seconds
        self._window_tokens += tokens
        self._window_seconds += seconds
        self._window_flops = None if flops is None or self._window_flops is None else self._window_flops + flops
        if not self.active:
            return
        tps = tokens / seconds if seconds > 0 else 0.0
        metrics = {**metrics, "tokens_per_s": tps}
        if self.cfg.log_throughput and flops is not None:
            metrics["throughput"] = self._tflops_per_rank(flops, seconds)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{self.losses[-1]:.4f}" if self.losses else "-", tok_s=f"{tps:,.0f}", refresh=False)
            self._bar.update(1)
        if iteration % self.cfg.log_interval == 0:
            self._write_line(iteration, metrics)
        self._scalars("train", iteration, {k: v for k, v in metrics.items() if k != "loss"})
        if self.cfg.log_timers_to_tensorboard:
            phases = {"iteration": seconds, **(timers or {})}
            self._scalars("timers", iteration, {f"{name}-time": t for name, t in phases.items()})
        if self.cfg.log_memory_to_tensorboard:
            self._scalars("memory", iteration, memory_stats())

    def record_losses(self, losses: dict[int, float]) -> None:
        """The losses of the steps since the last read, by iteration (read on log steps, or every
        step where TensorBoard or W&B are on: training/step.py's PendingLosses)."""
        for iteration, loss in losses.items():
            self.losses.append(loss)
            if self.active:
                self._scalars("train", iteration, {"loss": loss})

    def _tflops_per_rank(self, flops: float, seconds: float) -> float:
        return flops / (max(seconds, 1e-9) * 1e12 * self.world_size)

    def eval(self, iteration: int, loss: float, split: str = "eval") -> None:
        """A held-out loss: the validation set (`eval`) or, at the end, the test set (`test`)."""
        if not self.active:
            return
        ppl = perplexity(loss)
        self._print(f"{split:5s} iter {iteration:6d} | loss {loss:.4f} | ppl {ppl:.4f}")
        scalars = {"loss": loss}
        if self.cfg.log_validation_ppl_to_tensorboard:
            scalars["ppl"] = ppl
        self._scalars(split, iteration, scalars)

    def note(self, line: str) -> None:
        self.notes.append(line)
        if self.active:
            self._print(line)

    def _write_line(self, iteration: int, m: dict) -> None:
        now = time.perf_counter()
        tps = self._window_tokens / max(now - self._window_start, 1e-9)
        line = f"iter {iteration:6d}/{self.total_iters} | loss {m['loss']:.4f} | lr {m['lr']:.3e}"
        if "grad_norm" in m:  # not on a step the fp16 loss scaler skipped (Megatron-LM's line)
            line += f" | grad norm {m['grad_norm']:.3f}"
        line += f" | tokens/s {tps:,.0f}"
        if "consumed_samples" in m:
            line += f" | consumed samples {m['consumed_samples']} | global batch {m['global_batch_size']}"
        if "params_norm" in m:
            line += f" | params norm {m['params_norm']:.3f}"
        if "num_zeros_in_grad" in m:
            line += f" | num zeros {m['num_zeros_in_grad']:.0f}"
        line += "".join(f" | {k} {v:.4f}" for k, v in m.items() if k.startswith("mtp_"))
        if "throughput" in m:  # over the steps since the last line, as Megatron-LM's interval
            line += f" | TFLOP/s/rank {self._tflops_per_rank(self._window_flops, self._window_seconds):.3f}"
        if self.cfg.log_memory_to_tensorboard:
            line += " | " + " | ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in memory_stats().items() if k.endswith("bytes"))
        self._window_tokens, self._window_start = 0, now
        self._window_seconds, self._window_flops = 0.0, 0.0
        self._print(line)

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

    def summary(
        self, final_loss: Optional[float], eval_loss: Optional[float], test_loss: Optional[float] = None
    ) -> dict:
        """`eval_loss` / `test_loss`: the final evaluation's, on the validation and test sets."""
        tps = self.tokens_total / self.train_seconds if self.train_seconds else 0.0
        result = {
            "final_loss": final_loss,
            "eval_loss": eval_loss,
            "test_loss": test_loss,
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
