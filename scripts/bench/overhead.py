"""What a training step costs beyond its math: a plain PyTorch loop, a bare Megatron-Core loop and
megatron_ext's Trainer on the same model shapes, batch and machine, side by side in one run.

    python scripts/bench/overhead.py --json scripts/bench/results/overhead_cpu.json --plot

The three ways, each in fresh worker processes (`launch_local`, gloo, one rank per process):

- `plain`: `transformers`' `LlamaForCausalLM` (SDPA attention), torch's DDP where DP > 1 (its
  micro-batches under `no_sync` but the last), AdamW, gradient clipping;
- `megatron_core`: megatron-core's own `GPTModel` from its local layer spec (its unfused
  `DotProductAttention`, where the Trainer's local layers use torch's SDPA), its DDP and
  distributed optimizer, `get_forward_backward_func()`, on megatron_ext's platform layer, no
  Trainer;
- `megatron_ext`: the Trainer's loop as `python -m megatron_ext.train` runs it (its data
  pipeline, logging, checks and hooks), timed between consecutive steps by a plugin.

Each way runs `--rounds` times, the ways interleaved, and is reported by its median round (a
load that drifts during the run reaches every way alike). A run reports tokens per second over the
timed steps (after warm-up), the peak resident set of its processes, and where a step's time goes: data, forward, backward, grad sync, optimizer and the
rest (the loop itself: logging, metrics, checks). The megatron loops' phases come from the timers
megatron-core's schedules and optimizer call (`config.timers`). With `--trace`, the Trainer of
the row with the lowest ratio to the plain loop is profiled with `torch.profiler` for a few
steps: the trace file and its top operators are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

WAYS = ("plain", "megatron_core", "megatron_ext")
PHASES = ("data", "forward", "backward", "grad_sync", "optimizer", "rest")


@dataclasses.dataclass(frozen=True)
class Row:
    """One workload: a model preset of megatron_ext at a batch, on `nproc` data-parallel ranks."""

    model: str
    nproc: int
    global_batch: int
    micro_batch: int
    seq_length: int
    overrides: tuple[str, ...] = ()


ROWS = {
    "llama_tiny_dp2": Row("llama_tiny", nproc=2, global_batch=16, micro_batch=4, seq_length=128),
    "smollm2_135m": Row("smollm2_135m", nproc=1, global_batch=4, micro_batch=4, seq_length=256,
                        overrides=("model.pretrained=null",)),
}


def trainer_overrides(row: Row, iters: int) -> list[str]:
    """The megatron_ext run of a row, as a user would write it on the command line."""
    return [
        "experiment=none", f"model={row.model}", *row.overrides,
        f"launcher.nproc={row.nproc}", f"parallel.dp={row.nproc}",
        f"train.global_batch_size={row.global_batch}", f"train.micro_batch_size={row.micro_batch}",
        f"model.seq_length={row.seq_length}", f"train.iters={iters}", "train.eval_interval=0",
        "logging.progress_bar=false",
    ]


# --- timing -------------------------------------------------------------------------------------


class PhaseClock:
    """Wall-clock seconds per named phase, in the shape megatron-core's `config.timers` calls:
    `timers(name, log_level).start()` / `.stop()`. CPU work is synchronous, so wall time is the
    phase's time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def __call__(self, name: str, log_level: int = 0) -> "PhaseClock._Phase":
        return PhaseClock._Phase(self, name)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return seconds

    @dataclasses.dataclass
    class _Phase:
        clock: "PhaseClock"
        name: str

        def start(self, barrier: bool = False) -> None:
            self.clock._started[self.name] = time.perf_counter()

        def stop(self, barrier: bool = False) -> None:
            self.clock.add(self.name, time.perf_counter() - self.clock._started.pop(self.name))


def timed_iterator(iterator, clock: PhaseClock):
    """`iterator`, the time of each `next` counted as the data phase."""
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        clock.add("data", time.perf_counter() - start)
        yield item


