"""The first lent GPU's check: what megatron_ext does on one GPU, measured in at most 8 minutes.

Run through `scripts/gpu/check.sh` (docs/platform.md, "A lent GPU"). Four parts (the
throughput's two arms apart), each in a process of its own under a time cap, so that a part that
hangs, runs out of memory or crashes costs its cap and no more; the JSON (`--out`) is written
after every part, so a run cut short keeps what finished:

  unit_tests       the device-agnostic unit tests (DEVICE_TESTS) with `--device cuda`
  throughput       a bf16 ~1B LLaMA (Llama-3.2-1B's shapes) trained on one GPU by megatron_ext's
                   Trainer and by a plain PyTorch loop over transformers' LlamaForCausalLM of the
                   same shapes, same batch: step time, tokens/s, TFLOP/s by Megatron-LM's count
                   (training/flops.py) and MFU over the H100's bf16 dense peak
  lora_kernels     the LoRA kernels (reference, grouped GEMM, Triton) on one multi-adapter
                   shrink/expand forward and backward: error against fp32, step time
  elastic_latency  the elastic 50 % submodel of the same 1B parent against the parent: one
                   forward's median latency

`--dry-run` runs every part on the CPU (CUDA hidden from the parts) at tiny sizes in fp32, in
well under two minutes: what CI runs (tests/unit/test_gpu_check.py), so a lent GPU's minutes go
to measuring.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts" / "bench")]

from megatron_ext.config.schema import ModelConfig  # noqa: E402
from megatron_ext.platform.device import wall_clock  # noqa: E402
from megatron_ext.training.flops import flops_per_iteration  # noqa: E402
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py)

# The H100 SXM's dense bf16 peak (NVIDIA's datasheet, without sparsity), the MFU's denominator.
PEAK_TFLOPS = 989.0
# Unit tests that compute on the device `--device` names: the LoRA kernels against the
# reference, packed LoRA training against each job alone, packed SFT samples through the
# trainer's forward step against their conversations alone.
DEVICE_TESTS = (
    "tests/unit/test_lora_triton.py",
    "tests/unit/test_lora_packed.py::test_packed_equals_solo",
    "tests/unit/test_sft_packing_loss.py",
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs at."""

    model: dict  # ModelConfig fields of the throughput and elastic model
    micro_batch: int
    micro_batches: int  # per step, accumulated
    warmup_steps: int
    steps: int  # timed steps, fewer once `step_seconds` are spent
    step_seconds: float
    lora_rows: tuple[int, ...]  # rows of each adapter's segment
    lora_ranks: tuple[int, ...]
    lora_width: int  # in and out features of the adapted linear
    latency_batch: int
    repeats: int  # timed repeats of a LoRA step and of a forward
    caps: dict  # part -> seconds
    budget_s: float  # all parts together


# Llama-3.2-1B's shapes (1.24B parameters), bf16: 8 sequences of 2048 tokens per step in 4
# micro-batches of 2 (megatron's local attention keeps the scores, 0.5 GB a layer and tensor).
GPU = Sizes(
    model=dict(
        name="llama_1b", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
        num_query_groups=8, seq_length=2048, vocab_size=128256, tie_embeddings=True, rotary_base=500000.0,
        precision="bf16",
    ),
    micro_batch=2, micro_batches=4, warmup_steps=3, steps=15, step_seconds=30.0,
    lora_rows=(512, 512, 0, 1024, 256, 512, 768, 512), lora_ranks=(8, 16, 16, 32, 64, 8, 128, 16), lora_width=4096,
    latency_batch=4, repeats=20,
    caps={"unit_tests": 90, "throughput_megatron": 120, "throughput_plain": 90, "lora_kernels": 60, "elastic_latency": 80},
    # check.sh's pip install and the interpreter's start come out of the 8 minutes too
    budget_s=450,
)
DRY_RUN = Sizes(
    model=dict(
        name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        seq_length=32, vocab_size=512, tie_embeddings=True, precision="fp32",
    ),
    micro_batch=2, micro_batches=2, warmup_steps=1, steps=3, step_seconds=5.0,
    lora_rows=(5, 0, 37, 3), lora_ranks=(2, 8, 3, 17), lora_width=40,
    latency_batch=2, repeats=5,
    # bounds on a hang only: a loaded CI machine must not turn a slow part into a failed one
    caps={"unit_tests": 240, "throughput_megatron": 240, "throughput_plain": 240, "lora_kernels": 240, "elastic_latency": 240},
    budget_s=1200,
)


