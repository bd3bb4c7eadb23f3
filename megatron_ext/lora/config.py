"""The lora plugin's config section (`lora.*`) and its checks before launch; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_ext.config.batch_sizes import schedule_key
from megatron_ext.config.capabilities import Capability
from megatron_ext.config.plugin_sections import PluginSection
from megatron_ext.config.schema import Config
from megatron_ext.config.validate import ConfigError
from megatron_ext.lora.job import TARGET_MODULES


@dataclass
class LoraConfig:
    rank: int = 8  # Rank r of each adapter's A (r x in) and B (out x r) matrices.
    alpha: float = 16.0  # LoRA's alpha: the adapter's output is scaled by alpha / rank.
    dropout: float = 0.0  # Dropout probability on the adapter's input (0: none).
    # The linear layers that get adapters: linear_qkv, linear_proj, linear_fc1, linear_fc2.
    target_modules: list[str] = field(default_factory=lambda: list(TARGET_MODULES))
    # A job's data: SFT files or folders (JSONL / JSON / Parquet of {"messages": [...]} or
    # {"prompt", "completion"} records, rendered with data.sft.prompt_format, split by
    # data.split); a weighted mix of them, "0.7 a.jsonl 0.3 b.jsonl" as data.data_path;
    # "task:<docstring|module|reverse|upper>" (examples from the standard library, tasks.py);
    # or "synthetic" (seeded random tokens). See lora/datasets.py.
    dataset: str = "task:docstring"
    # A job's sample length (None: model.seq_length).
    seq_length: Optional[int] = None
    eval_iters: int = 4  # Held-out micro-batches of each job's evaluation.
    # Evaluate every N optimizer steps (0: at the end only).
    eval_interval: int = 0
    # A plain multi-job config: entries (dicts of LoraJob fields, with a unique `name`) that
    # override the job this config describes; or the same list under `jobs:` in a YAML file.
    jobs: list[Any] = field(default_factory=list)
    jobs_file: Optional[str] = None  # A YAML file whose `jobs:` list is read like `jobs`; None: none.
    # Adapters trained at once (None: the planner decides within `memory_gb`).
    slots: Optional[int] = None
    # Memory of one device (a rank) the planner may fill. parallel.tp is the largest TP a pack
    # may use: the planner picks each pack's TP, a power of two up to it.
    memory_gb: float = 16.0
    # The most padded tokens (samples x length) of one forward/backward: a packed step over
    # more splits into passes of whole micro-batches, in slot order, whose gradients add up
    # (each adapter's gradient is the same; activations are one pass's, not every job's; a
    # micro-batch over the cap runs alone). The planner's memory and time count the passes.
    # "auto": the pass size past which this device runs barely faster per token (planning/pass_size.py:
    # the cost-model file's, else 1024 on a CPU, else no cap); null: one pass per packed step.
    max_pass_tokens: Any = "auto"
    # The planner's cost model: a calibration file (calibrate.save_fit); None: sweep.py's
    # uncalibrated CPU_COEFFICIENTS.
    cost_model: Optional[str] = None
    # reference | grouped | triton | auto (grouped GEMM for bf16 on CUDA, else reference; triton
    # only by name until it has run on a GPU)
    kernel: str = "auto"
    # Per job: log, metrics, PEFT adapter and megatron checkpoint under <output_dir>/<job>/.
    output_dir: str = "runs/lora_sweep"
    # The base model each PEFT adapter names (adapter_config.json's base_model_name_or_path):
    # a path or hub id transformers opens. None: model.pretrained when it is a Hugging Face
    # folder, else no name.
    peft_base_model: Optional[str] = None
    # Checkpoint each pack every N packed steps under <output_dir>/checkpoints/ (runtime/resume.py);
    # None: only when the pack ends.
    save_interval: Optional[int] = None
    # Continue the sweep checkpointed under <output_dir>/checkpoints/ (the same jobs).
    resume: bool = False
    # Stop this launch after N packed steps (with a checkpoint), counted on each rank over the
    # packs it runs; None: run to the end.
    stop_after: Optional[int] = None


def check(own: LoraConfig, cfg: Config, world_size: int) -> None:
    """A model or batch schedule a packed sweep of PEFT adapters cannot train with is refused."""
    # The adapters wrap linear_qkv / linear_proj and a dense MLP's linear_fc1 / linear_fc2.
    if cfg.model.multi_latent_attention:
        raise ConfigError("model.multi_latent_attention", "lora adapts linear_qkv, which multi-latent attention has not")
    if cfg.model.num_experts is not None:
        raise ConfigError("model.num_experts", "lora adapts dense MLPs (linear_fc1/linear_fc2), not MoE experts")
    if schedule_key(cfg.train):
        raise ConfigError(schedule_key(cfg.train), "lora trains each job at one global batch (train.global_batch_size): "
                                                   "a batch-size schedule is not supported")
    if cfg.model.mtp_num_layers is not None:
        raise ConfigError("model.mtp_num_layers", "lora trains each packed job on its own next-token loss: "
                                                  "multi-token prediction's loss is one over the whole pack")
    # Each job's adapter is written for a Hugging Face base (PEFT), whose families have neither.
    peft = "lora writes each job's adapter for a Hugging Face base (PEFT), which has no"
    if cfg.model.window_size is not None:
        raise ConfigError("model.window_size", f"{peft} sliding window: the adapter would meet another network")
    if cfg.model.softmax_type != "vanilla":
        raise ConfigError("model.softmax_type", f"{peft} softmax offsets (softmax_type={cfg.model.softmax_type}): "
                                                "the adapter would meet another network")
    if cfg.data.sft is not None and cfg.data.sft.path:  # each job names its files; data=sft says how they render
        raise ConfigError("data.sft.path", "lora jobs read their own data: name the files in each job's dataset; with "
                                           "lora, data=sft sets data.sft.prompt_format and overlong only (data.sft.path=[])")
    if cfg.train.skip_train:  # the packed loop has no evaluation-only run: it would train
        raise ConfigError("train.skip_train", "lora runs its own packed loop, which trains its jobs: "
                                              "it has no evaluation-only run")
    if cfg.train.test_mode:  # set on the Trainer's models
        raise ConfigError("train.test_mode", "lora runs its own packed loop, not the Trainer's: megatron's real-time "
                                             "test would not run; run it without lora")


# The packed sweep is its runner: many jobs on one frozen base, in a loop of its own.
SECTION = PluginSection("lora", LoraConfig, check=check, capabilities=frozenset({
    Capability.OWNS_RUN, Capability.REPLACES_TRAINER_LOOP, Capability.SHARES_BASE}))