def timed_method(obj, name: str, clock: PhaseClock, phase: str) -> None:
    """Count the time of `obj.name(...)` as `phase` (the instance's attribute, not its class)."""
    method = getattr(obj, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            clock.add(phase, time.perf_counter() - start)

    setattr(obj, name, call)


def megatron_phases(seconds: dict[str, float]) -> dict[str, float]:
    """megatron-core's timer names as this benchmark's phases; `forward-compute` includes the
    forward step's `next(data_iterator)`."""
    data = seconds.get("data", 0.0)
    return {
        "data": data,
        "forward": seconds.get("forward-compute", 0.0) - data,
        "backward": seconds.get("backward-compute", 0.0),
        "grad_sync": seconds.get("all-grads-sync", 0.0),
        "optimizer": seconds.get("optimizer", 0.0),
    }


def rank_result(step_ends: list[float], phases: list[dict], warmup: int, tokens_per_step: int) -> dict:
    """One rank's measurement over the steps after `warmup`: per-step seconds, tokens/s, the mean
    seconds of each phase per step (`rest` being the step's time the phases leave) and peak RSS."""
    steps = [b - a for a, b in zip(step_ends[warmup:], step_ends[warmup + 1:])]
    timed = phases[warmup + 1:]
    mean = {p: statistics.fmean(ph.get(p, 0.0) for ph in timed) for p in PHASES[:-1]}
    mean["rest"] = statistics.fmean(steps) - sum(mean.values())
    return {
        "step_s": steps,
        "tokens_per_s": tokens_per_step * len(steps) / sum(steps),
        "phases_s": mean,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
    }


# --- the three ways (each runs on every rank of a launch) --------------------------------------


def synthetic_batches(vocab: int, row: Row, dp: int, rank: int, seed: int = 0):
    """Endless micro-batches of random tokens for the baselines: (tokens, labels), shifted by one."""
    import torch  # in the worker: the launcher process stays light

    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        sample = torch.randint(0, vocab, (row.micro_batch, row.seq_length + 1), generator=generator)
        yield sample[:, :-1].contiguous(), sample[:, 1:].contiguous()


def run_plain(row: Row, vocab: int, steps: int, warmup: int) -> dict:
    """transformers' LLaMA under torch DDP with AdamW: what a PyTorch user writes by hand."""
    import torch  # in the worker
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    m = MODEL_PRESETS[row.model]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads, head_dim=m.head_dim,
        max_position_embeddings=row.seq_length, rms_norm_eps=m.norm_epsilon, rope_theta=m.rotary_base,
        tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa",
    ))
    dp = dist.get_world_size()
    ddp = DistributedDataParallel(model) if dp > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    micro_batches = row.global_batch // (row.micro_batch * dp)
    batches, clock = synthetic_batches(vocab, row, dp, dist.get_rank()), PhaseClock()
    step_ends, phases = [], []
    for _ in range(steps + warmup + 1):
        for i in range(micro_batches):
            start = time.perf_counter()
            tokens, labels = next(batches)
            clock.add("data", time.perf_counter() - start)
            last = i == micro_batches - 1
            with ddp.no_sync() if dp > 1 and not last else _nothing():
                start = time.perf_counter()
                logits = ddp(tokens).logits
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1)) / micro_batches
                clock.add("forward", time.perf_counter() - start)
                start = time.perf_counter()
                loss.backward()  # the last micro-batch's includes DDP's overlapped all-reduce
                clock.add("backward", time.perf_counter() - start)
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.add("optimizer", time.perf_counter() - start)
        step_ends.append(time.perf_counter())
        phases.append(clock.pop())
    dist.destroy_process_group()
    return rank_result(step_ends, phases, warmup, row.global_batch * row.seq_length)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_megatron_core(row: Row, vocab: int, steps: int, warmup: int) -> dict:
    """megatron-core's own parts in the loop its README shows: no Trainer, no megatron_ext model code."""
    import torch  # in the worker
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    m = MODEL_PRESETS[row.model]
    dp = dist.get_world_size()
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim, normalization="RMSNorm", layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        calculate_per_token_loss=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab, row.seq_length,
                   share_embeddings_and_output_weights=m.tie_embeddings, position_embedding_type="rope",
                   rotary_base=int(m.rotary_base))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), gpt)
    clock = PhaseClock()
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0,
        use_distributed_optimizer=True), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    config.timers = clock
    timed_method(optimizer, "step", clock, "optimizer")
    micro_batches = row.global_batch // (row.micro_batch * dp)
    init_num_microbatches_calculator(dist.get_rank(), None, row.global_batch, row.micro_batch, dp)
    positions = torch.arange(row.seq_length).unsqueeze(0).expand(row.micro_batch, -1)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, positions, None, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().sum()
            return loss, torch.tensor(labels.numel(), dtype=torch.int), {"lm loss": loss.detach()}

        return output, loss_func

    batches = timed_iterator(synthetic_batches(vocab, row, dp, dist.get_rank()), clock)
    step_ends, phases = [], []
    for _ in range(steps + warmup + 1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches, model=[ddp], num_microbatches=micro_batches,
            seq_length=row.seq_length, micro_batch_size=row.micro_batch, forward_only=False,
        )
        optimizer.step()
        step_ends.append(time.perf_counter())
        phases.append(megatron_phases(clock.pop()))
    dist.destroy_process_group()
    return rank_result(step_ends, phases, warmup, row.global_batch * row.seq_length)