def sizes_for(dry_run: bool) -> Sizes:
    return DRY_RUN if dry_run else GPU


# --- the parts, each run in a process of its own ---------------------------------------------
# Each part imports the heavy modules it uses (megatron's model and trainer, transformers) in
# its own process, which the parent and the other parts then do not load.


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _peak_memory_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _throughput_row(sizes: Sizes, seconds: list[float], losses: list[float], padded_vocab: int,
                    device: torch.device) -> dict:
    model = ModelConfig(**sizes.model)
    batch = sizes.micro_batch * sizes.micro_batches
    step_s = statistics.median(seconds)
    tflops = flops_per_iteration(model, padded_vocab, batch) / step_s / 1e12
    return {
        "step_s": step_s,
        "step_s_each": seconds,
        "tokens_per_s": batch * model.seq_length / step_s,
        "tflops": tflops,
        "mfu": tflops / PEAK_TFLOPS,
        "peak_memory_gib": _peak_memory_gib(device),
        "losses": losses,
    }


def _timed_steps(sizes: Sizes, step: Callable[[], float], device: torch.device) -> tuple[list[float], list[float]]:
    """(seconds of each timed step, every step's loss): `warmup_steps` untimed, then up to
    `steps`, stopping once `step_seconds` are spent."""
    clock = wall_clock(device)
    seconds, losses = [], []
    for index in range(sizes.warmup_steps + sizes.steps):
        start = clock()
        losses.append(step())
        if index >= sizes.warmup_steps:
            seconds.append(clock() - start)
            if sum(seconds) > sizes.step_seconds:
                break
    return seconds, losses


def throughput_megatron(sizes: Sizes, work: Path) -> dict:
    """megatron_ext's Trainer in this process, one rank: megatron's GPTModel, DDP, distributed
    optimizer and schedule on mock data."""
    import torch.distributed as dist  # heavy: this part's own process (above)

    from megatron_ext.config import compose_config
    from megatron_ext.models.gpt import use_transformer_engine
    from megatron_ext.platform.launch import join_world
    from megatron_ext.training.trainer import Trainer

    _, device = join_world()
    batch = sizes.micro_batch * sizes.micro_batches
    cfg = compose_config([
        "experiment=none",
        *(f"model.{key}={value}" for key, value in sizes.model.items()),
        "data.mock=true",
        f"data.cache_dir={work / 'cache'}",
        f"train.micro_batch_size={sizes.micro_batch}",
        f"train.global_batch_size={batch}",
        f"train.iters={sizes.warmup_steps + sizes.steps}",
        "train.eval_iters=0",
        "optim.lr=1e-4",
        "optim.min_lr=1e-5",
        "logging.progress_bar=false",
    ])
    trainer = Trainer(cfg)
    trainer.setup()
    seconds, losses = _timed_steps(sizes, lambda: trainer.train_step_with_loss()["loss"], device)
    spec = "transformer_engine" if use_transformer_engine(cfg.model, device.type == "cpu") else "local"
    row = {**_throughput_row(sizes, seconds, losses, trainer.vocab_size, device), "layer_spec": spec}
    # Left only after a run that worked: after a failure the process ends with what failed.
    trainer.close()
    dist.destroy_process_group()
    return row


