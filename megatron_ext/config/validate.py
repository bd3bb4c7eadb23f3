"""The rules that tie config fields together, checked before any process group exists.

Megatron-Core finds most of these problems too, but only after `init_process_group`, on every
rank at once, as an assertion deep inside model construction. Checking them here turns a hung or
crashed N-process launch into one line that names the field to change:

    parallel.tp: model.num_attention_heads (6) must be divisible by parallel.tp (4)

Every rule is a small function `(cfg, world_size, device) -> None | str | list[str]` returning the
broken rule's text; `RULES` below lists them all with the field each one blames.
Each plugin the run lists adds its own checks (config/plugin_sections.py), read from its
config module without importing the plugin: `validate_run` and `validate_layout` run them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from megatron_ext.config.batch_sizes import (
    parse_step_schedule,
    rampup_problems,
    schedule_key,
    scheduled_batch_sizes,
    step_schedule_problems,
)
from megatron_ext.config.capabilities import Capability, refusals
from megatron_ext.config.moe_pattern import moe_layer_pattern
from megatron_ext.config.plugin_sections import plugin_sections
from megatron_ext.config.schema import Config, TrainConfig
from megatron_ext.config.tokenizer_spec import NULL_PREFIX
from megatron_ext.platform import optional
from megatron_ext.platform.launch_env import detect_launch


class ConfigError(ValueError):
    """A broken rule. `field`/`rule` name the first one; `violations` holds all of them."""

    def __init__(
        self, field: str, rule: str, others: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.field = field
        self.rule = rule
        self.violations = [(field, rule), *others]
        super().__init__("\n".join(f"{f}: {r}" for f, r in self.violations))


def _get(cfg: Config, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# ---------------------------------------------------------------------------------------------
# Stage 1: sizes. Every other rule divides by these, so they are checked first and alone.

# Sizes that must always be positive integers.
SIZES = (
    "parallel.tp",
    "parallel.pp",
    "parallel.ep",
    "parallel.cp",
    "launcher.nproc",
    "train.iters",
    "train.micro_batch_size",
    "model.num_layers",
    "model.hidden_size",
    "model.ffn_hidden_size",
    "model.num_attention_heads",
    "model.seq_length",
    "model.moe_router_topk",
    "model.kv_lora_rank",
    "model.qk_head_dim",
    "model.qk_pos_emb_head_dim",
    "model.v_head_dim",
    "model.yarn_original_max_position_embeddings",
    "model.mamba_head_dim",
    "model.mamba_num_groups",
    "model.mamba_state_dim",
    "model.mamba_chunk_size",
)
# Sizes that may be None ("derive it" / "off") but must be positive when given.
OPTIONAL_SIZES = (
    "parallel.dp",
    "parallel.vpp",
    "parallel.first_stage_layers",
    "parallel.last_stage_layers",
    "train.global_batch_size",
    "model.num_query_groups",
    "model.num_experts",
    "model.moe_ffn_hidden_size",
    "model.head_dim",
    "model.max_position_embeddings",
    "model.q_lora_rank",
    "model.moe_router_num_groups",
    "model.moe_router_group_topk",
    "model.moe_shared_expert_intermediate_size",
    "model.mamba_num_heads",
    "optim.lr_decay_iters",
    "train.train_samples",
    "optim.lr_decay_samples",
    "checkpoint.interval",
    "checkpoint.keep_last",
)


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _size_violations(cfg: Config, world_size: int) -> list[tuple[str, str]]:
    found = [
        (path, f"must be a positive integer, got {_get(cfg, path)!r}")
        for path in SIZES
        if not _is_positive_int(_get(cfg, path))
    ]
    found += [
        (path, f"must be a positive integer or null, got {_get(cfg, path)!r}")
        for path in OPTIONAL_SIZES
        if _get(cfg, path) is not None and not _is_positive_int(_get(cfg, path))
    ]
    if not _is_positive_int(world_size):
        found.append(
            ("launcher.nproc", f"world size must be a positive integer, got {world_size!r}")
        )
    return found


# ---------------------------------------------------------------------------------------------
# Stage 2: relations between fields. Sizes are known to be positive here.

Rule = Callable[[Config, int, str], Union[None, str, list[str]]]


def _dp_or_none(cfg: Config, world_size: int) -> Optional[int]:
    """dp as the launch will have it, or None when the world cannot be cut (reported elsewhere)."""
    p = cfg.parallel
    if p.dp is not None:
        return p.dp if _layout_fits(cfg, world_size) else None
    model = p.tp * p.pp * p.cp
    return world_size // model if world_size % model == 0 else None


def heads_divisible_by_tp(cfg: Config, world: int, device: str) -> Optional[str]:
    heads, tp = cfg.model.num_attention_heads, cfg.parallel.tp
    if heads % tp:
        return f"model.num_attention_heads ({heads}) must be divisible by parallel.tp ({tp})"
    return None


def query_groups_fit(cfg: Config, world: int, device: str) -> list[str]:
    groups, heads, tp = cfg.model.num_query_groups, cfg.model.num_attention_heads, cfg.parallel.tp
    if groups is None:
        return []
    found = []
    if heads % groups:
        found.append(
            f"model.num_query_groups ({groups}) must divide model.num_attention_heads ({heads})"
        )
    # Stricter than megatron-core 0.16, which also lets tp be a multiple of the groups by
    # all-gathering QKV in every layer; we keep whole KV heads per TP rank.
    if groups % tp:
        found.append(f"model.num_query_groups ({groups}) must be divisible by parallel.tp ({tp})")
    return found


def hidden_divisible_by_heads(cfg: Config, world: int, device: str) -> Optional[str]:
    hidden, heads = cfg.model.hidden_size, cfg.model.num_attention_heads
    if hidden % heads and cfg.model.head_dim is None:
        return (
            f"model.hidden_size ({hidden}) must be divisible by "
            f"model.num_attention_heads ({heads})"
        )
    return None


STAGE_LAYERS = ("parallel.first_stage_layers", "parallel.last_stage_layers")


def layers_divisible_by_stages(cfg: Config, world: int, device: str) -> Optional[str]:
    layers, pp, vpp = cfg.model.num_layers, cfg.parallel.pp, cfg.parallel.vpp
    fixed = [(path, _get(cfg, path)) for path in STAGE_LAYERS if _get(cfg, path) is not None]
    if not fixed:
        if vpp is None and layers % pp:
            return f"model.num_layers ({layers}) must be divisible by parallel.pp ({pp})"
        if vpp is not None and layers % (pp * vpp):
            return (
                f"model.num_layers ({layers}) must be divisible by parallel.pp * parallel.vpp "
                f"({pp} * {vpp} = {pp * vpp})"
            )
        return None
    if pp == 1:
        return None  # stage_layers_need_pipeline reports it
    # megatron-core 0.16 (TransformerConfig, get_num_layers_to_build): the stages without a
    # fixed count share what is left evenly, and each of their shares splits evenly over vpp.
    rest, stages = layers - sum(v for _, v in fixed), pp - len(fixed)
    left = (
        f"{' - '.join(['model.num_layers', *(p for p, _ in fixed)])} "
        f"({' - '.join(str(v) for v in [layers, *(v for _, v in fixed)])} = {rest})"
    )
    if stages == 0 and rest:
        return f"{left} must be 0: parallel.pp ({pp}) has no stage besides the first and last"
    if stages and (rest < stages or rest % stages):
        return f"{left} must be a positive multiple of the other pipeline stages ({stages})"
    if stages and vpp is not None and (rest // stages) % vpp:
        return (
            f"the layers of each other pipeline stage ({left} / {stages} = {rest // stages}) "
            f"must be divisible by parallel.vpp ({vpp})"
        )
    return None


def stage_layers_need_pipeline(path: str) -> Rule:
    """A fixed first/last stage needs stages to be uneven with, and an even share per virtual
    stage (megatron gives each of the stage's model chunks the same number of layers)."""

    def rule(cfg: Config, world: int, device: str) -> Optional[str]:
        value, pp, vpp = _get(cfg, path), cfg.parallel.pp, cfg.parallel.vpp
        if value is not None and pp == 1:
            return f"{path} (uneven pipeline stages) requires parallel.pp > 1"
        if value is not None and vpp is not None and value % vpp:
            return f"{path} ({value}) must be divisible by parallel.vpp ({vpp})"
        return None

    return rule


def vpp_with_uneven_stages(cfg: Config, world: int, device: str) -> Optional[str]:
    # megatron-core 0.16 get_transformer_layer_offset divides by the number of middle stages
    # for interleaved uneven pipelines: with both ends fixed and pp = 2 that is zero.
    p = cfg.parallel
    both = p.first_stage_layers is not None and p.last_stage_layers is not None
    if p.vpp is not None and both and p.pp == 2:
        return (
            "parallel.vpp with both parallel.first_stage_layers and parallel.last_stage_layers "
            "needs parallel.pp > 2 (megatron-core 0.16 has no interleaved offsets without a "
            "middle stage); set only one of them"
        )
    return None


def vpp_needs_pipeline(cfg: Config, world: int, device: str) -> Optional[str]:
    if cfg.parallel.vpp is not None and cfg.parallel.pp == 1:
        return "parallel.vpp (interleaved pipeline) requires parallel.pp > 1"
    return None


def _plugin_has(cfg: Config, capability: Capability) -> bool:
    """Whether a plugin of the run has `capability` (config/capabilities.py)."""
    sections = plugin_sections()
    return any(capability in sections[name].capabilities for name in cfg.plugins if name in sections)


def _layout_fits(cfg: Config, world: int) -> bool:
    """An explicit layout uses the whole world, or a part of it where a plugin allows it."""
    p = cfg.parallel
    active = p.tp * p.pp * p.dp * p.cp
    return active == world or (_plugin_has(cfg, Capability.STANDBY_WORKERS) and active < world)


def world_matches_layout(cfg: Config, world: int, device: str) -> Optional[str]:
    p = cfg.parallel
    if p.dp is not None and not _layout_fits(cfg, world):
        relation = "be at most" if _plugin_has(cfg, Capability.STANDBY_WORKERS) else "equal"
        return (
            f"tp * pp * dp * cp ({p.tp} * {p.pp} * {p.dp} * {p.cp} = {p.tp * p.pp * p.dp * p.cp}) "
            f"must {relation} the world size ({world})"
        )
    return None


def world_divisible_by_model(cfg: Config, world: int, device: str) -> Optional[str]:
    p = cfg.parallel
    if p.dp is None and world % (p.tp * p.pp * p.cp):
        return (
            f"world size ({world}, from launcher.nproc or WORLD_SIZE/SLURM under torchrun/srun) "
            f"must be divisible by tp * pp * cp ({p.tp} * {p.pp} * {p.cp} = {p.tp * p.pp * p.cp})"
        )
    return None


def experts_divisible_by_ep(cfg: Config, world: int, device: str) -> Optional[str]:
    experts, ep = cfg.model.num_experts, cfg.parallel.ep
    if experts is not None and experts % ep:
        return f"model.num_experts ({experts}) must be divisible by parallel.ep ({ep})"
    return None


def ep_needs_experts(cfg: Config, world: int, device: str) -> Optional[str]:
    if cfg.parallel.ep > 1 and cfg.model.num_experts is None:
        return f"parallel.ep ({cfg.parallel.ep}) > 1 requires model.num_experts"
    return None


def ep_divides_dp_cp(cfg: Config, world: int, device: str) -> Optional[str]:
    # megatron-core 0.16 initialize_model_parallel: expert ranks are cut as etp * ep * pp with
    # etp = tp, so world = tp * pp * dp * cp must be divisible by tp * ep * pp, i.e. ep | dp * cp.
    dp, ep, cp = _dp_or_none(cfg, world), cfg.parallel.ep, cfg.parallel.cp
    if dp is not None and (dp * cp) % ep:
        return f"parallel.ep ({ep}) must divide dp * cp ({dp} * {cp} = {dp * cp})"
    return None


def topk_within_experts(cfg: Config, world: int, device: str) -> Optional[str]:
    experts, topk = cfg.model.num_experts, cfg.model.moe_router_topk
    if experts is not None and topk > experts:
        return f"model.moe_router_topk ({topk}) must be <= model.num_experts ({experts})"
    return None


def global_batch_divisible(cfg: Config, world: int, device: str) -> Optional[str]:
    gbs, mbs, dp = cfg.train.global_batch_size, cfg.train.micro_batch_size, _dp_or_none(cfg, world)
    if gbs is not None and dp is not None and gbs % (mbs * dp):
        return (
            f"train.global_batch_size ({gbs}) must be divisible by train.micro_batch_size * dp "
            f"({mbs} * {dp} = {mbs * dp})"
        )
    return None


def interleaved_micro_batches(cfg: Config, world: int, device: str) -> Optional[str]:
    # megatron-core 0.16's interleaved schedule runs the micro-batches in groups of pp per
    # virtual stage (microbatch_group_size_per_vp_stage defaults to pp) and raises a ValueError
    # inside every worker when the count is not a multiple of pp.
    # A global batch of None (one micro-batch) is not checked: layouts are also checked for a
    # model alone, without a run's batch (see parallel/layout.py).
    p, t, dp = cfg.parallel, cfg.train, _dp_or_none(cfg, world)
    if p.vpp is None or dp is None or t.global_batch_size is None:
        return None
    gbs = t.global_batch_size
    if gbs % (t.micro_batch_size * dp):
        return None  # global_batch_divisible reports it
    micro = gbs // (t.micro_batch_size * dp)
    if micro % p.pp:
        return (
            f"the micro-batches per step (train.global_batch_size / (train.micro_batch_size * dp)"
            f" = {gbs} / ({t.micro_batch_size} * {dp}) = {micro}) must be divisible by "
            f"parallel.pp ({p.pp}) with parallel.vpp (interleaved pipeline)"
        )
    return None


def sequence_parallel_needs_tp(cfg: Config, world: int, device: str) -> Optional[str]:
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:
        return "parallel.sequence_parallel requires parallel.tp > 1"
    return None


def te_spec_available(cfg: Config, world: int, device: str) -> Optional[str]:
    if cfg.model.spec == "te" and (device != "cuda" or not optional.HAVE_TE):
        return "model.spec=te needs Transformer Engine and a CUDA device; use auto or local"
    return None


def seq_length_fits_sp(cfg: Config, world: int, device: str) -> Optional[str]:
    # Sequence parallelism splits each context-parallel rank's tokens evenly over the TP ranks.
    seq, tp, cp = cfg.model.seq_length, cfg.parallel.tp, cfg.parallel.cp
    if cfg.parallel.sequence_parallel and seq % (tp * cp):
        return (
            f"model.seq_length ({seq}) must be divisible by parallel.tp * parallel.cp ({tp} * {cp}) "
            "under parallel.sequence_parallel"
        )
    return None


def seq_length_fits_cp(cfg: Config, world: int, device: str) -> Optional[str]:
    # Megatron's load-balanced context parallelism gives each CP rank two chunks of the sequence.
    seq, cp = cfg.model.seq_length, cfg.parallel.cp
    if cp > 1 and seq % (2 * cp):
        return f"model.seq_length ({seq}) must be divisible by 2 * parallel.cp ({2 * cp})"
    return None


def warmup_before_decay_end(cfg: Config, world: int, device: str) -> Optional[str]:
    # megatron's OptimizerParamScheduler asserts lr_warmup_steps < lr_decay_steps.
    warmup = cfg.optim.lr_warmup_iters
    decay = cfg.optim.lr_decay_iters or cfg.train.iters
    if warmup is not None and not 0 <= warmup < decay:
        return f"optim.lr_warmup_iters ({warmup}) must be >= 0 and < the lr decay iters ({decay})"
    return None


def _global_batch_or_none(cfg: Config, world: int) -> Optional[int]:
    dp = _dp_or_none(cfg, world)
    if cfg.train.global_batch_size is not None:
        return cfg.train.global_batch_size
    return cfg.train.micro_batch_size * dp if dp is not None else None


def schedule_in_one_unit(cfg: Config, world: int, device: str) -> list[str]:
    """Megatron-LM's rule: a run is sized and scheduled in iterations or in samples, not both
    (a zero warmup is neither)."""
    o = cfg.optim
    if cfg.train.train_samples is not None:
        mixed = [("optim.lr_warmup_iters", o.lr_warmup_iters not in (None, 0)),
                 ("optim.lr_decay_iters", o.lr_decay_iters is not None)]
        return [
            f"{path} counts iterations, but train.train_samples sizes the run in samples; "
            f"use {path.replace('iters', 'samples')}"
            for path, bad in mixed if bad
        ]
    mixed = [("optim.lr_warmup_samples", o.lr_warmup_samples not in (None, 0)),
             ("optim.lr_decay_samples", o.lr_decay_samples is not None)]
    return [
        f"{path} counts samples, but the run is sized in iterations (train.iters); "
        "set train.train_samples for a sample-based run"
        for path, bad in mixed if bad
    ]


def samples_fill_a_batch(cfg: Config, world: int, device: str) -> Optional[str]:
    samples, gbs = cfg.train.train_samples, _global_batch_or_none(cfg, world)
    if schedule_key(cfg.train) is not None:
        return None  # a ramp or a step schedule trains at least its first batch
    if samples is not None and gbs is not None and samples < gbs:
        return (
            f"train.train_samples ({samples}) must be at least one global batch ({gbs}): the run "
            f"trains train_samples // global batch = 0 iterations"
        )
    return None


def rampup_fits(cfg: Config, world: int, device: str) -> list[str]:
    """megatron-core 0.16's ramp rules, and Megatron-LM's: a ramp sizes a sample-based run."""
    t = cfg.train
    if t.rampup_batch_size is None:
        return []
    if t.step_batch_size_schedule is not None:
        return ["train.rampup_batch_size and train.step_batch_size_schedule are exclusive: one batch-size schedule"]
    gbs = _global_batch_or_none(cfg, world)
    problems = rampup_problems(list(t.rampup_batch_size), gbs) if gbs is not None else []
    if t.train_samples is None:
        problems.append("a ramp needs a sample-based run (train.train_samples), as in Megatron-LM")
    return problems


def step_schedule_fits(cfg: Config, world: int, device: str) -> list[str]:
    """Megatron-LM's step schedule rules. Megatron-LM refuses --global-batch-size beside it;
    here a global batch equal to the schedule's last one is accepted (Megatron-LM's own
    example passes both)."""
    t = cfg.train
    if t.step_batch_size_schedule is None:
        return []
    try:
        schedule = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
    except ValueError as e:
        return [str(e)]
    problems = step_schedule_problems(schedule)
    if not problems and t.global_batch_size not in (None, schedule[-1][1]):
        problems.append(
            f"train.global_batch_size ({t.global_batch_size}) must be unset or the schedule's last batch size ({schedule[-1][1]})"
        )
    return problems


def scheduled_batches_divisible(path: str) -> Rule:
    """Every global batch of the schedule at `path` runs as whole micro-batches on every
    data-parallel rank (megatron's calculator asserts it when the batch is reached); under the
    interleaved pipeline, in groups of pp micro-batches."""

    def rule(cfg: Config, world: int, device: str) -> Optional[str]:
        t, p = cfg.train, cfg.parallel
        dp, gbs = _dp_or_none(cfg, world), _global_batch_or_none(cfg, world)
        if _get(cfg, path) is None or dp is None or gbs is None:
            return None
        if rampup_fits(cfg, world, device) or step_schedule_fits(cfg, world, device):
            return None  # the schedule itself is reported
        per_step = t.micro_batch_size * dp * (p.pp if p.vpp else 1)
        bad = sorted({size for size in scheduled_batch_sizes(t, cfg.model.seq_length, gbs) if size % per_step})
        if not bad:
            return None
        factors = f"train.micro_batch_size * dp ({t.micro_batch_size} * {dp}"
        factors += f" * parallel.pp {p.pp} under parallel.vpp)" if p.vpp else ")"
        return f"its global batch sizes {', '.join(map(str, bad))} must be divisible by {factors} = {per_step}"

    return rule


def warmup_init_within_lr(cfg: Config, world: int, device: str) -> Optional[str]:
    o = cfg.optim
    if o.lr >= 0 and not 0.0 <= o.lr_warmup_init <= o.lr:  # a negative lr is reported by its range alone
        return f"optim.lr_warmup_init ({o.lr_warmup_init}) must be >= 0 and <= optim.lr ({o.lr})"
    return None


def sample_warmup_before_decay_end(cfg: Config, world: int, device: str) -> Optional[str]:
    # megatron's OptimizerParamScheduler asserts lr_warmup_steps < lr_decay_steps.
    warmup, samples = cfg.optim.lr_warmup_samples, cfg.train.train_samples
    if warmup is None or samples is None:
        return None
    decay = cfg.optim.lr_decay_samples or samples
    if not 0 <= warmup < decay:
        return f"optim.lr_warmup_samples ({warmup}) must be >= 0 and < the lr decay samples ({decay})"
    return None


def async_save_needs_save_dir(cfg: Config, world: int, device: str) -> Optional[str]:
    if cfg.checkpoint.async_save and not cfg.checkpoint.save:
        return "checkpoint.async_save needs checkpoint.save (the directory it writes to)"
    return None


def one_data_source(cfg: Config, world: int, device: str) -> Optional[str]:
    # Megatron-LM: "A single data source must be provided".
    if cfg.data.mock and cfg.data.data_path:
        return "data.mock (megatron's mock dataset) and data.data_path are exclusive: one data source"
    return None


def sft_data_fits(cfg: Config, world: int, device: str) -> Optional[str]:
    """SFT conversations are the run's one data source, and a packed sample keeps its
    conversations apart only through megatron's local attention with an explicit mask."""
    sft = cfg.data.sft
    if sft is None or _plugin_has(cfg, Capability.REPLACES_TRAINER_LOOP):
        return None  # no Trainer reads the run's data: the plugin that trains reads it, and checks it
    if not sft.path:
        return "data.sft.path is empty: give the files (or folders) of conversations"
    if cfg.data.mock or cfg.data.data_path:
        return "data.sft.path is the run's data: leave data.mock and data.data_path unset"
    if sft.overlong not in ("truncate", "skip", "error"):
        return f"data.sft.overlong must be one of truncate, skip, error; got {sft.overlong!r}"
    if not sft.pack:
        return None
    reasons = {
        "Mamba layers carry state from one conversation to the next": cfg.model.arch == "hybrid",
        "context parallelism splits the sequence the mask is built over": cfg.parallel.cp > 1,
        "megatron's sliding window builds its own mask": cfg.model.window_size is not None,
        "Transformer Engine's attention ignores the mask (model.spec=local keeps it)": not _local_layers(cfg, device),
    }
    for reason, applies in reasons.items():
        if applies:
            return f"packed conversations cannot be kept apart here: {reason}; set data.sft.pack=false"
    return None


def null_tokenizer_reads_ids(cfg: Config, world: int, device: str) -> Optional[str]:
    # data.tokenizer=null:<V> is Megatron-LM's NullTokenizer: its text is ids, so a text corpus
    # would fail at its first word.
    if cfg.data.tokenizer.startswith(NULL_PREFIX) and not (cfg.data.mock or cfg.data.data_path):
        return (
            f"{cfg.data.tokenizer} (NullTokenizer) reads token ids, not text: give data.mock=true "
            "(--mock-data) or data.data_path (--data-path) of preprocessed ids"
        )
    return None


def one_of(path: str, allowed: Sequence[str]) -> Rule:
    def rule(cfg: Config, world: int, device: str) -> Optional[str]:
        value = _get(cfg, path)
        if value not in allowed:
            return f"{path} must be one of {', '.join(allowed)}; got {value!r}"
        return None

    return rule


def not_negative(path: str) -> Rule:
    def rule(cfg: Config, world: int, device: str) -> Optional[str]:
        value = _get(cfg, path)
        return f"{path} must be >= 0, got {value}" if value < 0 else None

    return rule


def plugins_registered(cfg: Config, world: int, device: str) -> list[str]:
    known = plugin_sections()
    return [
        f"unknown plugin {name!r}; registered: {', '.join(sorted(known)) or 'none'}"
        for name in cfg.plugins
        if name not in known
    ]


def plugins_compose(cfg: Config, world: int, device: str) -> list[str]:
    """The pairs of the run's plugins whose capabilities conflict (config/capabilities.py)."""
    known = plugin_sections()
    return refusals((name, known[name].capabilities) for name in cfg.plugins if name in known)


# --- megatron's GPT model space ------------------------------------------------------------------


def _local_layers(cfg: Config, device: str) -> bool:
    """megatron's local (non-Transformer-Engine) layers: what every CPU run builds."""
    m = cfg.model
    return device == "cpu" or m.spec == "local" or (m.spec == "auto" and not optional.HAVE_TE)


def rotary_dims_even(cfg: Config, world: int, device: str) -> Optional[str]:
    """RoPE turns channel pairs: the rotated part of each head must have an even size."""
    m = cfg.model
    if m.position_embedding_type not in ("rope", "yarn"):
        return None
    if m.multi_latent_attention:
        if m.qk_pos_emb_head_dim % 2:
            return f"model.qk_pos_emb_head_dim ({m.qk_pos_emb_head_dim}) must be even (RoPE rotates channel pairs)"
        return None
    head = m.head_dim or m.hidden_size // m.num_attention_heads
    rotated = int(head * m.rotary_percent)
    if rotated % 2 or rotated == 0:
        return (
            f"model.rotary_percent ({m.rotary_percent}) of the head size ({head}) rotates {rotated} "
            "channels; RoPE needs an even, non-zero number"
        )
    return None


def rope_scaling_fits(cfg: Config, world: int, device: str) -> Optional[str]:
    m = cfg.model
    if m.rope_scaling is None:
        return None
    if m.rope_scaling != "llama3":
        return f"model.rope_scaling must be null or llama3; got {m.rope_scaling!r}"
    if m.position_embedding_type != "rope" or m.multi_latent_attention:
        return "model.rope_scaling=llama3 scales RoPE: it needs model.position_embedding_type=rope without MLA"
    return None


def positions_fit_sequence(cfg: Config, world: int, device: str) -> Optional[str]:
    m = cfg.model
    rows = m.max_position_embeddings
    if m.position_embedding_type == "learned_absolute" and rows is not None and rows < m.seq_length:
        return (
            f"model.max_position_embeddings ({rows}) must be >= model.seq_length ({m.seq_length}): "
            "the learned position table has one row per position"
        )
    return None


def mla_fits(cfg: Config, world: int, device: str) -> list[str]:
    m, p = cfg.model, cfg.parallel
    if not m.multi_latent_attention:
        return []
    found = []
    if m.position_embedding_type not in ("rope", "yarn"):
        found.append(
            f"model.multi_latent_attention applies its own rotary embedding: model.position_embedding_type "
            f"must be rope or yarn, got {m.position_embedding_type!r}"
        )
    if m.num_query_groups not in (None, m.num_attention_heads):
        found.append("model.multi_latent_attention has no grouped-query attention: set model.num_query_groups to null")
    if _local_layers(cfg, device) and p.cp > 1:
        found.append("model.multi_latent_attention on local layers has no context parallelism (parallel.cp must be 1)")
    return found


def glu_extras_fit(cfg: Config, world: int, device: str) -> list[str]:
    """The GLU offset and clamp act on the two halves of a gated activation."""
    m = cfg.model
    found = []
    gated = m.activation in ("swiglu", "quick_geglu")
    for name, value, off in (
        ("glu_linear_offset", m.glu_linear_offset, 0.0),
        ("activation_func_clamp_value", m.activation_func_clamp_value, None),
    ):
        if value != off and not gated:
            found.append(f"model.{name} needs a gated activation (model.activation swiglu or quick_geglu), got {m.activation!r}")
    if m.activation_func_clamp_value is not None and m.activation_func_clamp_value <= 0:
        found.append(f"model.activation_func_clamp_value must be > 0, got {m.activation_func_clamp_value}")
    return found


def realtime_test_fits(cfg: Config, world: int, device: str) -> Optional[str]:
    """megatron-core's real-time test (train.test_mode) compares each QK-norm's weight and bias;
    megatron reads the bias of an RMSNorm too, which has none, and stops there."""
    m = cfg.model
    if cfg.train.test_mode and m.qk_layernorm and not m.multi_latent_attention and m.normalization == "RMSNorm":
        return (
            "train.test_mode compares the QK-norms' weights and biases (megatron-core's real-time test), and "
            "RMSNorm has no bias: use model.normalization=LayerNorm, or turn model.qk_layernorm off"
        )
    return None


def window_fits(cfg: Config, world: int, device: str) -> list[str]:
    """megatron's sliding window: (keys before, keys after) a query; the local attention builds
    its own window mask over the whole sequence, which a context-parallel rank does not hold."""
    m = cfg.model
    if m.window_size is None:
        if m.window_attn_skip_freq is not None:
            return ["model.window_attn_skip_freq needs model.window_size (the window of the other layers)"]
        return []
    found = []
    if len(m.window_size) != 2 or any(side < 0 for side in m.window_size):
        found.append(f"model.window_size must be two numbers >= 0 (keys before, keys after), got {list(m.window_size)}")
    if m.window_attn_skip_freq is not None and m.window_attn_skip_freq < 1:
        found.append(f"model.window_attn_skip_freq must be >= 1, got {m.window_attn_skip_freq}")
    if _local_layers(cfg, device) and cfg.parallel.cp > 1:
        found.append(
            "model.window_size on local layers needs parallel.cp = 1: megatron's local attention masks the "
            "window over the whole sequence (Transformer Engine's attention windows under CP)"
        )
    return found


def attention_variants_need_gpt(cfg: Config, world: int, device: str) -> list[str]:
    """Sliding windows and softmax offsets are checked on the GPT decoder's layers; the hybrid's
    attention layers count Mamba layers in their numbering and are not checked with them."""
    m = cfg.model
    if m.arch == "gpt":
        return []
    used = [(m.window_size is not None, "model.window_size"), (m.softmax_type != "vanilla", "model.softmax_type")]
    return [f"{name} needs model.arch=gpt (the hybrid's attention is checked with plain softmax attention only)"
            for bad, name in used if bad]


def mtp_fits(cfg: Config, world: int, device: str) -> list[str]:
    """megatron-core 0.16's multi-token prediction: GPTModel's, on the last pipeline stage."""
    m = cfg.model
    if m.mtp_num_layers is None:
        return []
    found = []
    if m.mtp_num_layers < 1:
        found.append(f"model.mtp_num_layers must be null or >= 1, got {m.mtp_num_layers}")
    if m.mtp_loss_scaling_factor < 0:
        found.append(f"model.mtp_loss_scaling_factor must be >= 0, got {m.mtp_loss_scaling_factor}")
    if m.arch != "gpt":
        found.append("model.mtp_num_layers needs model.arch=gpt (megatron-core 0.16's MTP is GPTModel's)")
    if cfg.parallel.pp > 1 and m.tie_embeddings:
        found.append(
            "model.mtp_num_layers with parallel.pp > 1 needs model.tie_embeddings=false: megatron-core 0.16's "
            "GPTModel gives the last stage an output weight of its own that its checkpoint refuses"
        )
    if cfg.parallel.pp > 1 and m.position_embedding_type == "learned_absolute":
        found.append(
            "model.mtp_num_layers with parallel.pp > 1 needs a position_embedding_type other than "
            "learned_absolute: megatron-core 0.16 gives the MTP stage its own position table, never tied to "
            "the first stage's"
        )
    return found


def moe_router_fits(cfg: Config, world: int, device: str) -> list[str]:
    """What megatron-core 0.16's TransformerConfig and TopKRouter refuse about the router."""
    m = cfg.model
    if m.num_experts is None:
        return []
    found = []
    balancing, score = m.moe_router_load_balancing_type, m.moe_router_score_function
    if m.moe_router_enable_expert_bias and score != "sigmoid":
        found.append("model.moe_router_enable_expert_bias needs model.moe_router_score_function=sigmoid")
    if m.moe_router_topk == 1 and score == "softmax" and not m.moe_router_pre_softmax and balancing != "sinkhorn":
        found.append(
            "model.moe_router_topk=1 with the softmax score function needs model.moe_router_pre_softmax "
            "(a softmax over one chosen expert has zero gradient)"
        )
    if balancing == "sinkhorn" and m.moe_aux_loss_coeff > 0:
        found.append(
            "model.moe_router_load_balancing_type=sinkhorn takes no aux loss: set model.moe_aux_loss_coeff to 0"
        )
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        found.append("model.moe_router_num_groups and model.moe_router_group_topk go together (group-limited routing)")
    elif groups is not None:
        if m.num_experts % groups:
            found.append(f"model.moe_router_num_groups ({groups}) must divide model.num_experts ({m.num_experts})")
        elif group_topk > groups:
            found.append(
                f"model.moe_router_group_topk ({group_topk}) must be <= model.moe_router_num_groups ({groups})"
            )
        elif m.moe_router_topk % group_topk or m.moe_router_topk // group_topk > m.num_experts // groups:
            found.append(
                f"model.moe_router_topk ({m.moe_router_topk}) must split evenly over model.moe_router_group_topk "
                f"({group_topk}) groups of {m.num_experts // groups} experts"
            )
    return found


def moe_layer_freq_fits(cfg: Config, world: int, device: str) -> Optional[str]:
    m = cfg.model
    if m.num_experts is None or m.arch != "gpt":
        return None
    try:
        pattern = moe_layer_pattern(m)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not pattern or len(pattern) != m.num_layers or set(pattern) - {0, 1} or 1 not in pattern:
        return (
            f"model.moe_layer_freq ({m.moe_layer_freq!r}) must be a positive integer (MoE every N-th layer) or "
            f"a list expression of {m.num_layers} 0s and 1s with at least one 1, e.g. \"([0]+[1]*3)*2\""
        )
    return None


def moe_needs_sequence_parallel(cfg: Config, world: int, device: str) -> Optional[str]:
    # megatron-core 0.16's MoELayer raises in training when TP splits it without SP.
    if cfg.model.num_experts is not None and cfg.parallel.tp > 1 and not cfg.parallel.sequence_parallel:
        return "model.num_experts with parallel.tp > 1 needs parallel.sequence_parallel=true (megatron's MoE layer)"
    return None


def moe_bias_fits(cfg: Config, world: int, device: str) -> Optional[str]:
    if cfg.model.num_experts is None or not cfg.model.add_bias_linear:
        return None
    if _local_layers(cfg, device):
        return (
            "model.add_bias_linear with model.num_experts needs Transformer Engine: megatron-core 0.16's "
            "local experts (SequentialMLP) add the bias in place on a tensor autograd must keep"
        )
    if cfg.parallel.tp > 1:  # experts are split like the rest of the layer: expert TP = TP
        return (
            "model.add_bias_linear with model.num_experts needs parallel.tp = 1 "
            "(megatron: biases in MoE need expert TP 1)"
        )
    return None


# megatron's hybrid layer symbols: Mamba2, attention, MLP, MoE.
HYBRID_SYMBOLS = "M*-E"


def hybrid_pattern_fits(cfg: Config, world: int, device: str) -> list[str]:
    m = cfg.model
    if m.arch != "hybrid":
        return []
    pattern = m.hybrid_pattern
    if not pattern:
        return [f"model.arch=hybrid needs model.hybrid_pattern (one of {HYBRID_SYMBOLS!r} per layer)"]
    found = []
    unknown = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if unknown:
        found.append(
            f"model.hybrid_pattern {pattern!r} has unknown symbols {''.join(unknown)!r}; "
            "use M (Mamba2), * (attention), - (MLP), E (MoE)"
        )
    if len(pattern) != m.num_layers:
        found.append(
            f"model.hybrid_pattern {pattern!r} has {len(pattern)} layers but model.num_layers is {m.num_layers}"
        )
    if "E" in pattern and m.num_experts is None:
        found.append(f"model.hybrid_pattern {pattern!r} has MoE layers (E): set model.num_experts")
    if "E" not in pattern and m.num_experts is not None:
        found.append(
            f"model.num_experts ({m.num_experts}) is set but model.hybrid_pattern {pattern!r} has no MoE layer (E)"
        )
    return found


def mamba_heads_fit(cfg: Config, world: int, device: str) -> list[str]:
    m, tp = cfg.model, cfg.parallel.tp
    if m.arch != "hybrid" or "M" not in (m.hybrid_pattern or ""):
        return []
    heads = m.mamba_num_heads
    if heads is None:
        if (2 * m.hidden_size) % m.mamba_head_dim:
            return [
                f"model.mamba_head_dim ({m.mamba_head_dim}) must divide 2 * model.hidden_size "
                f"({2 * m.hidden_size}) when model.mamba_num_heads is null"
            ]
        heads = 2 * m.hidden_size // m.mamba_head_dim
    found = []
    if heads % m.mamba_num_groups:
        found.append(f"Mamba heads ({heads}) must be divisible by model.mamba_num_groups ({m.mamba_num_groups})")
    # Each TP rank holds whole groups (their shared B/C and their group norm).
    if m.mamba_num_groups % tp:
        found.append(f"model.mamba_num_groups ({m.mamba_num_groups}) must be divisible by parallel.tp ({tp})")
    return found


def hybrid_features(cfg: Config, world: int, device: str) -> list[str]:
    """What megatron's MambaStack / our local hybrid layers do not have."""
    m, p = cfg.model, cfg.parallel
    if m.arch != "hybrid":
        return []
    unsupported = [
        (p.vpp is not None, "parallel.vpp (megatron-core 0.16's MambaStack has no interleaved pipeline)"),
        (p.cp > 1, "parallel.cp > 1 (the hybrid's local attention and mixer have no context parallelism)"),
        (m.spec == "te", "model.spec=te (the hybrid is built from local layers; use auto or local)"),
        (m.pretrained is not None, "model.pretrained (importers read LLaMA-style models only)"),
        (m.multi_latent_attention, "model.multi_latent_attention (its attention layers are megatron's SelfAttention)"),
        (m.qk_layernorm, "model.qk_layernorm (its attention layers have no QK-norm)"),
        (
            m.position_embedding_type in ("learned_absolute", "yarn"),
            f"model.position_embedding_type={m.position_embedding_type} (it has no position embedding: "
            "the Mamba layers carry position)",
        ),
    ]
    return [f"model.arch=hybrid does not support {what}" for bad, what in unsupported if bad]


# The names megatron-core 0.16's OptimizerParamScheduler accepts.
# WSD needs its own decay-phase settings, which the schema does not carry yet.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")

# (blamed field, rule): the field is what a user changes to fix it.
RULES: tuple[tuple[str, Rule], ...] = (
    ("parallel.tp", heads_divisible_by_tp),
    ("model.num_query_groups", query_groups_fit),
    ("model.hidden_size", hidden_divisible_by_heads),
    ("model.num_layers", layers_divisible_by_stages),
    ("parallel.vpp", vpp_needs_pipeline),
    ("parallel.first_stage_layers", stage_layers_need_pipeline("parallel.first_stage_layers")),
    ("parallel.last_stage_layers", stage_layers_need_pipeline("parallel.last_stage_layers")),
    ("parallel.vpp", vpp_with_uneven_stages),
    ("parallel.dp", world_matches_layout),
    ("launcher.nproc", world_divisible_by_model),
    ("model.num_experts", experts_divisible_by_ep),
    ("parallel.ep", ep_needs_experts),
    ("parallel.ep", ep_divides_dp_cp),
    ("model.moe_router_topk", topk_within_experts),
    ("train.global_batch_size", global_batch_divisible),
    ("train.global_batch_size", interleaved_micro_batches),
    ("parallel.sequence_parallel", sequence_parallel_needs_tp),
    ("model.seq_length", seq_length_fits_cp),
    ("model.seq_length", seq_length_fits_sp),
    ("optim.lr_warmup_iters", warmup_before_decay_end),
    ("train.train_samples", schedule_in_one_unit),
    ("train.train_samples", samples_fill_a_batch),
    ("train.rampup_batch_size", rampup_fits),
    ("train.step_batch_size_schedule", step_schedule_fits),
    ("train.rampup_batch_size", scheduled_batches_divisible("train.rampup_batch_size")),
    ("train.step_batch_size_schedule", scheduled_batches_divisible("train.step_batch_size_schedule")),
    ("optim.lr_warmup_samples", sample_warmup_before_decay_end),
    ("optim.lr_warmup_init", warmup_init_within_lr),
    ("checkpoint.async_save", async_save_needs_save_dir),
    ("data.mock", one_data_source),
    ("data.tokenizer", null_tokenizer_reads_ids),
    ("data.sft.path", sft_data_fits),
    ("train.nan_policy", one_of("train.nan_policy", ("stop", "rollback"))),
    ("model.precision", one_of("model.precision", ("fp32", "bf16", "fp16"))),
    ("model.spec", one_of("model.spec", ("auto", "local", "te"))),
    ("model.spec", te_spec_available),
    ("launcher.device", one_of("launcher.device", ("auto", "cpu", "cuda"))),
    ("launcher.max_restarts", not_negative("launcher.max_restarts")),
    ("train.manual_gc_interval", not_negative("train.manual_gc_interval")),
    ("optim.lr_decay_style", one_of("optim.lr_decay_style", LR_DECAY_STYLES)),
    ("model.moe_token_dispatcher", one_of("model.moe_token_dispatcher", ("allgather", "alltoall", "flex"))),
    (
        "model.moe_flex_dispatcher_backend",
        one_of("model.moe_flex_dispatcher_backend", ("deepep", "hybridep")),
    ),
    ("plugins", plugins_registered),
    ("plugins", plugins_compose),
    ("model.arch", one_of("model.arch", ("gpt", "hybrid"))),
    ("model.hybrid_pattern", hybrid_pattern_fits),
    ("model.mamba_num_groups", mamba_heads_fit),
    ("model.arch", hybrid_features),
    ("model.normalization", one_of("model.normalization", ("RMSNorm", "LayerNorm"))),
    ("model.activation", one_of("model.activation", ("swiglu", "gelu", "squared_relu", "quick_geglu"))),
    ("model.activation", glu_extras_fit),
    ("model.softmax_type", one_of("model.softmax_type", ("vanilla", "off-by-one", "learnable"))),
    ("model.attention_backend", one_of("model.attention_backend", ("auto", "flash", "fused", "unfused", "local"))),
    ("model.window_size", window_fits),
    ("train.test_mode", realtime_test_fits),
    ("model.arch", attention_variants_need_gpt),
    ("model.mtp_num_layers", mtp_fits),
    (
        "model.position_embedding_type",
        one_of("model.position_embedding_type", ("rope", "yarn", "learned_absolute", "none")),
    ),
    ("model.rotary_percent", rotary_dims_even),
    ("model.rope_scaling", rope_scaling_fits),
    ("model.max_position_embeddings", positions_fit_sequence),
    ("model.multi_latent_attention", mla_fits),
    (
        "model.moe_router_load_balancing_type",
        one_of("model.moe_router_load_balancing_type", ("aux_loss", "seq_aux_loss", "sinkhorn", "none")),
    ),
    ("model.moe_router_score_function", one_of("model.moe_router_score_function", ("softmax", "sigmoid"))),
    ("model.num_experts", moe_router_fits),
    ("model.moe_layer_freq", moe_layer_freq_fits),
    ("parallel.sequence_parallel", moe_needs_sequence_parallel),
    ("model.add_bias_linear", moe_bias_fits),
)


# ---------------------------------------------------------------------------------------------
# Ranges of the numeric fields that SIZES above does not cover. A null passes: the schema lets a
# field be null only where null means "derive it" or "off".


def in_range(path: str, interval: str) -> Rule:
    """`path` must lie in `interval`, written as in mathematics: "[0, 1)", "(0, inf)". The
    comparisons are written so that NaN fails them."""
    low_text, high_text = (part.strip() for part in interval[1:-1].split(","))
    low, high = float(low_text), float(high_text)
    low_closed, high_closed = interval[0] == "[", interval[-1] == "]"
    if high_text == "inf":
        wanted = f"{'>=' if low_closed else '>'} {low_text}"
    else:
        wanted = f"in {interval}"

    def rule(cfg: Config, world: int, device: str) -> Optional[str]:
        value = _get(cfg, path)
        if value is None:
            return None
        above = value >= low if low_closed else value > low
        below = value <= high if high_closed else value < high
        if above and below:
            return None
        return f"{path} must be {wanted}, got {value!r}"

    return rule


def min_lr_at_most_lr(cfg: Config, world: int, device: str) -> Optional[str]:
    lr, min_lr = cfg.optim.lr, cfg.optim.min_lr
    if lr >= 0 and min_lr > lr:  # a negative lr is reported by its range alone
        return f"optim.min_lr ({min_lr}) must be <= optim.lr ({lr})"
    return None


# (field, interval), each checked by `in_range`.
RANGES: tuple[tuple[str, str], ...] = (
    ("optim.lr", "[0, inf)"),
    ("optim.min_lr", "[0, inf)"),
    ("optim.weight_decay", "[0, inf)"),
    ("optim.adam_beta1", "[0, 1)"),
    ("optim.adam_beta2", "[0, 1)"),
    ("optim.adam_eps", "(0, inf)"),
    ("optim.clip_grad", "[0, inf)"),
    ("optim.lr_warmup_samples", "[0, inf)"),
    ("optim.lr_decay_samples", "(0, inf)"),
    ("train.train_samples", "(0, inf)"),
    # numpy's and torch's seeds are unsigned 32-bit
    ("train.seed", "[0, 4294967296)"),
    # 0: no evaluation
    ("train.eval_interval", "[0, inf)"),
    ("train.eval_iters", "[0, inf)"),
    ("train.exit_interval", "(0, inf)"),
    ("train.spike_factor", "(1, inf)"),
    ("train.spike_window", "(0, inf)"),
    ("train.rollback_lr_scale", "(0, 1]"),
    ("train.max_rollbacks", "[0, inf)"),
    ("checkpoint.step", "(0, inf)"),
    ("logging.log_interval", "(0, inf)"),
    ("data.num_workers", "[0, inf)"),
    ("launcher.master_port", "[0, 65535]"),
    ("launcher.preempt_timeout_s", "(0, inf)"),
    ("model.vocab_size", "(0, inf)"),
    ("model.make_vocab_size_divisible_by", "(0, inf)"),
    ("model.head_dim", "(0, inf)"),
    ("model.max_position_embeddings", "(0, inf)"),
    ("model.rotary_base", "(0, inf)"),
    ("model.rotary_percent", "(0, 1]"),
    ("model.rope_scaling_factor", "(0, inf)"),
    ("model.yarn_rotary_scaling_factor", "(0, inf)"),
    ("model.yarn_original_max_position_embeddings", "(0, inf)"),
    ("model.yarn_beta_fast", "(0, inf)"),
    ("model.yarn_beta_slow", "(0, inf)"),
    ("model.norm_epsilon", "(0, inf)"),
    ("model.init_method_std", "[0, inf)"),
    ("model.hidden_dropout", "[0, 1)"),
    ("model.attention_dropout", "[0, 1)"),
    ("model.q_lora_rank", "(0, inf)"),
    ("model.kv_lora_rank", "(0, inf)"),
    ("model.qk_head_dim", "(0, inf)"),
    ("model.qk_pos_emb_head_dim", "(0, inf)"),
    ("model.v_head_dim", "(0, inf)"),
    ("model.moe_aux_loss_coeff", "[0, inf)"),
    ("model.moe_z_loss_coeff", "[0, inf)"),
    ("model.moe_router_num_groups", "(0, inf)"),
    ("model.moe_router_group_topk", "(0, inf)"),
    ("model.moe_router_topk_scaling_factor", "(0, inf)"),
    ("model.moe_shared_expert_intermediate_size", "(0, inf)"),
)

RANGE_RULES: tuple[tuple[str, Rule], ...] = (
    *((path, in_range(path, interval)) for path, interval in RANGES),
    ("optim.min_lr", min_lr_at_most_lr),
)

RULES = RULES + RANGE_RULES


def _device_of(cfg: Config) -> str:
    if cfg.launcher.device != "auto":
        return cfg.launcher.device
    if not optional.HAVE_TE:
        # The device decides only which layers build (Transformer Engine's on CUDA), and
        # without TE every device builds the local ones: no need to ask torch.
        return "cpu"
    import torch  # late: validating a config should not pay for torch unless it must

    return "cuda" if torch.cuda.is_available() else "cpu"


def violations(cfg: Config, world_size: int, device: Optional[str] = None) -> list[tuple[str, str]]:
    """Every broken rule as (field, rule text), in `RULES` order; [] for a valid config."""
    found = _size_violations(cfg, world_size)
    if found:
        return found
    device = device or _device_of(cfg)
    for field, rule in RULES:
        result = rule(cfg, world_size, device)
        found += [(field, text) for text in ([result] if isinstance(result, str) else result or [])]
    return found


def validate(cfg: Config, world_size: int, device: Optional[str] = None) -> None:
    """Raise ConfigError naming every broken rule. `device` defaults to launcher.device, with
    auto meaning cuda when torch sees a GPU."""
    found = violations(cfg, world_size, device)
    if found:
        (field, rule), *others = found
        raise ConfigError(field, rule, others)


def validate_layout(cfg: Config, world_size: int) -> None:
    """`validate`, then the `check_layout` of each plugin the run lists: for a layout the run
    starts on or moves to."""
    validate(cfg, world_size)
    sections = plugin_sections()
    for name in cfg.plugins:
        sections[name].check_layout(sections[name].own(cfg), cfg, world_size)


def validate_run(cfg: Config, world_size: int, device: Optional[str] = None) -> None:
    """Everything a config is checked for before launch: `validate`, then the `check` and
    `check_layout` of each plugin the run lists, in its order."""
    validate(cfg, world_size, device)
    sections = plugin_sections()
    for name in cfg.plugins:
        section, own = sections[name], sections[name].own(cfg)
        section.check(own, cfg, world_size)
        section.check_layout(own, cfg, world_size)


def resolve_dp(cfg: Config, world_size: int) -> int:
    """The data-parallel size of a launch with `world_size` processes."""
    dp = _dp_or_none(cfg, world_size)
    if dp is None:
        if cfg.parallel.dp is not None:
            raise ConfigError("parallel.dp", world_matches_layout(cfg, world_size, ""))
        raise ConfigError("launcher.nproc", world_divisible_by_model(cfg, world_size, ""))
    return dp


def evaluates(train: TrainConfig) -> bool:
    """Whether a run evaluates at all: every `eval_interval` steps and at the end, or once with
    `skip_train`. Megatron-LM's --eval-iters 0 turns off validation and test alike."""
    return bool(train.eval_iters and (train.eval_interval or train.skip_train))


def world_size_of(cfg: Config) -> int:
    """The number of processes the launch will have: what torchrun (WORLD_SIZE) or srun
    (SLURM_NTASKS) set up, else the launcher.nproc local workers the trainer starts itself."""
    launch = detect_launch()
    return launch.world_size if launch else cfg.launcher.nproc