def run_megatron_ext(row: Row, steps: int, warmup: int, trace: Optional[str] = None) -> dict:
    """The Trainer as `python -m megatron_ext.train` builds it, timed from step end to step end."""
    import torch.distributed as dist  # in the worker

    from megatron_ext.config.store import compose_config
    from megatron_ext.plugin import Plugin
    from megatron_ext.platform.launch import join_world
    from megatron_ext.training.trainer import Trainer

    clock, step_ends, phases = PhaseClock(), [], []

    class StepClock(Plugin):
        name = "step_clock"

        def setup(self, ctx) -> None:
            pass

        def on_step_end(self, ctx, step: int, metrics: dict) -> None:
            step_ends.append(time.perf_counter())
            phases.append(megatron_phases(clock.pop()))
            if profiler is not None:
                profiler.step()

    cfg = compose_config(trainer_overrides(row, steps + warmup + 1))
    join_world("cpu")
    trainer = Trainer(cfg, [StepClock()])
    trainer.setup()
    for chunk in trainer.model:
        chunk.config.timers = clock
    timed_method(trainer.optimizer, "step", clock, "optimizer")
    trainer.train_iter = timed_iterator(trainer.train_iter, clock)
    profiler = _profiler(trace, warmup) if trace and dist.get_rank() == 0 else None
    if profiler is not None:
        profiler.start()
    trainer.train()
    result = rank_result(step_ends, phases, warmup, row.global_batch * row.seq_length)
    result["vocab_size"] = trainer.vocab_size
    if profiler is not None:
        profiler.stop()
        result["top_ops"] = _top_ops(profiler)
    trainer.close()
    dist.destroy_process_group()
    return result


def _profiler(trace: str, warmup: int):
    import torch.profiler  # in the worker, only with --trace

    def save(prof) -> None:
        prof.export_chrome_trace(trace)

    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=warmup, warmup=1, active=3, repeat=1),
        on_trace_ready=save,
        record_shapes=False,
    )


def _top_ops(profiler, count: int = 15) -> list[dict]:
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in events]


# --- driver -------------------------------------------------------------------------------------


def launch(nproc: int, fn, *args) -> dict:
    """`fn(*args)` on `nproc` fresh local worker processes; the slowest rank's figures (the
    ranks of a DP step wait for each other) and the largest resident set."""
    from megatron_ext.platform.launch import free_port, launch_local  # torch: after argument parsing

    ranks = launch_local(nproc, fn, args, "127.0.0.1", free_port())
    slowest = min(ranks.values(), key=lambda r: r["tokens_per_s"])
    traced = [r["top_ops"] for r in ranks.values() if "top_ops" in r]  # rank 0's, which may not be the slowest
    return {**slowest, "peak_rss_gb": max(r["peak_rss_gb"] for r in ranks.values()), **({"top_ops": traced[0]} if traced else {})}