def throughput_plain(sizes: Sizes, work: Path) -> dict:
    """The baseline: transformers' LlamaForCausalLM of the same shapes (its config from
    megatron_ext's own export mapping) in a plain PyTorch loop: fp32 weights under bf16
    autocast, fused AdamW, the gradient clipped at 1 as megatron's, the same micro-batches."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: this part's own process (above)

    from megatron_ext.models.convert.hf_config import hf_config_from_model
    from megatron_ext.models.gpt import padded_vocab_size

    device = _device()
    model_cfg = ModelConfig(**sizes.model)
    vocab = padded_vocab_size(model_cfg.vocab_size, model_cfg, 1)
    fields = hf_config_from_model(model_cfg, vocab)
    torch.manual_seed(0)
    with device:  # drawn where it trains: a 1B model's initialisation on the CPU takes tens of seconds
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=device.type == "cuda"
    )
    generator = torch.Generator().manual_seed(0)
    shape = (sizes.micro_batch, model_cfg.seq_length)
    micro_batches = [torch.randint(0, model_cfg.vocab_size, shape, generator=generator).to(device)
                     for _ in range(sizes.micro_batches)]
    bf16 = model_cfg.precision == "bf16"

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for tokens in micro_batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=tokens, labels=tokens).loss / len(micro_batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(total)

    seconds, losses = _timed_steps(sizes, step, device)
    return {
        **_throughput_row(sizes, seconds, losses, vocab, device),
        "attention": model.config._attn_implementation,
        "precision": "bf16 autocast over fp32 weights" if bf16 else "fp32",
    }


def lora_kernels(sizes: Sizes, work: Path) -> dict:
    """Each LoRA kernel path (lora/runtime/kernels) on one forward and backward of the shrink
    and expand of several adapters' segments: the largest error of its outputs and gradients
    against the reference in fp32 (relative to the largest value), and the median step time.
    bf16 on a GPU; a path the device cannot run is skipped with select()'s reason."""
    from megatron_ext.lora.runtime import kernels  # heavy: this part's own process (above)
    from megatron_ext.lora.runtime.kernels import reference

    device = _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    width, rows, ranks = sizes.lora_width, sizes.lora_rows, sizes.lora_ranks
    scales = [2.0 / (1 + i) for i in range(len(ranks))]
    xs = [torch.randn(n, width, generator=generator) for n in rows]
    a = [torch.randn(r, width, generator=generator) / width**0.5 for r in ranks]
    b = [torch.randn(width, r, generator=generator) / r**0.5 for r in ranks]
    dy = torch.randn(sum(rows), width, generator=generator)

    def stepper(module, as_dtype) -> Callable[[], list]:
        """One forward and backward of `module` on the inputs in `as_dtype`; returns the output
        and the gradients of the inputs, A and B."""
        leaves = [t.to(device, as_dtype).requires_grad_() for t in xs + a + b]
        k, grad = len(ranks), dy.to(device, as_dtype)

        def step() -> list:
            for leaf in leaves:
                leaf.grad = None
            out = torch.cat(module.expand(module.shrink(leaves[:k], leaves[k:2 * k]), leaves[2 * k:], scales))
            out.backward(grad)
            return [out.detach(), *(leaf.grad for leaf in leaves)]

        return step

    wanted = stepper(reference, torch.float32)()
    clock = wall_clock(device)
    paths = {}
    for name in ("reference", "grouped", "triton"):
        try:
            module = kernels.select(device, dtype, name)
        except RuntimeError as refused:
            paths[name] = {"status": "skipped", "reason": str(refused)}
            continue
        try:
            step = stepper(module, dtype)
            got = step()  # the first also compiles the Triton kernels
            error = max(
                float((g.float() - w).abs().max() / w.abs().max().clamp(min=1e-30)) for g, w in zip(got, wanted) if w.numel()
            )
            times = []
            for _ in range(sizes.repeats):
                start = clock()
                step()
                times.append(clock() - start)
            paths[name] = {"status": "ok", "max_relative_error": error, "step_s": statistics.median(times)}
        except Exception as failed:  # a path that fails is a result; the others still run
            paths[name] = {"status": "failed", "error": f"{type(failed).__name__}: {failed}"[:500]}
    base = paths["reference"].get("step_s")
    for row in paths.values():
        if base and row.get("step_s"):
            row["speedup_over_reference"] = base / row["step_s"]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "segments": {"rows": list(rows), "ranks": list(ranks), "in_features": width, "out_features": width},
        "paths": paths,
    }


def elastic_latency(sizes: Sizes, work: Path) -> dict:
    """The elastic 50 % submodel against its parent: the parent's elastic space, its default
    grid (plugin.default_grid), the grid point whose parameters are nearest half the parent's
    among those within 10 %, and both exported as plain megatron models (slicing.export_submodel,
    the parent at its full sizes); each one forward's median latency, taken in turns."""
    from megatron_ext.elastic import slicing  # heavy: this part's own process (above)
    from megatron_ext.elastic.measure import forward_latencies
    from megatron_ext.elastic.plugin import default_grid
    from megatron_ext.elastic.router import cost_of
    from megatron_ext.elastic.size_search import candidates
    from megatron_ext.elastic.space import ElasticSpace
    from megatron_ext.models.convert.world import build_model, model_parallel_world
    from megatron_ext.models.gpt import padded_vocab_size
    from megatron_ext.models.init import init_weights_layout_independent

    cfg = ModelConfig(**sizes.model)
    padded = padded_vocab_size(cfg.vocab_size, cfg, 1)
    with model_parallel_world():
        (elastic,) = build_model(cfg, padded)
        init_weights_layout_independent([elastic], elastic.config, 0)
        space = ElasticSpace(elastic)
        grid = default_grid(space, 4)
        full = float(cost_of(space, space.full(), "params"))
        half = min(candidates(space, grid, 0.5, 0.1), key=lambda s: abs(float(cost_of(space, s, "params")) / full - 0.5))
        parent, _ = slicing.export_submodel(elastic, cfg, space, {k: space.full_of(k) for k in space.kinds}, padded, "parent")
        sub, _ = slicing.export_submodel(elastic, cfg, space, half, padded, "50")
        device = next(parent.parameters()).device
        tokens = torch.randint(0, cfg.vocab_size, (sizes.latency_batch, cfg.seq_length),
                               generator=torch.Generator().manual_seed(0)).to(device)
        latency = forward_latencies({"parent": parent, "50": sub}, tokens, sizes.repeats)
        params = {"parent": slicing.param_count(parent), "50": slicing.param_count(sub)}
    return {
        "grid": grid,
        "sizes_50": half,
        "params": params,
        "params_fraction": params["50"] / params["parent"],
        "tokens": list(tokens.shape),
        "latency_s": latency,
        "latency_ratio": latency["50"] / latency["parent"],
    }


PARTS: dict[str, Callable[[Sizes, Path], dict]] = {
    "throughput_megatron": throughput_megatron,
    "throughput_plain": throughput_plain,
    "lora_kernels": lora_kernels,
    "elastic_latency": elastic_latency,
}
ORDER = ("unit_tests", *PARTS)


# --- the parent: caps, the JSON ---------------------------------------------------------------


@dataclasses.dataclass
class Finished:
    status: str  # ok | failed | timeout
    seconds: float
    exit_code: Optional[int]
    log_tail: str  # the end of what it printed

    def record(self, cap: float) -> dict:
        record = {"status": self.status, "seconds": self.seconds, "cap_s": cap, "exit_code": self.exit_code}
        return record if self.status == "ok" else {**record, "log_tail": self.log_tail}