def measure_row(row: Row, steps: int, warmup: int, rounds: int) -> dict:
    """Every way `rounds` times, interleaved (round r starts at way r, so none always runs first
    on a machine whose load drifts); each way is reported by its median round, with every
    round's tokens/s beside it."""
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    vocab = None
    for r in range(rounds):
        order = list(WAYS[r % len(WAYS):] + WAYS[: r % len(WAYS)])
        if vocab is None:  # the baselines take the vocabulary the Trainer's tokenizer padded
            order.remove("megatron_ext")
            order.insert(0, "megatron_ext")
        for way in order:
            if way == "megatron_ext":
                result = launch(row.nproc, run_megatron_ext, row, steps, warmup, None)
                vocab = result["vocab_size"]
            else:
                result = launch(row.nproc, run_plain if way == "plain" else run_megatron_core, row, vocab, steps, warmup)
            runs[way].append(result)
    ways = {way: median_run(runs[way]) for way in WAYS}
    tps = {way: r["tokens_per_s"] for way, r in ways.items()}
    return {
        "row": dataclasses.asdict(row),
        "ways": ways,
        "ratios": {
            "megatron_ext_vs_plain": tps["megatron_ext"] / tps["plain"],
            "megatron_ext_vs_megatron_core": tps["megatron_ext"] / tps["megatron_core"],
            "megatron_core_vs_plain": tps["megatron_core"] / tps["plain"],
            "peak_rss_megatron_ext_vs_plain": ways["megatron_ext"]["peak_rss_gb"] / ways["plain"]["peak_rss_gb"],
        },
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count), with every run's
    tokens/s as `rounds_tokens_per_s`."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs]}


# Issue targets: at least the plain loop's and the bare Megatron-Core loop's tokens/s on every row;
# peak RSS at most 1.05x the plain loop's on the SmolLM2 row.
TARGETS = {"megatron_ext_vs_plain": ("at_least", 1.0), "megatron_ext_vs_megatron_core": ("at_least", 1.0)}
RSS_TARGET = ("smollm2_135m", "peak_rss_megatron_ext_vs_plain", "at_most", 1.05)


def judge(rows: dict) -> dict:
    """Each target, judged on every measured row it applies to."""
    targets = {}
    for name, row in rows.items():
        for ratio, (kind, bound) in TARGETS.items():
            value = row["ratios"][ratio]
            targets[f"{name}: {ratio}"] = {kind: bound, "value": value, "met": value >= bound}
    row_name, ratio, kind, bound = RSS_TARGET
    if row_name in rows:
        value = rows[row_name]["ratios"][ratio]
        targets[f"{row_name}: {ratio}"] = {kind: bound, "value": value, "met": value <= bound}
    return targets


def plot(result: dict, path: str) -> None:
    import matplotlib  # checked at the start (--plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], rows.items()):
        bottom = [0.0] * len(WAYS)
        for phase in PHASES:
            heights = [r["ways"][w]["phases_s"][phase] * 1e3 for w in WAYS]
            ax.bar(WAYS, heights, bottom=bottom, label=phase)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_title(name)
        ax.set_ylabel("ms per step (slowest rank)")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where the results go")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per way")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way, interleaved; the median is reported")
    parser.add_argument("--plot", action="store_true", help="a PNG beside the JSON (matplotlib)")
    parser.add_argument("--trace", help="a torch.profiler trace of the Trainer of the lowest-ratio row")
    args = parser.parse_args(argv)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; known: {list(ROWS)}")
    require(__file__, {"matplotlib": "--plot" if args.plot else None, "transformers": "the plain loop"})
    started = time.perf_counter()
    result = {"provenance": provenance(__file__), "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
              "rows": {}}
    for name in args.rows.split(","):
        result["rows"][name] = measure_row(ROWS[name], args.steps, args.warmup, args.rounds)
        Path(args.json).write_text(json.dumps(result, indent=1))  # each finished row kept
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in result["rows"][name]["ratios"].items()), flush=True)
    if args.trace:
        name = min(result["rows"], key=lambda n: result["rows"][n]["ratios"]["megatron_ext_vs_plain"])
        traced = launch(ROWS[name].nproc, run_megatron_ext, ROWS[name], 4, 2, args.trace)
        result["trace"] = {"row": name, "file": args.trace, "top_ops": traced["top_ops"]}
    result["targets"] = judge(result["rows"])
    result["wall_s"] = time.perf_counter() - started
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, str(Path(args.json).with_suffix(".png")))


if __name__ == "__main__":
    main()