def _run_capped(command: list[str], cap: float, env: dict) -> Finished:
    """`command` in its own process group, its output passed on as it comes, killed with all it
    started once `cap` seconds have passed."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace")
    tail: collections.deque = collections.deque(maxlen=60)

    def pass_on() -> None:
        for line in process.stdout:
            print(line, end="", flush=True)
            tail.append(line)

    reader = threading.Thread(target=pass_on, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=cap)
        status = "ok" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code, status = None, "timeout"
    reader.join(timeout=5)
    return Finished(status, time.perf_counter() - start, code, "".join(tail)[-4000:])


def _unit_test_results(xml: Path) -> dict:
    """Counts and each test's outcome from pytest's JUnit XML."""
    tests = []
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                message = (child.get("message") or "").splitlines()[0][:300] if child.get("message") else None
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0)), "message": message})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    return {**counts, "tests": tests}


def run_part(name: str, dry_run: bool, work: Path, cap: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU's, also on a machine with a GPU
    if name == "unit_tests":
        xml = work / "unit_tests.xml"
        device = "cpu" if dry_run else "cuda"
        command = [sys.executable, "-m", "pytest", "-q", f"--device={device}", f"--junitxml={xml}", *DEVICE_TESTS]
        finished = _run_capped(command, cap, env)
        return {**finished.record(cap), "device": device, **(_unit_test_results(xml) if xml.exists() else {})}
    out = work / f"{name}.json"
    command = [sys.executable, __file__, "--part", name, "--part-out", str(out), "--work", str(work)]
    finished = _run_capped(command + (["--dry-run"] if dry_run else []), cap, env)
    return {**finished.record(cap), **(json.loads(out.read_text()) if out.exists() else {})}


def throughput_table(parts: dict, sizes: Sizes) -> dict:
    """The throughput part: both arms, and megatron_ext's tokens/s over the plain loop's."""
    arms = {"megatron_ext": parts.get("throughput_megatron"), "plain_pytorch": parts.get("throughput_plain")}
    table = {
        "model": sizes.model,
        "micro_batch": sizes.micro_batch,
        "micro_batches": sizes.micro_batches,
        "tokens_per_step": sizes.micro_batch * sizes.micro_batches * sizes.model["seq_length"],
        "peak_tflops": PEAK_TFLOPS,
        "arms": arms,
    }
    if all(arm and arm.get("tokens_per_s") for arm in arms.values()):
        table["megatron_ext_over_plain"] = arms["megatron_ext"]["tokens_per_s"] / arms["plain_pytorch"]["tokens_per_s"]
    return table


def device_record(dry_run: bool) -> dict:
    record = {"torch": torch.__version__, "cuda": torch.version.cuda, "dry_run": dry_run}
    if not dry_run and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        record |= {"name": props.name, "memory_gib": props.total_memory / 2**30, "multiprocessors": props.multi_processor_count}
    else:
        record["name"] = "cpu"
    return record


def write(path: Path, result: dict) -> None:
    """Whole or not at all: a run killed mid-write leaves the previous file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(path)


def summary(result: dict) -> str:
    lines = [f"{name}: {part['status']} ({part.get('seconds', 0):.0f} s)" for name, part in result["parts"].items()
             if name != "throughput"]
    table = result["parts"].get("throughput", {})
    for arm, row in table.get("arms", {}).items():
        if row and row.get("tokens_per_s"):
            lines.append(f"  {arm:14s} {row['step_s']:.3f} s/step  {row['tokens_per_s']:,.0f} tokens/s  "
                         f"{row['tflops']:.2f} TFLOP/s  MFU {row['mfu']:.1%}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every part on the CPU at tiny sizes (what CI runs)")
    p.add_argument("--out", default="gpu_check.json", help="the JSON, written after every part")
    p.add_argument("--parts", nargs="+", choices=ORDER, default=list(ORDER), help="run these parts only")
    p.add_argument("--budget-s", type=float, help="seconds for all parts together (default: 450 on the GPU)")
    p.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # one part, in its own process
    p.add_argument("--part-out", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = sizes_for(args.dry_run)
    if args.part:
        try:
            measured = PARTS[args.part](sizes, Path(args.work))
        except Exception as failed:  # the parent records it; the traceback goes to the log
            traceback.print_exc()
            measured = {"error": f"{type(failed).__name__}: {failed}"[:1000]}
        Path(args.part_out).write_text(json.dumps(measured))
        return 0 if "error" not in measured else 1

    started = time.perf_counter()
    budget_s = args.budget_s or sizes.budget_s
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"check": "scripts/gpu/check.sh", "device": device_record(args.dry_run),
              "provenance": provenance(__file__, argv), "budget_s": budget_s, "parts": {}}
    if not args.dry_run and result["device"]["name"] == "cpu":
        p.error("no CUDA device here: give --dry-run to run the parts on the CPU")
    write(out, result)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        for name in [n for n in ORDER if n in args.parts]:
            left = budget_s - (time.perf_counter() - started)
            cap = min(sizes.caps[name], left)
            print(f"== {name} (cap {cap:.0f} s)", flush=True)
            if cap < 10:
                result["parts"][name] = {"status": "skipped", "reason": "the budget was spent"}
            else:
                result["parts"][name] = run_part(name, args.dry_run, Path(work), cap)
            if name.startswith("throughput_"):
                result["parts"]["throughput"] = throughput_table(result["parts"], sizes)
            result["wall_s"] = time.perf_counter() - started
            write(out, result)
    print(summary(result), flush=True)
    print(f"wrote {out}", flush=True)
    return 0 if all(part["status"] == "ok" for name, part in result["parts"].items() if name != "throughput") else 1


if __name__ == "__main__":
    sys.exit(main())
