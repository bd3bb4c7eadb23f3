"""Every flag of Megatron-LM's `pretrain_gpt.py` parser, one row each, grouped as in Megatron-LM's
megatron/training/arguments.py (and megatron/post_training/arguments.py, which pretrain_gpt.py
adds when ModelOpt is installed), as of Megatron-LM commit d98e8a64 (2026-08-22): the
hand-written add_argument calls and the flags its ArgumentGroupFactory derives from
TransformerConfig and megatron.training.config's dataclasses; plus --legacy-tokenizer, a flag of
core_v0.16.1 that Megatron-LM's functional tests give and that commit no longer has.

A row says how the flag is read (its value syntax, as Megatron-LM's parser reads it) and what
it does here, one of:

- mapped: the same meaning, onto a config key. `derived` rows are computed together with other
  flags in `mlm_args._derived` (e.g. --hidden-size also sets the default FFN size).
- notice: accepted, with no effect here; one line saying so is printed at start.
- refused: the command line stops with the reason, listed with every other refused flag.

`only`: the values a mapped/notice flag accepts; any other value is refused with `refuse`.
`default`: Megatron-LM's default where it changes the model or the training; it is emitted
when the flag is absent, so a command line builds what Megatron-LM builds.
docs/megatron_flags.md is generated from this table (`python -m megatron_ext.pretrain_gpt
--flag-table`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

MAPPED, NOTICE, REFUSED = "mapped", "notice", "refused"
UNSET: Any = object()


@dataclass(frozen=True)
class Flag:
    # The option strings, the first one canonical (aliases after it).
    names: tuple[str, ...]
    # int / float / str, with Megatron's nargs appended ("int+", "str*", "int3"); or a switch:
    # on (store_true), off (store_false), bool (--x / --no-x).
    syntax: str
    status: str
    # mapped: the config key; notice: the notice; refused: the reason.
    target: str
    group: str = ""
    choices: Optional[tuple] = None
    only: Optional[tuple] = None
    refuse: str = ""
    # For switches: the value the key gets when the flag is given (on: True, off: False).
    const: Any = UNSET
    default: Any = UNSET
    derived: bool = False
    note: str = ""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def is_switch(self) -> bool:
        return self.syntax in ("on", "off", "bool")

    @property
    def value(self) -> Any:
        """What a switch sets its key to."""
        if self.const is not UNSET:
            return self.const
        return self.syntax != "off"


def _row(status: str, names: str, syntax: str, target: str, **kw: Any) -> Flag:
    return Flag(tuple(names.split()), syntax, status, target, **kw)


def mapped(names: str, syntax: str, key: str, **kw: Any) -> Flag:
    return _row(MAPPED, names, syntax, key, **kw)


def notice(names: str, syntax: str, text: str, **kw: Any) -> Flag:
    return _row(NOTICE, names, syntax, text, **kw)


def refused(names: str, syntax: str, reason: str, **kw: Any) -> Flag:
    return _row(REFUSED, names, syntax, reason, **kw)


def group(title: str, *flags: Flag) -> tuple[Flag, ...]:
    return tuple(replace(flag, group=title) for flag in flags)


# Reasons shared by many rows.
FUSION = 'a kernel fusion switch: the local layers here compute the same math without it'
OVERLAP = 'communication overlap or scheduling: no effect on results here'
TUNE = 'a performance or memory tuning knob: no effect on results here'
PROFILE = 'profiling: not run here'
RECOMPUTE = 'activation recomputation trades memory for time: activations are kept here, results are the same'
CUDA_GRAPH = 'CUDA graphs: not captured here, the same math runs eagerly'
FP8 = 'an fp8/fp4 recipe knob: no effect, megatron_ext does not compute in fp8/fp4'
FSDP = 'Megatron-FSDP: trains with DDP and the distributed optimizer instead (the same math, more memory)'
CKPT_IO = 'checkpoint I/O tuning: no effect on what is saved here'
LOG = 'a logging/monitoring option megatron_ext does not have: no effect on training'
INFER = 'inference/serving setting: no effect on pretraining'
NO_KEY = 'megatron_ext has no config key for it'

# Reasons shared within a group.
NOT_MODELLED = "not in megatron_ext's model space"
G_REGULARIZATION = 'only the Adam (and SGD) optimizers are supported'
G_RL = "reinforcement learning (Megatron-LM's train_rl.py) is not part of this trainer"
G_AUTORESUME = 'ADLR autoresume: not used; pre-emption is handled by launcher.preempt_timeout_s'
G_BIENCODER = "read by Megatron-LM's biencoder/ICT scripts only: no effect in pretrain_gpt"
G_VISION = "read by Megatron-LM's vision scripts only: no effect in pretrain_gpt"
G_EXPERIMENTAL_ATTENTION_VARIANT = "linear attention variants are not in megatron_ext's model space"
G_HETEROGENEOUS_ARCHITECTURE = "heterogeneous layer configs are not in megatron_ext's model space"
G_LOGITS_DISTILLATION = 'logits distillation is not part of this trainer'
G_IN_PROCESS_RESTART = 'in-process restart: not used; restarts are launcher.max_restarts'
G_FT_PACKAGE = 'NVIDIA fault-tolerance package: not used; restarts are launcher.max_restarts'
G_RERUN_ENGINE = 'the rerun state machine (result validation) is not run here'
G_MSC = 'Multi-Storage Client: paths here are local files'
SFT_PACKING = (
    'with --sft, what packed conversations do (positions restart, attention stays within each one, no loss '
    'across them); without, refused: document boundaries of pre-training data are not masked here'
)
G_FAULT_INJECTOR = 'fault injection is not part of this trainer'
G_MODELOPT_GENERIC = 'ModelOpt (quantization/distillation/export) is not part of this trainer'

FLAGS: tuple[Flag, ...] = (
    # transformer configuration
    *group(
        'transformer configuration',
        mapped('--tensor-model-parallel-size', 'int', 'parallel.tp'),
        refused('--tensor-parallel-num-weight-shards', 'int', NOT_MODELLED),
        notice('--pipeline-model-parallel-comm-backend', 'str', OVERLAP, choices=('nccl', 'ucc')),
        mapped('--pipeline-model-parallel-size', 'int', 'parallel.pp'),
        mapped(
            '--sequence-parallel', 'on', 'parallel.sequence_parallel', derived=True,
            note='at --tensor-model-parallel-size 1 turned off with a notice, as Megatron-LM does',
        ),
        mapped('--context-parallel-size', 'int', 'parallel.cp'),
        refused('--hierarchical-context-parallel-sizes', 'int+', NOT_MODELLED),
        refused('--max-seqlen-per-dp-cp-rank', 'int', NOT_MODELLED),
        refused('--hybrid-context-parallel', 'on', NOT_MODELLED),
        mapped('--expert-model-parallel-size', 'int', 'parallel.ep'),
        mapped(
            '--expert-tensor-parallel-size', 'int', 'parallel.tp', derived=True,
            note="must equal --tensor-model-parallel-size with --num-experts (megatron_ext's expert TP is the TP size); without experts another value has no effect, with a notice",
        ),
        refused('--expert-tensor-parallel-num-weight-shards', 'int', NOT_MODELLED),
        refused('--no-initialization', 'off', 'weights are always initialised here'),
        notice('--use-cpu-initialization', 'on', TUNE),
        mapped('--fp16', 'on', 'model.precision', const='fp16'),
        mapped('--bf16', 'on', 'model.precision', const='bf16'),
        notice(
            '--deterministic-mode', 'on',
            "no effect: megatron_ext does not switch torch's deterministic algorithms on",
        ),
        notice('--tp-comm-overlap', 'on', OVERLAP),
        notice('--no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad', 'off', OVERLAP),
        notice('--no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad', 'off', OVERLAP),
        notice('--no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag', 'off', OVERLAP),
        notice('--no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs', 'off', OVERLAP),
        notice('--tp-comm-overlap-rs-dgrad', 'on', OVERLAP),
        notice('--no-tp-comm-split-ag --disable-tp-comm-split-ag', 'off', OVERLAP),
        notice('--no-tp-comm-split-rs --disable-tp-comm-split-rs', 'off', OVERLAP),
        notice('--cross-entropy-loss-fusion', 'on', FUSION),
        notice('--cross-entropy-fusion-impl', 'str', FUSION, choices=('native', 'te')),
        notice('--tp-comm-bootstrap-backend', 'str', OVERLAP, choices=('nccl', 'mpi', 'gloo')),
        notice('--overlap-moe-expert-parallel-comm', 'on', OVERLAP),
        notice('--delay-wgrad-compute', 'on', OVERLAP),
        notice('--overlap-dispatch-backward-with-experts-wgrad', 'on', OVERLAP),
        notice('--ep-overlap-early-attn-memory-release', 'on', OVERLAP),
        notice('--use-ring-exchange-p2p', 'on', OVERLAP),
        notice('--defer-embedding-wgrad-compute', 'on', OVERLAP),
        notice('--wgrad-deferral-limit', 'int', OVERLAP),
        notice('--overlap-p2p-communication-warmup-flush', 'on', OVERLAP),
        refused(
            '--microbatch-group-size-per-virtual-pipeline-stage', 'int',
            "megatron_ext's interleaved schedule groups parallel.pp micro-batches (megatron-core's default)",
        ),
        refused(
            '--mtp-standalone', 'on', "multi-token prediction is not in megatron_ext's model space",
        ),
        notice('--cpu-offloading-num-layers', 'int', TUNE),
        notice('--cpu-offloading-retain-pinned-cpu-buffers', 'on', TUNE),
        mapped('--num-layers', 'int', 'model.num_layers'),
        mapped('--mtp-num-layers', 'int', 'model.mtp_num_layers'),
        mapped('--mtp-loss-scaling-factor', 'float', 'model.mtp_loss_scaling_factor', default=0.1),
        refused(
            '--mtp-use-repeated-layer', 'on',
            "multi-token prediction is not in megatron_ext's model space",
        ),
        refused(
            '--mtp-detach-heads', 'on',
            "multi-token prediction is not in megatron_ext's model space",
        ),
        refused('--mtp-hsm', 'on', "multi-token prediction is not in megatron_ext's model space"),
        refused(
            '--mtp-hybrid-override-pattern', 'str',
            "multi-token prediction is not in megatron_ext's model space",
        ),
        refused(
            '--account-for-embedding-in-pipeline-split', 'on',
            'use --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers',
        ),
        refused(
            '--account-for-loss-in-pipeline-split', 'on',
            'use --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers',
        ),
        mapped(
            '--hidden-size', 'int', 'model.hidden_size', derived=True,
            note="also model.ffn_hidden_size when --ffn-hidden-size is absent: 4h, or int(8h/3 / 64) * 64 with --swiglu (Megatron-LM's rule)",
        ),
        mapped('--num-attention-heads', 'int', 'model.num_attention_heads'),
        mapped(
            '--attention-backend', 'str', 'model.attention_backend',
            choices=('flash', 'fused', 'unfused', 'local', 'auto'), default='auto',
            note="on local layers: torch's SDPA for auto/flash/fused, megatron's DotProductAttention for unfused/local",
        ),
        notice(
            '--flash-attention-version', 'int', 'attention kernel choice: no effect here',
            choices=(2, 3, 4),
        ),
        mapped(
            '--softmax-type', 'str', 'model.softmax_type', choices=('vanilla', 'off-by-one', 'learnable'),
            default='vanilla',
        ),
        mapped(
            '--num-query-groups', 'int', 'model.num_query_groups', derived=True,
            note='read with --group-query-attention; ignored without it (a notice), as in Megatron-LM',
        ),
        mapped('--ffn-hidden-size', 'int', 'model.ffn_hidden_size', derived=True),
        mapped('--kv-channels', 'int', 'model.head_dim'),
        mapped('--hidden-dropout', 'float', 'model.hidden_dropout', default=0.1),
        mapped('--attention-dropout', 'float', 'model.attention_dropout', default=0.1),
        refused('--fp32-residual-connection', 'on', NOT_MODELLED),
        refused('--apply-residual-connection-post-layernorm', 'on', NOT_MODELLED),
        mapped('--norm-epsilon', 'float', 'model.norm_epsilon', default=1e-05),
        notice(
            '--apply-layernorm-1p', 'on',
            'zero-centred norm weights (stored as gamma - 1): the same function, init and updates, since norm weights get no weight decay; the local norm stores gamma itself',
        ),
        mapped('--disable-bias-linear', 'off', 'model.add_bias_linear', default=True),
        mapped('--add-qkv-bias', 'on', 'model.add_qkv_bias', default=False),
        mapped('--glu-linear-offset', 'float', 'model.glu_linear_offset', default=0.0),
        mapped('--activation-func-clamp-value', 'float', 'model.activation_func_clamp_value'),
        refused('--rotary-interleaved', 'on', NOT_MODELLED),
        mapped(
            '--normalization', 'str', 'model.normalization', choices=('LayerNorm', 'RMSNorm'),
            default='LayerNorm',
        ),
        mapped('--qk-layernorm', 'on', 'model.qk_layernorm', default=False),
        refused('--qk-l2-norm', 'on', NOT_MODELLED),
        refused('--qk-clip', 'on', NOT_MODELLED),
        refused('--qk-clip-alpha', 'float', NOT_MODELLED),
        refused('--qk-clip-threshold', 'float', NOT_MODELLED),
        refused('--attention-output-gate', 'on', NOT_MODELLED),
        notice(
            '--calculate-per-token-loss', 'on',
            "the loss is averaged over the global batch's tokens: every micro-batch here counts seq_length tokens, so this equals Megatron's per-micro-batch mean",
        ),
        mapped('--multi-latent-attention', 'on', 'model.multi_latent_attention', default=False),
        refused(
            '--experimental-attention-variant', 'str', NOT_MODELLED,
            choices=('gdn', 'gdn2', 'dsa', 'gated_delta_net'),
        ),
        refused('--dsa-indexer-n-heads', 'int', NOT_MODELLED),
        refused('--dsa-indexer-head-dim', 'int', NOT_MODELLED),
        refused('--dsa-indexer-topk', 'int', NOT_MODELLED),
        refused('--dsa-indexer-topk-freq', 'int', NOT_MODELLED),
        refused('--dsa-indexer-skip-topk-offset', 'int', NOT_MODELLED),
        refused('--dsa-indexer-loss-coeff', 'float', NOT_MODELLED),
        refused('--dsa-indexer-use-sparse-loss', 'on', NOT_MODELLED),
        refused(
            '--dsa-kernel-backend', 'str', NOT_MODELLED,
            choices=('none', 'tilelang', 'cudnn'),
        ),
        refused('--dsa-indexer-rope-interleaved', 'on', NOT_MODELLED),
        refused(
            '--no-dsa-indexer-rotate-activation --disable-dsa-indexer-rotate-activation', 'off',
            NOT_MODELLED,
        ),
        refused(
            '--no-dsa-indexer-scoring-relu --disable-dsa-indexer-scoring-relu', 'off',
            NOT_MODELLED,
        ),
        refused('--dsa-indexer-k-norm-epsilon', 'float', NOT_MODELLED),
        refused('--dsa-indexer-k-norm-fp32', 'on', NOT_MODELLED),
        refused('--linear-conv-kernel-dim', 'int', NOT_MODELLED),
        refused('--linear-key-head-dim', 'int', NOT_MODELLED),
        refused('--linear-value-head-dim', 'int', NOT_MODELLED),
        refused('--linear-num-key-heads', 'int', NOT_MODELLED),
        refused('--linear-num-value-heads', 'int', NOT_MODELLED),
        mapped('--init-method-std', 'float', 'model.init_method_std', default=0.02),
        refused('--embedding-init-method-std', 'float', NOT_MODELLED),
        notice('--init-model-with-meta-device', 'on', TUNE),
        refused('--use-mup', 'on', "muP parametrisation is not in megatron_ext's model space"),
        refused(
            '--mup-width-mult', 'float', "muP parametrisation is not in megatron_ext's model space",
        ),
        refused(
            '--mup-base-hidden-size', 'int',
            "muP parametrisation is not in megatron_ext's model space",
        ),
        refused(
            '--mup-embedding-mult', 'float',
            "muP parametrisation is not in megatron_ext's model space",
        ),
        refused(
            '--mup-output-mult', 'float',
            "muP parametrisation is not in megatron_ext's model space",
        ),
        refused(
            '--mup-base-head-dim', 'float',
            "muP parametrisation is not in megatron_ext's model space",
        ),
        refused(
            '--mup-attn-scale-power', 'float',
            "muP parametrisation is not in megatron_ext's model space",
        ),
        notice(
            '--apply-query-key-layer-scaling', 'on',
            'an fp16 overflow guard that scales the scores by the layer number and back: the same math, softmax runs in fp32 here',
        ),
        notice(
            '--disable-bf16-reduced-precision-matmul', 'on',
            "no effect: megatron_ext leaves torch's reduced-precision matmul setting as it is",
        ),
        notice('--use-fused-weighted-squared-relu', 'on', FUSION),
        notice('--fused-residual-rmsnorm', 'on', FUSION),
        notice('--use-transformer-engine-op-fuser', 'on', FUSION),
        notice('--recompute-granularity', 'str', RECOMPUTE, choices=('full', 'selective')),
        notice('--recompute-method', 'str', RECOMPUTE, choices=('uniform', 'block')),
        notice('--recompute-num-layers', 'int', RECOMPUTE),
        notice('--distribute-saved-activations', 'on', RECOMPUTE),
        notice('--recompute-modules', 'str+', RECOMPUTE),
        notice(
            '--fp8-format', 'str',
            'fp8 compute is not implemented here: the run trains in its --bf16/--fp16 precision',
            choices=('e4m3', 'hybrid'),
        ),
        notice(
            '--fp8-recipe', 'str', FP8,
            choices=('tensorwise', 'delayed', 'mxfp8', 'blockwise', 'custom'),
        ),
        notice('--fp8-quantizer-factory', 'str', FP8),
        notice('--fp8-margin', 'int', FP8),
        notice('--fp8-interval', 'int', FP8),
        notice('--fp8-amax-history-len', 'int', FP8),
        notice('--fp8-amax-compute-algo', 'str', FP8, choices=('most_recent', 'max')),
        notice('--no-fp8-wgrad --disable-fp8-wgrad', 'off', FP8),
        notice('--fp8-output-proj', 'on', FP8),
        notice('--first-last-layers-bf16', 'on', FP8),
        notice('--num-layers-at-start-in-bf16', 'int', FP8),
        notice('--num-layers-at-end-in-bf16', 'int', FP8),
        refused('--use-kitchen-attention', 'on', NOT_MODELLED),
        refused(
            '--kitchen-attention-backend', 'str', NOT_MODELLED,
            choices=('sdpa', 'fa'),
        ),
        notice('--fp4-format', 'str', FP8, choices=('e2m1',)),
        notice('--fp4-recipe', 'str', FP8, choices=('nvfp4', 'custom')),
        notice('--fp4-quantizer-factory', 'str', FP8),
        notice('--high-priority-a2a-comm-stream', 'on', OVERLAP),
        mapped(
            '--moe-shared-expert-intermediate-size', 'int',
            'model.moe_shared_expert_intermediate_size',
        ),
        refused('--moe-shared-expert-gate', 'on', "not in megatron_ext's MoE model space"),
        notice('--moe-shared-expert-overlap', 'on', OVERLAP),
        notice('--use-grouped-gemm-for-shared-expert', 'on', TUNE),
        refused(
            '--moe-shared-expert-glu-interleave-size', 'int',
            "not in megatron_ext's MoE model space",
        ),
        mapped('--moe-ffn-hidden-size', 'int', 'model.moe_ffn_hidden_size'),
        mapped('--moe-router-topk', 'int', 'model.moe_router_topk', default=2),
        refused('--moe-enable-routing-replay', 'on', "not in megatron_ext's MoE model space"),
        notice('--moe-router-padding-for-quantization', 'on', FP8),
        notice('--moe-router-padding-for-fp8', 'on', FP8),
        mapped('--moe-router-num-groups', 'int', 'model.moe_router_num_groups'),
        mapped('--moe-router-group-topk', 'int', 'model.moe_router_group_topk'),
        mapped('--moe-router-pre-softmax', 'on', 'model.moe_router_pre_softmax', default=False),
        mapped(
            '--moe-router-topk-scaling-factor', 'float', 'model.moe_router_topk_scaling_factor',
        ),
        mapped(
            '--moe-router-score-function', 'str', 'model.moe_router_score_function',
            choices=('softmax', 'sigmoid', 'sqrtsoftplus'), default='softmax',
            only=('softmax', 'sigmoid'),
            refuse='megatron-core 0.16 routers score with softmax or sigmoid',
        ),
        notice(
            '--moe-router-dtype', 'str',
            "the router computes in the run's precision here (fp32 on CPU)",
            choices=('fp32', 'fp64'), only=('fp32',), refuse='fp64 routing is not supported',
        ),
        mapped(
            '--moe-router-enable-expert-bias', 'on', 'model.moe_router_enable_expert_bias',
            default=False,
        ),
        notice(
            '--moe-router-bias-update-rate', 'float',
            "megatron-core's default rate (0.001) is used", only=(0.001,),
            refuse=NO_KEY + ' (only the default 0.001)',
        ),
        refused(
            '--moe-router-quantile-balancing-ema', 'float', "not in megatron_ext's MoE model space",
        ),
        mapped('--moe-router-force-load-balancing', 'on', 'model.moe_router_force_load_balancing'),
        refused('--moe-router-force-biased', 'float', "not in megatron_ext's MoE model space"),
        notice('--use-grouped-gemm-for-dense-mlp', 'on', TUNE),
        mapped('--moe-grouped-gemm', 'on', 'model.moe_grouped_gemm', default=False),
        notice('--moe-use-grouped-tensor', 'on', TUNE),
        refused('--moe-single-grouped-weight', 'on', "not in megatron_ext's MoE model space"),
        refused('--moe-single-grouped-bias', 'on', "not in megatron_ext's MoE model space"),
        mapped('--moe-z-loss-coeff', 'float', 'model.moe_z_loss_coeff'),
        refused('--moe-input-jitter-eps', 'float', "not in megatron_ext's MoE model space"),
        mapped(
            '--moe-token-dispatcher-type', 'str', 'model.moe_token_dispatcher',
            choices=('allgather', 'alltoall', 'flex'), default='allgather',
            note='flex without DeepEP/HybridEP on CUDA runs the alltoall dispatcher, with a notice',
        ),
        refused('--moe-enable-deepep', 'on', "not in megatron_ext's MoE model space"),
        mapped(
            '--moe-flex-dispatcher-backend', 'str', 'model.moe_flex_dispatcher_backend',
            choices=('deepep', 'hybridep', 'ncclep'), only=('deepep', 'hybridep'),
            refuse="megatron-core 0.16's flex dispatcher has no ncclep backend",
        ),
        refused(
            '--moe-permute-fusion-into-hybridep', 'on', "not in megatron_ext's MoE model space",
        ),
        refused(
            '--moe-hybridep-pad-uneven-dispatch-inputs', 'on',
            "not in megatron_ext's MoE model space",
        ),
        notice('--moe-per-layer-logging', 'on', LOG),
        refused('--moe-expert-capacity-factor', 'float', "not in megatron_ext's MoE model space"),
        refused(
            '--moe-pad-expert-input-to-capacity', 'on', "not in megatron_ext's MoE model space",
        ),
        notice('--moe-pad-experts-for-cuda-graph-inference', 'on', INFER),
        notice(
            '--moe-token-drop-policy', 'str', 'no token dropping without a capacity factor',
            choices=('probs', 'position'), only=('probs',),
            refuse='token dropping needs --moe-expert-capacity-factor, which is refused',
        ),
        notice('--moe-layer-recompute', 'on', RECOMPUTE),
        notice('--moe-permute-fusion', 'on', FUSION),
        notice('--moe-router-fusion', 'on', FUSION),
        refused('--moe-apply-probs-on-input', 'on', "not in megatron_ext's MoE model space"),
        refused('--moe-latent-size', 'int', "not in megatron_ext's MoE model space"),
        refused('--gtp-remat-opt-in-modules', 'str+', NOT_MODELLED),
        notice('--moe-flex-dispatcher-num-sms', 'int', TUNE),
        notice('--moe-deepep-num-sms', 'int', TUNE),
        notice('--moe-hybridep-num-sms', 'int', TUNE),
        notice('--moe-hybridep-num-blocks-permute', 'int', TUNE),
        notice('--moe-hybridep-num-blocks-unpermute', 'int', TUNE),
        notice('--moe-hybridep-num-sms-preprocessing', 'int', TUNE),
        notice('--moe-ncclep-zero-copy', 'on', TUNE),
        notice(
            '--moe-dispatch-fwd-dtype', 'str', "tokens are dispatched in the model's precision",
            choices=('bf16', 'mxfp8'), only=('bf16',),
            refuse='mxfp8 dispatch needs Transformer Engine kernels',
        ),
        notice(
            '--moe-combine-bwd-dtype', 'str', "tokens are combined in the model's precision",
            choices=('bf16', 'mxfp8'), only=('bf16',),
            refuse='mxfp8 combine needs Transformer Engine kernels',
        ),
        refused('--moe-mlp-glu-interleave-size', 'int', "not in megatron_ext's MoE model space"),
        refused(
            '--moe-expert-rank-capacity-factor', 'float', "not in megatron_ext's MoE model space",
        ),
        notice('--enable-cuda-graph', 'on', CUDA_GRAPH),
        notice('--cuda-graph-warmup-steps', 'int', CUDA_GRAPH),
        notice('--external-cuda-graph', 'on', CUDA_GRAPH),
        notice(
            '--cuda-graph-impl', 'str', CUDA_GRAPH,
            choices=('none', 'local', 'transformer_engine', 'full_iteration'),
        ),
        notice(
            '--inference-cuda-graph-scope', 'str', CUDA_GRAPH, choices=('none', 'layer', 'block'),
        ),
        refused('--enable-mhc-connections', 'on', NOT_MODELLED),
        refused('--mhc-num-residual-streams', 'int', NOT_MODELLED),
        refused('--mhc-sinkhorn-iterations', 'int', NOT_MODELLED),
        refused('--mhc-init-gating-factor', 'float', NOT_MODELLED),
        refused('--mhc-recompute-layer-num', 'int', NOT_MODELLED),
        notice(
            '--no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding',
            'off', TUNE,
        ),
        notice('--config-logger-dir', 'str', LOG),
        notice('--flash-decode', 'on', INFER),
        notice('--batch-invariant-mode', 'on', TUNE),
        notice(
            '--batch-invariant-backend', 'str', TUNE, choices=('te_native', 'deepgemm', 'triton'),
        ),
        notice('--use-te-activation-func', 'on', FUSION),
        notice(
            '--symmetric-ar-type', 'str', INFER,
            choices=('two_shot', 'one_shot', 'multimem_all_reduce'),
        ),
        notice('--nccl-all-reduce-for-prefill', 'on', INFER),
        notice('--inference-fuse-tp-communication', 'on', INFER),
        notice('--inference-disable-triton-nvls-kernels', 'on', INFER),
        notice(
            '--inference-grouped-gemm-backend', 'str', INFER,
            choices=('flashinfer', 'torch', 'vllm'),
        ),
        notice('--inference-moe-disable-fused-quant-kernels', 'on', INFER),
        notice('--inference-moe-token-dispatcher-type', 'str', INFER, choices=('nccl', 'nvls')),
        refused('--mrope-section', 'int+', NOT_MODELLED),
        refused(
            '--is-hybrid-model', 'on',
            "hybrid models are Megatron-LM's pretrain_mamba.py; here: python -m megatron_ext.train model.arch=hybrid",
        ),
        notice(
            '--mamba-state-dim', 'int',
            'Mamba sizes: pretrain_gpt builds no Mamba layers (hybrid models: python -m megatron_ext.train model.arch=hybrid)',
        ),
        notice(
            '--mamba-head-dim', 'int',
            'Mamba sizes: pretrain_gpt builds no Mamba layers (hybrid models: python -m megatron_ext.train model.arch=hybrid)',
        ),
        notice(
            '--mamba-num-groups', 'int',
            'Mamba sizes: pretrain_gpt builds no Mamba layers (hybrid models: python -m megatron_ext.train model.arch=hybrid)',
        ),
        notice(
            '--mamba-num-heads', 'int',
            'Mamba sizes: pretrain_gpt builds no Mamba layers (hybrid models: python -m megatron_ext.train model.arch=hybrid)',
        ),
        notice(
            '--gdp-num-householder', 'int',
            'Mamba sizes: pretrain_gpt builds no Mamba layers (hybrid models: python -m megatron_ext.train model.arch=hybrid)',
        ),
        notice(
            '--disable-mamba-mem-eff-path', 'off',
            'Mamba sizes: pretrain_gpt builds no Mamba layers (hybrid models: python -m megatron_ext.train model.arch=hybrid)',
        ),
        notice(
            '--gdp-cutedsl-kernel', 'on',
            'Mamba sizes: pretrain_gpt builds no Mamba layers (hybrid models: python -m megatron_ext.train model.arch=hybrid)',
        ),
        notice(
            '--gdp-num-chunk-states-to-recompute', 'int',
            'Mamba sizes: pretrain_gpt builds no Mamba layers (hybrid models: python -m megatron_ext.train model.arch=hybrid)',
        ),
        notice('--mlp-chunks-for-prefill', 'int', TUNE),
        notice('--mlp-chunks-for-training', 'int', TUNE),
        mapped(
            '--transformer-impl', 'str', 'model.spec',
            choices=('local', 'transformer_engine', 'inference_optimized'), derived=True,
            note='local: local; transformer_engine: auto (Transformer Engine layers on CUDA when installed, else the local layers, with a notice); inference_optimized is refused',
        ),
        notice('--fine-grained-activation-offloading', 'on', TUNE),
        notice('--offload-modules', 'str+', TUNE),
        notice('--min-offloaded-tensor-size', 'int', TUNE),
        notice('--delay-offload-until-cuda-graph', 'on', TUNE),
        notice('--delta-offload-bytes-across-pp-ranks', 'int', TUNE),
        notice('--activation-offload-fraction', 'float', TUNE),
        notice('--moe-paged-stash', 'on', TUNE),
        notice('--moe-paged-stash-page-size', 'int', TUNE),
        notice('--moe-paged-stash-buffer-size-factor-cuda', 'float', TUNE),
        notice('--moe-paged-stash-buffer-size-factor-cpu', 'float', TUNE),
        notice('--fine-grained-offloading-max-inflight-offloads', 'int', TUNE),
    ),
    # network size
    *group(
        'network size',
        refused(
            '--encoder-num-layers', 'int',
            'encoder-decoder models are not part of pretrain_gpt: use --num-layers',
        ),
        refused('--decoder-num-layers', 'int', 'use --num-layers'),
        mapped(
            '--group-query-attention', 'on', 'model.num_query_groups', derived=True,
            note='the groups are --num-query-groups, default 1; without it one group per head',
        ),
        mapped(
            '--window-size', 'str', 'model.window_size', derived=True,
            note='"L,R": a query sees the L keys before it and R after',
        ),
        mapped(
            '--window-attn-skip-freq', 'str', 'model.window_attn_skip_freq', derived=True,
            note="an integer N: every N-th layer keeps full attention (Megatron-LM's list pattern is refused)",
        ),
        mapped('--max-position-embeddings', 'int', 'model.max_position_embeddings'),
        mapped(
            '--position-embedding-type', 'str', 'model.position_embedding_type',
            choices=('learned_absolute', 'rope', 'yarn', 'mrope', 'relative', 'none'),
            default='learned_absolute', only=('learned_absolute', 'rope', 'yarn', 'none'),
            refuse="mrope and relative positions are not in megatron_ext's model space",
        ),
        mapped('--yarn-original-max-position-embeddings', 'int', 'model.yarn_original_max_position_embeddings'),
        mapped('--yarn-beta-fast', 'float', 'model.yarn_beta_fast'),
        mapped('--yarn-beta-slow', 'float', 'model.yarn_beta_slow'),
        refused(
            '--yarn-correction-range-round-to-int', 'on',
            "YaRN's parameters have no config keys here (megatron-core's defaults are used)",
        ),
        refused(
            '--no-yarn-correction-range-round-to-int', 'off',
            "YaRN's parameters have no config keys here (megatron-core's defaults are used)",
        ),
        notice(
            '--relative-attention-num-buckets', 'int',
            'read only with --position-embedding-type relative (refused)',
        ),
        notice(
            '--relative-attention-max-distance', 'int',
            'read only with --position-embedding-type relative (refused)',
        ),
        mapped(
            '--use-rotary-position-embeddings', 'on', 'model.position_embedding_type', const='rope',
        ),
        mapped('--rotary-base', 'int', 'model.rotary_base', default=10000),
        mapped('--rotary-percent', 'float', 'model.rotary_percent', default=1.0),
        refused('--rotary-seq-len-interpolation-factor', 'int', NOT_MODELLED),
        mapped('--use-rope-scaling', 'on', 'model.rope_scaling', const='llama3', default=None),
        mapped('--rope-scaling-factor', 'float', 'model.rope_scaling_factor', default=8.0),
        refused('--no-rope-freq', 'str', NOT_MODELLED),
        notice(
            '--no-position-embedding', 'off',
            'deprecated: with rope positions there is no position table anyway', derived=True,
        ),
        mapped(
            '--make-vocab-size-divisible-by', 'int', 'model.make_vocab_size_divisible_by',
            default=128,
        ),
        refused(
            '--openai-gelu', 'on',
            "the tanh-approximated GeLU is not in megatron_ext's model space",
        ),
        mapped(
            '--squared-relu', 'on', 'model.activation', derived=True, const='squared_relu',
            note="without --swiglu or --squared-relu: Megatron-LM's gelu",
        ),
        mapped(
            '--swiglu', 'on', 'model.activation', derived=True, const='swiglu',
            note="without --swiglu or --squared-relu: Megatron-LM's gelu",
        ),
        mapped(
            '--quick-geglu', 'on', 'model.activation', derived=True, const='quick_geglu',
            note="without --swiglu, --squared-relu or --quick-geglu: Megatron-LM's gelu",
        ),
        notice('--onnx-safe', 'str', 'ONNX export: no effect on training'),
        notice('--bert-no-binary-head', 'off', 'BERT only: no effect in pretrain_gpt'),
        mapped(
            '--untie-embeddings-and-output-weights', 'on', 'model.tie_embeddings', const=False,
            default=True,
        ),
    ),
    # regularization
    *group(
        'regularization',
        mapped('--weight-decay', 'float', 'optim.weight_decay', default=0.01),
        refused('--apply-wd-to-qk-layernorm', 'on', 'norm weights get no weight decay here'),
        mapped('--clip-grad', 'float', 'optim.clip_grad', default=1.0),
        mapped('--adam-beta1', 'float', 'optim.adam_beta1', default=0.9),
        mapped('--adam-beta2', 'float', 'optim.adam_beta2', default=0.999),
        mapped('--adam-eps', 'float', 'optim.adam_eps', default=1e-08),
        notice(
            '--sgd-momentum', 'float', "megatron-core's default momentum (0.9) is used",
            only=(0.9,), refuse=NO_KEY + ' (only the default 0.9)',
        ),
        refused('--muon-momentum', 'float', G_REGULARIZATION),
        refused('--muon-no-split-qkv', 'off', G_REGULARIZATION),
        refused('--muon-nesterov', 'on', G_REGULARIZATION),
        refused(
            '--muon-scale-mode', 'str', G_REGULARIZATION,
            choices=('spectral', 'unit_rms_norm', 'shape_scaling'),
        ),
        refused(
            '--muon-fp32-matmul-prec', 'str', G_REGULARIZATION, choices=('low', 'medium', 'high'),
        ),
        refused('--muon-coefficient-type', 'str', G_REGULARIZATION),
        refused('--muon-num-ns-steps', 'int', G_REGULARIZATION),
        refused(
            '--muon-tp-mode', 'str', G_REGULARIZATION,
            choices=('blockwise', 'duplicated', 'distributed'),
        ),
        refused('--muon-use-syrk', 'on', G_REGULARIZATION),
        refused('--muon-extra-scale-factor', 'float', G_REGULARIZATION),
        refused('--muon-scalar-optimizer', 'str', G_REGULARIZATION, choices=('adam', 'lion')),
        refused('--lion-beta1', 'float', G_REGULARIZATION),
        refused('--lion-beta2', 'float', G_REGULARIZATION),
        refused(
            '--no-weight-decay-cond-type', 'str',
            "norm weights and biases get no weight decay here (Megatron's default)",
            choices=('apply_wd_to_qk_layernorm',),
        ),
    ),
    # profiling
    *group(
        'profiling',
        notice('--profile', 'on', PROFILE),
        notice('--profile-step-start', 'int', PROFILE),
        notice('--profile-step-end', 'int', PROFILE),
        notice('--use-pytorch-profiler', 'on', PROFILE),
        notice('--pytorch-profiler-collect-shapes', 'on', PROFILE),
        notice('--pytorch-profiler-collect-callstack', 'on', PROFILE),
        notice('--pytorch-profiler-collect-chakra', 'on', PROFILE),
        notice('--profile-ranks', 'int+', PROFILE),
        notice('--record-memory-history', 'on', PROFILE),
        notice('--memory-snapshot-path', 'str', PROFILE),
        notice('--record-shapes', 'on', PROFILE),
        notice('--nvtx-ranges', 'on', PROFILE),
    ),
    # training
    *group(
        'training',
        mapped('--micro-batch-size', 'int', 'train.micro_batch_size'),
        mapped('--global-batch-size', 'int', 'train.global_batch_size', default=None),
        mapped(
            '--rampup-batch-size', 'int3', 'train.rampup_batch_size',
            note="megatron-core 0.16's ramp (Megatron-LM now deprecates it), with --train-samples",
        ),
        mapped(
            '--step-batch-size-schedule', 'str', 'train.step_batch_size_schedule',
            note='thresholds in tokens; --global-batch-size beside it must be its last batch size '
            '(Megatron-LM refuses both together, though its gpt3 example passes both)',
        ),
        refused(
            '--decrease-batch-size-if-needed', 'on',
            'the global batch is not decreased to fit: it must be divisible by --micro-batch-size * dp',
        ),
        notice('--empty-unused-memory-level', 'int', TUNE, choices=(0, 1, 2)),
        notice('--check-weight-hash-across-dp-replicas-interval', 'int', TUNE),
        notice('--gpu-sniff-test-interval', 'int', TUNE),
        notice('--train-sync-interval', 'int', TUNE),
        mapped('--train-iters', 'int', 'train.iters'),
        mapped('--train-samples', 'int', 'train.train_samples'),
        mapped('--exit-interval', 'int', 'train.exit_interval'),
        notice(
            '--exit-duration-in-mins', 'int',
            'a wall-clock limit: not enforced here (use --exit-interval)',
        ),
        notice(
            '--exit-signal-handler', 'on',
            'pre-emption signals (SIGTERM, SIGINT, SIGUSR1) are always handled: save and exit',
        ),
        notice(
            '--exit-signal', 'str',
            'pre-emption signals (SIGTERM, SIGINT, SIGUSR1) are always handled: save and exit',
        ),
        notice(
            '--exit-signal-handler-for-dataloader', 'on',
            'pre-emption signals are handled by the trainer',
        ),
        notice(
            '--exit-signal-handler-for-training', 'on',
            'pre-emption signals are handled by the trainer',
        ),
        mapped('--manual-gc', 'on', 'train.manual_gc'),
        mapped('--manual-gc-interval', 'int', 'train.manual_gc_interval'),
        mapped('--no-manual-gc-eval --disable-manual-gc-eval', 'off', 'train.manual_gc_eval'),
        refused('--iterations-to-skip', 'int+', NO_KEY),
        refused('--batch-size', 'int', 'deprecated in Megatron-LM: use --micro-batch-size'),
        notice('--recompute-activations', 'on', RECOMPUTE),
        mapped(
            '--no-check-for-nan-in-loss-and-grad', 'off', 'train.check_for_nan',
            note='the check is of the global gradient norm before the optimizer step, and the loss; '
            'train.nan_policy says what follows (stop, as Megatron-LM, or rollback)',
        ),
        notice(
            '--check-for-large-grads', 'on',
            'the rerun state machine (result validation) is not run here',
        ),
        notice(
            '--result-rejected-tracker-filename', 'str',
            'the rerun state machine (result validation) is not run here',
        ),
        notice('--tp-comm-overlap-cfg', 'str', TUNE),
        notice('--checkpoint-activations', 'on', RECOMPUTE),
        notice('--no-masked-softmax-fusion', 'off', FUSION),
        notice('--no-bias-gelu-fusion', 'off', FUSION),
        notice('--no-bias-swiglu-fusion', 'off', FUSION),
        notice('--no-bias-dropout-fusion', 'off', FUSION),
        notice('--no-rope-fusion', 'off', FUSION),
        mapped(
            '--rope-type', 'str', 'model.position_embedding_type', derived=True, choices=('rope', 'yarn'),
            note='multi-latent attention\'s RoPE (YaRN unless rope, as in Megatron-LM); other attention takes rope only',
        ),
        notice('--use-flash-attn', 'on', 'attention kernel choice: no effect here'),
        mapped(
            '--optimizer', 'str', 'optim.optimizer',
            choices=('adam', 'sgd', 'muon', 'dist_muon', 'lion', 'soap', 'adaptive_muon'),
            default='adam', only=('adam', 'sgd'),
            refuse="megatron_ext builds megatron-core's Adam or SGD",
        ),
        notice('--optimizer-cpu-offload', 'on', TUNE),
        notice('--optimizer-cuda-graph', 'on', TUNE),
        notice('--optimizer-offload-fraction', 'float', TUNE),
        notice('--use-torch-optimizer-for-cpu-offload', 'on', TUNE),
        notice('--overlap-cpu-optimizer-d2h-h2d', 'on', TUNE),
        notice('--dump-param-to-param-group-map', 'str', LOG),
        notice('--no-pin-cpu-grads', 'off', TUNE),
        notice('--no-pin-cpu-params', 'off', TUNE),
        notice(
            '--dataloader-type', 'str',
            "samples are drawn by megatron_ext's sampler in Megatron's single-pass order",
            choices=('single', 'cyclic', 'external'), only=('single',),
            refuse='cyclic and external data loaders are not supported',
        ),
        notice('--no-persist-layer-norm', 'on', TUNE),
        notice('--no-gradient-accumulation-fusion', 'off', FUSION),
        notice('--use-mcore-models', 'on', "megatron_ext's models are megatron-core models"),
    ),
    # rl
    *group(
        'rl',
        refused('--perform-rl-step', 'on', G_RL),
        refused('--rl-prompts-per-eval', 'int', G_RL),
        refused('--grpo-prompts-per-step', 'int', G_RL),
        refused('--grpo-group-size', 'int', G_RL),
        refused('--rl-generation-lag', 'float', G_RL),
        refused('--rl-max-inflight-requests', 'int', G_RL),
        refused('--rl-submission-granularity', 'str', G_RL, choices=('R', 'G', 'B')),
        refused('--rl-consumption-granularity', 'str', G_RL, choices=('R', 'G', 'B')),
        refused('--rl-durable-rollout-bank', 'on', G_RL),
        refused('--rl-rollout-bank-dir', 'str', G_RL),
        refused('--rl-rollout-bank-max-bytes', 'int', G_RL),
        refused('--grpo-iterations', 'int', G_RL),
        refused('--grpo-clamp-eps-lower', 'float', G_RL),
        refused('--grpo-clamp-eps-upper', 'float', G_RL),
        refused('--grpo-kl-beta', 'float', G_RL),
        refused('--grpo-entropy-term-weight', 'float', G_RL),
        refused('--grpo-filter-groups-with-same-reward', 'on', G_RL),
        refused('--langrl-env-config', 'str', G_RL),
        refused('--rl-default-temperature', 'float', G_RL),
        refused('--rl-default-top-p', 'float', G_RL),
        refused('--rl-default-top-k', 'int', G_RL),
        refused('--rl-offload-optimizer-during-inference', 'on', G_RL),
        refused(
            '--rl-kv-cache-management-mode', 'str', G_RL,
            choices=('persist', 'offload', 'recompute'),
        ),
        refused('--rl-persist-cuda-graphs --no-rl-persist-cuda-graphs', 'bool', G_RL),
        refused('--rl-partial-rollouts --no-rl-partial-rollouts', 'bool', G_RL),
        refused(
            '--rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction',
            'bool', G_RL,
        ),
        refused('--rl-importance-sampling-truncation-coef', 'float', G_RL),
        refused('--rl-use-sequence-packing --no-rl-use-sequence-packing', 'bool', G_RL),
        refused('--rl-sequence-packing-max-sequences-per-bin', 'int', G_RL),
        refused('--rl-sequence-packing-algo', 'str', G_RL, choices=('fifo', 'round-robin')),
        refused('--rl-training-cuda-graphs --no-rl-training-cuda-graphs', 'bool', G_RL),
        refused('--rl-inference-tensor-model-parallel-size', 'int', G_RL),
        refused('--rl-inference-pipeline-model-parallel-size', 'int', G_RL),
        refused('--rl-inference-expert-model-parallel-size', 'int', G_RL),
        refused('--rl-inference-expert-tensor-model-parallel-size', 'int', G_RL),
        refused('--rl-inference-model-unified-memory-level', 'int', G_RL, choices=(0, 1)),
        refused(
            '--rl-offload-inference-model-weights-when-idle --no-rl-offload-inference-model-weights-when-idle',
            'bool', G_RL,
        ),
        refused('--refit-method', 'str', G_RL, choices=('nccl', 'gloo', 'nvshmem')),
        refused('--rl-verify-model-weights-swap --no-rl-verify-model-weights-swap', 'bool', G_RL),
        refused('--rl-skip-bos-token --no-rl-skip-bos-token', 'bool', G_RL),
        refused('--rl-profile', 'on', G_RL),
        refused('--rl-profile-dir', 'str', G_RL),
        refused('--rl-inference-parsers', 'str*', G_RL),
    ),
    # RNG and initialization
    *group(
        'RNG and initialization',
        mapped('--seed', 'int', 'train.seed', default=1234),
        notice('--te-rng-tracker', 'on', 'the CUDA RNG tracker choice: no effect here'),
        notice('--inference-rng-tracker', 'on', INFER),
        refused(
            '--data-parallel-random-init', 'on',
            'data-parallel replicas always start from the same weights',
        ),
        refused(
            '--init-method-xavier-uniform', 'on',
            "weights use megatron's normal init (--init-method-std)",
        ),
    ),
    # learning rate and weight decay
    *group(
        'learning rate and weight decay',
        mapped(
            '--lr-decay-style', 'str', 'optim.lr_decay_style',
            choices=('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD'),
            default='linear', only=('constant', 'linear', 'cosine', 'inverse-square-root'),
            refuse='WSD needs its decay-phase settings, which have no config keys',
        ),
        refused(
            '--lr-wsd-decay-style', 'str', 'WSD is refused (see --lr-decay-style)',
            choices=('exponential', 'linear', 'cosine', 'minus_sqrt'),
        ),
        mapped('--lr-decay-iters', 'int', 'optim.lr_decay_iters'),
        mapped('--lr-decay-samples', 'int', 'optim.lr_decay_samples'),
        refused('--lr-wsd-decay-iters', 'int', 'WSD is refused (see --lr-decay-style)'),
        refused('--lr-wsd-decay-samples', 'int', 'WSD is refused (see --lr-decay-style)'),
        mapped(
            '--lr-warmup-fraction', 'float', 'optim.lr_warmup_iters', derived=True,
            note='times --lr-decay-iters (or --train-iters); with --train-samples onto optim.lr_warmup_samples (times --lr-decay-samples or --train-samples)',
        ),
        mapped(
            '--lr-warmup-iters', 'int', 'optim.lr_warmup_iters', derived=True,
            note="absent: 0, Megatron-LM's default (optim.lr_warmup_samples = 0 with --train-samples); 0 also goes with --train-samples",
        ),
        mapped(
            '--lr-warmup-samples', 'int', 'optim.lr_warmup_samples',
            note='needs --train-samples, except 0 (Megatron-LM\'s default, also with --train-iters)',
        ),
        mapped('--lr-warmup-init', 'float', 'optim.lr_warmup_init'),
        refused(
            '--override-opt_param-scheduler --override-opt-param-scheduler', 'on',
            "a resume restores the lr schedule's state from the checkpoint",
        ),
        notice(
            '--use-checkpoint-opt_param-scheduler --use-checkpoint-opt-param-scheduler', 'on',
            "a resume takes the lr schedule's values (lr, min lr, warmup, decay) from the "
            "checkpoint, as this flag asks: always here (megatron-core's scheduler default)",
        ),
        refused('--start-weight-decay', 'float', 'weight-decay schedules have no config keys'),
        refused('--end-weight-decay', 'float', 'weight-decay schedules have no config keys'),
        notice(
            '--weight-decay-incr-style', 'str', 'the weight decay is constant',
            choices=('constant', 'linear', 'cosine'), only=('constant',),
            refuse='weight-decay schedules have no config keys',
        ),
        mapped('--lr', 'float', 'optim.lr'),
        refused('--warmup', 'int', 'deprecated in Megatron-LM: use --lr-warmup-iters'),
        mapped('--min-lr', 'float', 'optim.min_lr', default=0.0),
        mapped('--decoupled-lr', 'float', 'optim.decoupled_lr'),
        mapped('--decoupled-min-lr', 'float', 'optim.decoupled_min_lr'),
        refused(
            '--freeze-all-layers', 'on', 'freezing layers is not supported (see the lora plugin)',
        ),
    ),
    # checkpointing
    *group(
        'checkpointing',
        mapped('--save', 'str', 'checkpoint.save'),
        mapped('--save-interval --persistent-save-interval', 'int', 'checkpoint.interval'),
        refused(
            '--save-params-interval', 'int',
            'tensor dumps for debugging are not part of this trainer',
        ),
        refused(
            '--save-activations-interval', 'int',
            'tensor dumps for debugging are not part of this trainer',
        ),
        refused(
            '--save-tokens-per-expert-interval', 'int',
            'tensor dumps for debugging are not part of this trainer',
        ),
        refused(
            '--save-wgrads-interval', 'int',
            'tensor dumps for debugging are not part of this trainer',
        ),
        refused(
            '--save-dgrads-interval', 'int',
            'tensor dumps for debugging are not part of this trainer',
        ),
        refused('--save-retain-interval', 'int', 'use checkpoint.keep_last'),
        mapped('--load', 'str', 'checkpoint.load'),
        refused('--load-main-params-from-ckpt', 'on', NO_KEY),
        refused(
            '--non-persistent-save-interval', 'int',
            'non-persistent (local / in-memory) checkpoints are not part of this trainer',
        ),
        refused(
            '--non-persistent-ckpt-type', 'str',
            'non-persistent (local / in-memory) checkpoints are not part of this trainer',
            choices=('global', 'local', 'in_memory'),
        ),
        refused(
            '--non-persistent-global-ckpt-dir', 'str',
            'non-persistent (local / in-memory) checkpoints are not part of this trainer',
        ),
        refused(
            '--non-persistent-local-ckpt-dir', 'str',
            'non-persistent (local / in-memory) checkpoints are not part of this trainer',
        ),
        refused(
            '--non-persistent-local-ckpt-algo', 'str',
            'non-persistent (local / in-memory) checkpoints are not part of this trainer',
            choices=('fully_parallel', 'atomic'),
        ),
        mapped('--finetune', 'on', 'checkpoint.finetune'),
        mapped(
            '--pretrained-checkpoint', 'str', 'model.pretrained',
            note='its weights start a run whose --load holds no checkpoint, as Megatron-LM finetunes from it',
        ),
        mapped('--ckpt-step', 'int', 'checkpoint.step'),
        mapped(
            '--use-checkpoint-args', 'on', 'model', derived=True,
            note="the model's flags from the args of the checkpoint in --load (the command line's "
            "--num-layers, --hidden-size, --ffn-hidden-size, --seq-length, --num-attention-heads, "
            "--kv-channels, --max-position-embeddings first)",
        ),
        mapped(
            '--use-mp-args-from-checkpoint-args', 'on', 'parallel', derived=True,
            note="with --use-checkpoint-args: the checkpoint's TP / PP / VPP / EP / CP sizes and stage cut",
        ),
        notice(
            '--no-use-tokenizer-model-from-checkpoint-args --disable-use-tokenizer-model-from-checkpoint-args',
            'off', "--use-checkpoint-args takes the model's flags only: the tokenizer is always the command line's",
        ),
        mapped(
            '--exit-on-missing-checkpoint', 'on', 'checkpoint.load_optional', const=False,
            default=True,
        ),
        notice(
            '--ckpt-format', 'str',
            "checkpoints are torch_dist (megatron-core's dist_checkpointing); the other formats are written as torch_dist too",
            choices=('torch', 'torch_dist', 'torch_dcp', 'fsdp_dtensor'), derived=True,
        ),
        notice('--auto-detect-ckpt-format', 'on', 'checkpoints here are always torch_dist'),
        refused(
            '--ckpt-convert-format', 'str', 'use python -m megatron_ext.convert_checkpoint',
            choices=('torch', 'torch_dist'),
        ),
        refused('--ckpt-convert-save', 'str', 'use python -m megatron_ext.convert_checkpoint'),
        refused(
            '--ckpt-convert-update-legacy-dist-opt-format', 'on',
            'legacy checkpoint formats are not read here',
        ),
        notice('--no-ckpt-fully-parallel-save', 'off', CKPT_IO),
        mapped('--async-save', 'on', 'checkpoint.async_save'),
        notice('--async-strategy', 'str', CKPT_IO, choices=('nvrx', 'mcore')),
        notice('--use-persistent-ckpt-worker', 'on', CKPT_IO),
        notice('--async-ckpt-cpu-priority', 'int', CKPT_IO),
        notice('--async-ckpt-io-priority', 'int', CKPT_IO),
        notice('--async-ckpt-use-cpu-shm', 'on', CKPT_IO),
        notice('--ckpt-fully-parallel-load', 'on', CKPT_IO),
        notice(
            '--ckpt-fully-parallel-load-exchange-algo', 'str', CKPT_IO,
            choices=('broadcast', 'gather_rounds', 'gather_object'),
        ),
        notice('--ckpt-fully-parallel-load-per-rank-objects', 'on', CKPT_IO),
        notice(
            '--ckpt-fully-parallel-save-process-group', 'str', CKPT_IO, choices=('dp', 'ep_dp'),
        ),
        notice(
            '--ckpt-fully-parallel-load-process-group', 'str', CKPT_IO, choices=('dp', 'ep_dp'),
        ),
        notice('--ckpt-assume-constant-structure', 'on', CKPT_IO),
        notice('--ckpt-pg-tensors-cache-path', 'str', CKPT_IO),
        notice('--ckpt-pg-tensors-cache-create', 'on', CKPT_IO),
        notice(
            '--no-ckpt-load-validate-sharding-integrity --disable-ckpt-load-validate-sharding-integrity',
            'off', "no effect: loads here are checked against the model's sharded state",
        ),
        notice(
            '--no-strict-fsdp-dtensor-load --disable-strict-fsdp-dtensor-load', 'off',
            'fsdp_dtensor checkpoints are not written here',
        ),
        notice(
            '--dist-ckpt-strictness', 'str',
            'loads here are strict: every saved tensor must match the model',
            choices=('assume_ok_unexpected', 'log_unexpected', 'log_all', 'raise_unexpected', 'raise_all', 'return_unexpected', 'return_all', 'ignore_all'),
        ),
        refused(
            '--dist-ckpt-save-pre-mcore-014', 'on',
            'legacy checkpoint formats are not written here',
        ),
        notice(
            '--dist-ckpt-optim-fully-reshardable', 'on',
            'optimizer state here is always saved fully reshardable',
        ),
        notice('--distrib-optim-fully-reshardable-mem-efficient', 'on', CKPT_IO),
        notice(
            '--no-save-tokenizer-assets --disable-save-tokenizer-assets', 'off',
            'no effect: the tokenizer is not copied into checkpoints here',
        ),
        refused('--replication', 'on', 'checkpoint replication is not part of this trainer'),
        refused('--replication-jump', 'int', 'checkpoint replication is not part of this trainer'),
        refused(
            '--replication-factor', 'int', 'checkpoint replication is not part of this trainer',
        ),
        refused('--verify-integrity', 'on', NO_KEY),
        mapped('--no-save-optim', 'on', 'checkpoint.save_optim', const=False),
        mapped('--no-save-rng', 'on', 'checkpoint.save_rng', const=False),
        mapped('--no-load-optim', 'on', 'checkpoint.load_optim', const=False),
        mapped('--no-load-rng', 'on', 'checkpoint.load_rng', const=False),
        refused('--override-ckpt-iteration', 'int', NO_KEY),
        notice(
            '--use-dist-ckpt', 'on', 'checkpoints here are always torch_dist (dist_checkpointing)',
        ),
        notice(
            '--dist-ckpt-format', 'str',
            'deprecated in Megatron-LM; checkpoints here are always torch_dist',
        ),
        notice('--dist-ckpt-workers', 'int', CKPT_IO),
        notice('--ckpt-fully-parallel-save', 'on', CKPT_IO),
        notice('--ckpt-drop-redundant-extra-state', 'on', CKPT_IO),
    ),
    # mixed precision
    *group(
        'mixed precision',
        notice(
            '--grad-reduce-in-bf16', 'on',
            'gradients are reduced in fp32 here (more precise than a bf16 reduce)',
        ),
        refused(
            '--loss-scale', 'float',
            'static loss scaling has no config key (fp16 uses the dynamic scaler)',
        ),
        notice(
            '--initial-loss-scale', 'float', "megatron-core's default (2^32) is used",
            only=(4294967296.0,), refuse=NO_KEY + ' (only the default 4294967296)',
        ),
        notice(
            '--min-loss-scale', 'float', "megatron-core's default (1.0) is used", only=(1.0,),
            refuse=NO_KEY + ' (only the default 1.0)',
        ),
        notice(
            '--loss-scale-window', 'float', "megatron-core's default (1000) is used",
            only=(1000.0,), refuse=NO_KEY + ' (only the default 1000)',
        ),
        notice(
            '--hysteresis', 'int', "megatron-core's default (2) is used", only=(2,),
            refuse=NO_KEY + ' (only the default 2)',
        ),
        notice(
            '--attention-softmax-in-fp32', 'on',
            "softmax runs in fp32 here already (megatron-core's default)",
        ),
        notice(
            '--accumulate-allreduce-grads-in-fp32', 'on',
            'gradients are accumulated and reduced in fp32 here already',
        ),
        refused('--fp16-lm-cross-entropy', 'on', 'the loss is computed in fp32 here'),
        refused(
            '--output-logit-dtype', 'str', "logits are in the model's precision, the loss in fp32",
            choices=('bf16', 'fp32'),
        ),
        notice('--reuse-grad-buf-for-mxfp8-param-ag', 'on', FP8),
        notice(
            '--mamba-training-ssm-states-dtype', 'str',
            'Mamba: pretrain_gpt builds no Mamba layers', choices=('fp32', 'bf16'),
        ),
    ),
    # distributed init
    *group(
        'distributed init',
        notice(
            '--distributed-backend', 'str',
            'the backend follows the device: nccl on CUDA, gloo on CPU', choices=('nccl', 'gloo'),
        ),
        notice(
            '--distributed-timeout-minutes', 'int',
            "process groups use torch's default timeout here",
        ),
        notice('--no-align-grad-reduce --disable-align-grad-reduce', 'off', TUNE),
        notice('--local-rank', 'int', "ranks come from torchrun/srun's environment"),
        refused('--lazy-mpu-init', 'on', 'megatron_ext initialises model parallelism itself'),
        notice('--use-megatron-fsdp', 'on', FSDP),
        notice('--use-torch-fsdp2', 'on', FSDP),
        notice('--nccl-communicator-config-path', 'str', TUNE),
        notice('--use-tp-pp-dp-mapping', 'on', TUNE),
        notice('--disable-gloo-process-groups', 'off', TUNE),
        notice('--use-sharp', 'on', TUNE),
        notice('--sharp-enabled-group', 'str', TUNE, choices=('dp', 'dp_replica')),
        notice('--high-priority-stream-groups', 'str+', TUNE),
        notice(
            '--distributed-timeout-seconds-after-init', 'int',
            "process groups use torch's default timeout here",
        ),
        notice('--flight-recorder-dump-path', 'str', TUNE),
        notice('--flight-recorder-trace-buffer-size', 'int', TUNE),
        notice(
            '--no-flight-recorder-dump-on-timeout --disable-flight-recorder-dump-on-timeout', 'off',
            TUNE,
        ),
        notice('--flight-recorder-include-stack-trace', 'on', TUNE),
        notice(
            '--no-flight-recorder-include-only-active --disable-flight-recorder-include-only-active',
            'off', TUNE,
        ),
        notice(
            '--no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-extra-dump-on-exec',
            'off', TUNE,
        ),
        notice('--disable-jit-fuser', 'on', TUNE),
        mapped('--decoder-first-pipeline-num-layers', 'int', 'parallel.first_stage_layers'),
        mapped('--decoder-last-pipeline-num-layers', 'int', 'parallel.last_stage_layers'),
        refused(
            '--pipeline-model-parallel-layout', 'str',
            'use --decoder-first/last-pipeline-num-layers',
        ),
        refused(
            '--model-parallel-size', 'int',
            'deprecated in Megatron-LM: use --tensor-model-parallel-size',
        ),
        mapped(
            '--num-layers-per-virtual-pipeline-stage', 'int', 'parallel.vpp', derived=True,
            note='vpp = --num-layers / --pipeline-model-parallel-size / this',
        ),
        mapped('--num-virtual-stages-per-pipeline-rank', 'int', 'parallel.vpp'),
        notice('--no-overlap-p2p-communication', 'off', TUNE),
        mapped('--overlap-grad-reduce', 'on', 'parallel.overlap_grad_reduce', default=False),
        notice('--ddp-num-buckets', 'int', TUNE),
        notice('--ddp-bucket-size', 'int', TUNE),
        notice('--ddp-pad-buckets-for-high-nccl-busbw', 'on', TUNE),
        notice('--ddp-reduce-scatter-with-fp32-accumulation', 'on', TUNE),
        notice('--gtp-remat-reduce-scatter-with-fp32-accumulation', 'on', TUNE),
        refused('--ddp-param-name-patterns-for-fp32-local-accumulation', 'str+', NO_KEY),
        notice('--ddp-average-in-collective', 'on', TUNE),
        notice(
            '--overlap-param-gather', 'on',
            'no effect here: parameters are gathered after the optimizer step',
        ),
        notice(
            '--overlap-param-gather-with-optimizer-step', 'on',
            'no effect here: parameters are gathered after the optimizer step',
        ),
        notice('--no-align-param-gather', 'off', TUNE),
        mapped(
            '--use-distributed-optimizer', 'on', 'parallel.use_distributed_optimizer',
            default=False,
        ),
        notice('--megatron-fsdp-version', 'int', FSDP, choices=(1, 2)),
        notice('--no-use-layer-wise-param-layout', 'off', FSDP),
        notice('--use-nccl-ub', 'on', FSDP),
        notice('--disable-symmetric-registration', 'on', TUNE),
        notice('--gtp-remat-nccl-ub', 'on', TUNE),
        notice('--gtp-expert-remat-nccl-ub', 'on', TUNE),
        notice('--fsdp-manual-registration', 'on', FSDP),
        notice('--create-all-gather-group', 'on', FSDP),
        notice(
            '--data-parallel-sharding-strategy', 'str', FSDP,
            choices=('no_shard', 'optim', 'optim_grads', 'optim_grads_params'),
        ),
        notice('--outer-dp-sharding-strategy', 'str', FSDP, choices=('no_shard', 'optim')),
        notice('--no-gradient-reduce-div-fusion', 'off', FSDP),
        notice('--fsdp-double-buffer', 'on', FSDP),
        notice('--suggested-communication-unit-size', 'int', FSDP),
        notice('--keep-fp8-transpose-cache', 'on', FSDP),
        notice('--enable-full-sharding-in-hsdp', 'on', FSDP),
        notice(
            '--num-distributed-optimizer-instances', 'int', 'one distributed-optimizer instance',
            only=(1,), refuse='several distributed-optimizer instances are not supported',
        ),
        notice('--torch-fsdp2-no-reshard-after-forward', 'off', FSDP),
        notice(
            '--cp-comm-type', 'str+', "context parallelism uses megatron-core's p2p ring",
            only=('p2p',),
            refuse='context-parallel communication types other than p2p are not supported',
        ),
        refused('--fake-process-group', 'on', 'runs here use real process groups'),
    ),
    # validation
    *group(
        'validation',
        mapped('--eval-iters', 'int', 'train.eval_iters'),
        mapped('--eval-interval', 'int', 'train.eval_interval'),
        refused('--start-eval-at-iter', 'int', NO_KEY),
        refused('--eval-global-batch-size', 'int', NO_KEY),
        refused('--eval-micro-batch-size', 'int', NO_KEY),
        mapped(
            '--skip-train', 'on', 'train.skip_train',
            note='with checkpoint.load_optim = false, as Megatron-LM implies --no-load-optim',
        ),
        mapped(
            '--test-mode', 'on', 'train.test_mode',
            note="megatron-core's real-time test: the QK-norms' weights and biases compared across "
            'DP and TP ranks in every attention forward (with --qk-layernorm and LayerNorm)',
        ),
        refused('--full-validation', 'on', NO_KEY),
        refused('--multiple-validation-sets', 'on', NO_KEY),
        refused('--validation-set-names', 'str+', NO_KEY),
    ),
    # data and dataloader
    *group(
        'data and dataloader',
        mapped('--data-path', 'str*', 'data.data_path'),
        refused('--phase-transition-iterations', 'str', 'data phases are not supported'),
        mapped('--split', 'str', 'data.split'),
        refused(
            '--train-data-path', 'str*',
            'per-split data paths are not supported: use --data-path with --split',
        ),
        refused(
            '--valid-data-path', 'str*',
            'per-split data paths are not supported: use --data-path with --split',
        ),
        refused(
            '--test-data-path', 'str*',
            'per-split data paths are not supported: use --data-path with --split',
        ),
        refused(
            '--data-args-path', 'str',
            'per-split data paths are not supported: use --data-path with --split',
        ),
        refused(
            '--per-split-data-args-path', 'str',
            'per-split data paths are not supported: use --data-path with --split',
        ),
        refused('--per-dataset-sequences-path', 'str', NO_KEY),
        notice('--dataloader-fast-cache-load', 'on', TUNE),
        notice('--dataloader-defer-npy-index-mmap', 'on', TUNE),
        mapped('--data-cache-path', 'str', 'data.cache_dir'),
        notice('--no-mmap-bin-files', 'off', TUNE),
        mapped('--mock-data', 'on', 'data.mock'),
        mapped('--seq-length', 'int', 'model.seq_length'),
        refused('--encoder-seq-length', 'int', 'use --seq-length'),
        refused('--decoder-seq-length', 'int', 'use --seq-length'),
        notice('--sample-rate', 'float', 'BERT/T5 data only: no effect in pretrain_gpt'),
        notice('--mask-prob', 'float', 'BERT/T5 data only: no effect in pretrain_gpt'),
        notice('--short-seq-prob', 'float', 'BERT/T5 data only: no effect in pretrain_gpt'),
        mapped('--num-workers', 'int', 'data.num_workers'),
        notice('--reset-position-ids', 'on', SFT_PACKING, derived=True),
        notice('--reset-attention-mask', 'on', SFT_PACKING, derived=True),
        refused(
            '--dataloader-inter-document-masking', 'on',
            'document boundaries are not masked here (no config key)',
        ),
        notice('--eod-mask-loss', 'on', SFT_PACKING, derived=True),
        notice(
            '--no-create-attention-mask-in-dataloader', 'off',
            'the causal mask is built in the model here: the same attention',
        ),
        notice('--num-dataset-builder-threads', 'int', TUNE),
        notice('--object-storage-cache-path', 'str', TUNE),
        notice('--mid-level-dataset-surplus', 'float', TUNE),
        notice(
            '--allow-ambiguous-pad-tokens', 'on', "no effect: megatron_ext's datasets do not pad",
        ),
        refused('--fim-data', 'on', 'fill-in-the-middle data is not supported'),
        refused('--fim-rate', 'float', 'fill-in-the-middle data is not supported'),
        refused('--fim-spm-rate', 'float', 'fill-in-the-middle data is not supported'),
        refused('--fim-split-sample', 'str', 'fill-in-the-middle data is not supported'),
        refused('--fim-fragment-rate', 'float', 'fill-in-the-middle data is not supported'),
        refused('--fim-no-prefix', 'str', 'fill-in-the-middle data is not supported'),
        refused('--fim-prefix-token', 'str', 'fill-in-the-middle data is not supported'),
        refused('--fim-middle-token', 'str', 'fill-in-the-middle data is not supported'),
        refused('--fim-suffix-token', 'str', 'fill-in-the-middle data is not supported'),
        refused('--fim-pad-token', 'str', 'fill-in-the-middle data is not supported'),
        refused('--fim-eod-token', 'str', 'fill-in-the-middle data is not supported'),
    ),
    # tokenizer
    *group(
        'tokenizer',
        mapped(
            '--vocab-size', 'int', 'model.vocab_size',
            note="NullTokenizer's number of ids (the embedding is padded from one more); with other tokenizers the embedding size",
        ),
        refused(
            '--padded-vocab-size', 'int',
            'the padded size is derived: --vocab-size and --make-vocab-size-divisible-by',
        ),
        refused(
            '--no-pad-vocab-size --disable-pad-vocab-size', 'off',
            'the vocabulary is always padded (use --make-vocab-size-divisible-by 1)',
        ),
        mapped(
            '--vocab-file', 'str', 'data.tokenizer', derived=True,
            note="GPT2BPETokenizer's vocab.json (with --merge-file)",
        ),
        mapped(
            '--merge-file', 'str', 'data.tokenizer', derived=True,
            note="GPT2BPETokenizer's merges.txt (with --vocab-file)",
        ),
        notice(
            '--vocab-extra-ids', 'int', 'no extra ids', only=(0,),
            refuse='T5 extra ids are not supported',
        ),
        mapped(
            '--tokenizer-type', 'str', 'data.tokenizer',
            choices=('BertWordPieceLowerCase', 'BertWordPieceCase', 'GPT2BPETokenizer', 'SentencePieceTokenizer', 'GPTSentencePieceTokenizer', 'HuggingFaceTokenizer', 'Llama2Tokenizer', 'TikTokenizer', 'MultimodalTokenizer', 'NullTokenizer', 'NullMultimodalTokenizer', 'SFTTokenizer'),
            derived=True,
            note="HuggingFaceTokenizer, GPT2BPETokenizer, Llama2Tokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer and SFTTokenizer read --tokenizer-model (a tokenizer.json or a folder holding one); Llama2Tokenizer, SentencePieceTokenizer and GPTSentencePieceTokenizer also a SentencePiece .model, encoded as by Megatron-LM's default tokenizers (no bos added; eod the model's eos); GPT2BPETokenizer also reads --vocab-file and --merge-file (GPT-2 BPE files); NullTokenizer reads token ids (--mock-data or preprocessed --data-path) with --vocab-size ids and one more for the end of document; other types are refused",
        ),
        mapped(
            '--tokenizer-model', 'str', 'data.tokenizer', derived=True,
            note='a tokenizer.json, a SentencePiece .model, or a folder holding either (tokenizer.json first, else tokenizer.model)',
        ),
        notice(
            '--legacy-tokenizer', 'on',
            "which of Megatron-LM's tokenizer implementations builds the tokenizer: text is "
            "tokenized here as by its default one, with no bos or other special token added (the "
            "legacy HuggingFaceTokenizer adds the tokenizer's own, the legacy Llama2Tokenizer a bos); "
            "refused with SentencePieceTokenizer and a .model (Megatron-LM core_v0.16.1's flag, "
            "removed from its parser later)",
        ),
        refused('--tokenizer-metadata', 'str', NO_KEY),
        refused('--tokenizer-special-tokens', 'str+', NO_KEY),
        notice(
            '--tiktoken-pattern', 'str', 'read by TikTokenizer only (not used here)',
            choices=('v1', 'v2'),
        ),
        notice(
            '--tiktoken-num-special-tokens', 'int', 'read by TikTokenizer only (not used here)',
        ),
        notice(
            '--tokenizer-sentencepiece-legacy', 'on',
            'read by the SentencePiece tokenizers only: refused with a .model, no effect otherwise',
        ),
        notice(
            '--no-tokenizer-sentencepiece-ignore-extra-whitespaces --disable-tokenizer-sentencepiece-ignore-extra-whitespaces',
            'off', 'read by the SentencePiece tokenizers only: refused with a .model, no effect otherwise',
        ),
        notice(
            '--tokenizer-hf-no-use-fast', 'on',
            'the tokenizer.json is read by the tokenizers library either way',
        ),
        refused('--tokenizer-hf-no-include-special-tokens', 'on', NO_KEY),
        notice(
            '--trust-remote-code', 'on',
            'no remote code is run: tokenizers are local tokenizer.json or .model files',
        ),
        refused('--null-tokenizer-eod-id', 'int', NO_KEY),
        notice(
            '--null-tokenizer-pad-id', 'int', 'no padding here', only=(-1,),
            refuse="NullTokenizer's pad id has no config key",
        ),
        refused('--chat-template', 'str', NO_KEY),
        refused('--use-gigatoken', 'on', NO_KEY),
    ),
    # autoresume
    *group(
        'autoresume',
        notice('--adlr-autoresume', 'on', G_AUTORESUME),
        notice('--adlr-autoresume-interval', 'int', G_AUTORESUME),
    ),
    # biencoder
    *group(
        'biencoder',
        notice('--ict-head-size', 'int', G_BIENCODER),
        notice('--biencoder-projection-dim', 'int', G_BIENCODER),
        notice('--biencoder-shared-query-context-model', 'on', G_BIENCODER),
        notice('--ict-load', 'str', G_BIENCODER),
        notice('--bert-load', 'str', G_BIENCODER),
        notice('--titles-data-path', 'str', G_BIENCODER),
        notice('--query-in-block-prob', 'float', G_BIENCODER),
        notice('--use-one-sent-docs', 'on', G_BIENCODER),
        notice('--evidence-data-path', 'str', G_BIENCODER),
        notice('--retriever-report-topk-accuracies', 'int+', G_BIENCODER),
        notice('--retriever-score-scaling', 'on', G_BIENCODER),
        notice('--block-data-path', 'str', G_BIENCODER),
        notice('--embedding-path', 'str', G_BIENCODER),
        notice('--indexer-batch-size', 'int', G_BIENCODER),
        notice('--indexer-log-interval', 'int', G_BIENCODER),
    ),
    # vision
    *group(
        'vision',
        notice('--num-classes', 'int', G_VISION),
        notice('--img-h', 'int', G_VISION),
        notice('--img-w', 'int', G_VISION),
        notice('--num-channels', 'int', G_VISION),
        notice('--patch-dim', 'int', G_VISION),
        notice('--classes-fraction', 'float', G_VISION),
        notice('--data-per-class-fraction', 'float', G_VISION),
        notice('--no-data-sharding', 'off', G_VISION),
        notice('--head-lr-mult', 'float', G_VISION),
        notice('--vision-pretraining', 'on', G_VISION),
        notice(
            '--vision-pretraining-type', 'str', G_VISION, choices=('classify', 'inpaint', 'dino'),
        ),
        notice('--vision-backbone-type', 'str', G_VISION, choices=('vit', 'mit', 'swin')),
        notice('--swin-backbone-type', 'str', G_VISION, choices=('tiny', 'base', 'h3')),
        notice('--mask-type', 'str', G_VISION, choices=('random', 'row')),
        notice('--mask-factor', 'float', G_VISION),
        notice('--iter-per-epoch', 'int', G_VISION),
        notice('--dino-local-img-size', 'int', G_VISION),
        notice('--dino-local-crops-number', 'int', G_VISION),
        notice('--dino-head-hidden-size', 'int', G_VISION),
        notice('--dino-bottleneck-size', 'int', G_VISION),
        notice('--dino-freeze-last-layer', 'float', G_VISION),
        notice('--dino-norm-last-layer', 'on', G_VISION),
        notice('--dino-warmup-teacher-temp', 'float', G_VISION),
        notice('--dino-teacher-temp', 'float', G_VISION),
        notice('--dino-warmup-teacher-temp-epochs', 'int', G_VISION),
    ),
    # moe
    *group(
        'moe',
        mapped('--num-experts', 'int', 'model.num_experts'),
        mapped('--moe-layer-freq', 'str', 'model.moe_layer_freq', default='1'),
        refused('--moe-use-upcycling', 'on', 'upcycling a dense checkpoint is not supported'),
        mapped(
            '--moe-router-load-balancing-type', 'str+', 'model.moe_router_load_balancing_type',
            choices=('aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn', 'quantile_balancing', 'none'),
            default='aux_loss', only=('aux_loss', 'seq_aux_loss', 'sinkhorn', 'none'),
            refuse="megatron_ext's router takes aux_loss, seq_aux_loss, sinkhorn or none, one value",
        ),
        mapped('--moe-aux-loss-coeff', 'float+', 'model.moe_aux_loss_coeff', default=0.0),
        notice(
            '--moe-upcycling-granularity', 'int', 'read only with --moe-use-upcycling (refused)',
        ),
    ),
    # mla
    *group(
        'mla',
        mapped('--q-lora-rank', 'int', 'model.q_lora_rank'),
        mapped('--kv-lora-rank', 'int', 'model.kv_lora_rank', default=32),
        mapped('--qk-head-dim', 'int', 'model.qk_head_dim', default=128),
        mapped('--qk-pos-emb-head-dim', 'int', 'model.qk_pos_emb_head_dim', default=64),
        mapped('--v-head-dim', 'int', 'model.v_head_dim', default=128),
        mapped('--rotary-scaling-factor', 'float', 'model.yarn_rotary_scaling_factor'),
        mapped('--mscale', 'float', 'model.yarn_mscale'),
        mapped('--mscale-all-dim', 'float', 'model.yarn_mscale_all_dim'),
        notice('--cache-mla-latents', 'on', INFER),
        notice('--mla-down-proj-fusion', 'on', FUSION),
    ),
    # experimental_attention_variant
    *group(
        'experimental_attention_variant',
        refused('--linear-attention-freq', 'str', G_EXPERIMENTAL_ATTENTION_VARIANT),
    ),
    # heterogeneous architecture
    *group(
        'heterogeneous architecture',
        refused('--heterogeneous-layers-config-path', 'str', G_HETEROGENEOUS_ARCHITECTURE),
        refused('--heterogeneous-layers-config-encoded-json', 'str', G_HETEROGENEOUS_ARCHITECTURE),
    ),
    # logging
    *group(
        'logging',
        mapped('--log-interval', 'int', 'logging.log_interval'),
        mapped('--log-params-norm', 'on', 'logging.log_params_norm'),
        mapped('--log-throughput', 'on', 'logging.log_throughput'),
        notice('--log-progress', 'on', LOG),
        notice('--timing-log-level', 'int', LOG, choices=(0, 1, 2)),
        notice('--timing-log-option', 'str', LOG, choices=('max', 'minmax', 'all')),
        mapped('--tensorboard-dir', 'str', 'logging.tensorboard_dir'),
        notice('--tensorboard-log-interval', 'int', LOG),
        notice('--tensorboard-queue-size', 'int', LOG),
        mapped('--log-timers-to-tensorboard', 'on', 'logging.log_timers_to_tensorboard'),
        notice(
            '--no-log-loss-scale-to-tensorboard --disable-log-loss-scale-to-tensorboard', 'off',
            LOG,
        ),
        mapped(
            '--log-validation-ppl-to-tensorboard', 'on',
            'logging.log_validation_ppl_to_tensorboard',
        ),
        mapped('--log-memory-to-tensorboard', 'on', 'logging.log_memory_to_tensorboard'),
        notice('--log-memory-interval', 'int', LOG),
        notice('--log-device-memory-used', 'on', LOG),
        mapped('--log-num-zeros-in-grad', 'on', 'logging.log_num_zeros_in_grad'),
        notice('--log-max-attention-logit', 'on', LOG),
        notice('--no-barrier-with-level-1-timing', 'off', LOG),
        notice('--log-world-size-to-tensorboard', 'on', LOG),
        mapped('--wandb-project', 'str', 'logging.wandb_project'),
        notice('--wandb-exp-name', 'str', LOG),
        notice('--wandb-save-dir', 'str', LOG),
        notice('--wandb-entity', 'str', LOG),
        notice('--logging-level', 'int', LOG),
        notice('--log-energy', 'on', LOG),
        notice('--moe-routing-trace-path', 'str', LOG),
        notice('--moe-routing-trace-max-training-iters', 'int', LOG),
        notice('--moe-routing-trace-capture-logits', 'on', LOG),
        notice('--moe-routing-trace-capture-hidden-states', 'on', LOG),
        notice('--moe-routing-trace-dump-weights', 'on', LOG),
    ),
    # opentelemetry
    *group(
        'opentelemetry',
        notice('--otel-enabled', 'on', LOG),
        notice('--otel-service-name', 'str', LOG),
        notice('--otel-span-groups', 'str', LOG),
    ),
    # Logits Distillation
    *group(
        'Logits Distillation',
        refused('--logits-save-top-k', 'int', G_LOGITS_DISTILLATION),
        refused('--logits-save-top-p', 'float', G_LOGITS_DISTILLATION),
        refused('--logits-save-top-p-min-k', 'int', G_LOGITS_DISTILLATION),
        refused('--logits-save-dir', 'str', G_LOGITS_DISTILLATION),
        refused(
            '--logits-save-dtype', 'str', G_LOGITS_DISTILLATION, choices=('fp16', 'bf16', 'fp32'),
        ),
        refused('--logits-load-dir', 'str', G_LOGITS_DISTILLATION),
        refused('--logits-load-decode-threads', 'int', G_LOGITS_DISTILLATION),
        refused('--logits-load-prefetch-factor', 'int', G_LOGITS_DISTILLATION),
        refused('--logits-load-msc-prefetch-depth', 'int', G_LOGITS_DISTILLATION),
        refused('--logits-load-kd-loss-alpha', 'float', G_LOGITS_DISTILLATION),
        refused('--logits-load-ignore-errors', 'on', G_LOGITS_DISTILLATION),
    ),
    # straggler
    *group(
        'straggler',
        notice('--log-straggler', 'on', LOG),
        notice('--straggler-ctrlr-port', 'int', LOG),
        notice('--straggler-minmax-count', 'int', LOG),
        notice('--disable-straggler-on-startup', 'on', LOG),
    ),
    # workload inspector
    *group(
        'workload inspector',
        notice('--run-workload-inspector-server', 'on', LOG),
    ),
    # inference
    *group(
        'inference',
        notice('--inference-batch-times-seqlen-threshold', 'int', INFER),
        notice('--max-tokens-to-oom', 'int', INFER),
        notice('--output-bert-embeddings', 'on', INFER),
        notice('--bert-embedder-type', 'str', INFER, choices=('megatron', 'huggingface')),
        notice('--cuda-graph-scope', 'str+', INFER),
        notice('--cuda-graph-modules', 'str+', INFER),
        notice('--use-legacy-static-engine', 'on', INFER),
        notice('--inference-max-requests', 'int', INFER),
        notice('--inference-max-seq-length', 'int', INFER),
        notice('--inference-dynamic-batching', 'on', INFER),
        notice('--inference-dynamic-batching-buffer-size-gb', 'float', INFER),
        notice('--inference-dynamic-batching-paused-buffer-size-gb', 'float', INFER),
        notice('--inference-dynamic-batching-mamba-memory-ratio', 'float', INFER),
        notice('--inference-dynamic-batching-block-size', 'int', INFER),
        notice('--inference-dynamic-batching-max-requests', 'int', INFER),
        notice('--inference-dynamic-batching-max-tokens', 'int', INFER),
        notice('--inference-dynamic-batching-num-cuda-graphs', 'int', INFER),
        notice('--inference-dynamic-batching-track-paused-request-events', 'on', INFER),
        notice('--inference-dynamic-batching-track-generated-token-events', 'on', INFER),
        notice('--decode-only-cuda-graphs', 'on', INFER),
        notice('--inference-cuda-graph-all-prefills', 'on', INFER),
        notice('--inference-cuda-graph-max-tokens', 'int', INFER),
        notice('--inference-dynamic-batching-unified-memory-level', 'int', INFER, choices=(0, 1)),
        notice('--enable-chunked-prefill', 'on', INFER),
        notice('--num-speculative-tokens', 'int', INFER),
        notice(
            '--inference-dynamic-batching-prefix-caching --no-inference-dynamic-batching-prefix-caching',
            'bool', INFER,
        ),
        notice(
            '--inference-dynamic-batching-prefix-caching-eviction-policy', 'str', INFER,
            choices=('ref_zero', 'lru'),
        ),
        notice(
            '--inference-dynamic-batching-prefix-caching-coordinator-policy', 'str', INFER,
            choices=('longest_prefix', 'first_prefix_block', 'load_balanced'),
        ),
        notice('--inference-dynamic-batching-prefix-caching-routing-alpha', 'float', INFER),
        notice('--inference-dynamic-batching-prefix-caching-mamba-gb', 'float', INFER),
        notice('--inference-dynamic-batching-cuda-graph-mixed-prefill-count', 'int', INFER),
        notice(
            '--inference-dynamic-batching-cuda-graph-sizing-distribution', 'str', INFER,
            choices=('exponential', 'linear'),
        ),
        notice(
            '--inference-dynamic-batching-sampling-backend', 'str', INFER,
            choices=('torch', 'flashinfer'),
        ),
        notice('--use-same-sampling-seed-across-dp-ranks', 'off', INFER),
        notice(
            '--inference-dynamic-batching-async-sched-mode', 'str', INFER,
            choices=('legacy', 'async'),
        ),
        notice(
            '--inference-dynamic-batching-logprobs-mode', 'str', INFER,
            choices=('raw_logprobs', 'processed_logprobs'),
        ),
        notice('--inference-logging-step-interval', 'int', INFER),
        notice(
            '--inference-text-gen-server-logging --no-inference-text-gen-server-logging', 'bool',
            INFER,
        ),
        notice('--inference-wandb-logging --no-inference-wandb-logging', 'bool', INFER),
        notice('--inference-coordinator-port', 'int', INFER),
        notice(
            '--mamba-inference-conv-states-dtype', 'str', INFER, choices=('bf16', 'fp16', 'fp32'),
        ),
        notice(
            '--mamba-inference-ssm-states-dtype', 'str', INFER, choices=('bf16', 'fp16', 'fp32'),
        ),
        notice(
            '--inference-use-synchronous-zmq-collectives --no-inference-use-synchronous-zmq-collectives',
            'bool', INFER,
        ),
        notice(
            '--inference-disable-ep-consensus --no-inference-disable-ep-consensus', 'bool', INFER,
        ),
        notice('--inference-shards', 'str', INFER),
    ),
    # Transformer-Engine
    *group(
        'Transformer-Engine',
        notice('--fp4-param-gather', 'on', FP8),
        notice('--fp8-param-gather', 'on', FP8),
        refused(
            '--te-precision-config-file', 'str',
            'Transformer Engine precision configs are not read here',
        ),
    ),
    # experimental
    *group(
        'experimental',
        notice('--enable-experimental', 'on', 'no experimental features are switched by it here'),
        refused('--spec', 'str*', 'layer specs are chosen by --transformer-impl'),
        refused(
            '--hybrid-layer-pattern', 'str',
            "hybrid models are Megatron-LM's pretrain_mamba.py; here: python -m megatron_ext.train model.arch=hybrid",
        ),
        refused(
            '--hybrid-override-pattern', 'str',
            "hybrid models are Megatron-LM's pretrain_mamba.py; here: python -m megatron_ext.train model.arch=hybrid",
        ),
        refused('--yaml-cfg', 'str', 'use Hydra: python -m megatron_ext.train with a config'),
        refused('--use-precision-aware-optimizer', 'on', NO_KEY),
        notice(
            '--main-grads-dtype', 'str', 'optimizer state is fp32 here', choices=('fp32', 'bf16'),
            only=('fp32',), refuse='reduced-precision optimizer state is not supported',
        ),
        notice(
            '--main-params-dtype', 'str', 'optimizer state is fp32 here', choices=('fp32', 'fp16'),
            only=('fp32',), refuse='reduced-precision optimizer state is not supported',
        ),
        notice(
            '--exp-avg-dtype', 'str', 'optimizer state is fp32 here',
            choices=('fp32', 'fp16', 'bf16', 'fp8'), only=('fp32',),
            refuse='reduced-precision optimizer state is not supported',
        ),
        notice(
            '--exp-avg-sq-dtype', 'str', 'optimizer state is fp32 here',
            choices=('fp32', 'fp16', 'bf16', 'fp8'), only=('fp32',),
            refuse='reduced-precision optimizer state is not supported',
        ),
        notice(
            '--megatron-fsdp-main-params-dtype', 'str', FSDP,
            choices=('fp32', 'bf16', 'fp16', 'auto'),
        ),
        notice(
            '--megatron-fsdp-main-grads-dtype', 'str', FSDP,
            choices=('fp32', 'bf16', 'fp16', 'auto'),
        ),
        notice(
            '--megatron-fsdp-grad-comm-dtype', 'str', FSDP,
            choices=('fp32', 'fp16', 'bf16', 'auto'),
        ),
        notice('--megatron-fsdp-enable-fine-grained-param-gather', 'on', FSDP),
        notice('--megatron-fsdp-max-pool-double-buffer', 'on', FSDP),
        notice('--fsdp-db-use-persist-buf-on-alloc-fail', 'on', FSDP),
    ),
    # one logger
    *group(
        'one logger',
        notice('--no-one-logger', 'off', LOG),
        notice('--one-logger-project', 'str', LOG),
        notice('--one-logger-run-name', 'str', LOG),
        notice('--one-logger-async', 'on', LOG),
        notice('--app-tag-run-name', 'str', LOG),
        notice('--app-tag-run-version', 'str', LOG),
    ),
    # In-process restart
    *group(
        'In-process restart',
        refused(
            '--inprocess-restart', 'on',
            'in-process restart is not supported; restarts are launcher.max_restarts',
        ),
        notice('--inprocess-max-iterations', 'int', G_IN_PROCESS_RESTART),
        notice('--inprocess-monitor-thread-interval', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-monitor-process-interval', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-progress-watchdog-interval', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-heartbeat-interval', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-soft-timeout', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-hard-timeout', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-heartbeat-timeout', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-barrier-timeout', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-completion-timeout', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-last-call-wait', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-termination-grace-time', 'float', G_IN_PROCESS_RESTART),
        notice('--inprocess-granularity', 'str', G_IN_PROCESS_RESTART, choices=('node', 'rank')),
        notice('--inprocess-active-world-size', 'int', G_IN_PROCESS_RESTART),
        notice('--inprocess-empty-cuda-cache', 'on', G_IN_PROCESS_RESTART),
    ),
    # ft_package
    *group(
        'ft_package',
        notice('--enable-ft-package', 'on', G_FT_PACKAGE),
        notice('--calc-ft-timeouts', 'on', G_FT_PACKAGE),
        notice('--ft-num-warmup-iters', 'int', G_FT_PACKAGE),
    ),
    # rerun engine
    *group(
        'rerun engine',
        notice(
            '--error-injection-rate', 'int', 'no error injection', only=(0,),
            refuse='error injection is not part of this trainer',
        ),
        notice(
            '--error-injection-type', 'str', G_RERUN_ENGINE,
            choices=('correct_result', 'transient_error', 'persistent_error'),
        ),
        notice(
            '--rerun-mode', 'str', G_RERUN_ENGINE,
            choices=('disabled', 'validate_results', 'report_stats'),
        ),
        mapped(
            '--check-for-spiky-loss', 'on', 'train.spike_factor', const=10.0,
            note="Megatron-LM's factor 10, here of the mean of the last train.spike_window losses (Megatron-LM "
            'compares with the largest of 100 it sampled); a spike is handled as train.nan_policy says',
        ),
    ),
    # msc
    *group(
        'msc',
        notice('--enable-msc', 'on', G_MSC),
        notice('--disable-msc', 'on', G_MSC),
    ),
    # sft
    *group(
        'sft',
        mapped(
            '--sft', 'on', 'data', const='sft', derived=True,
            note='the preset: the --data-path files become `data.sft.path`, JSONL conversations; the loss falls '
            "on the assistant's tokens; conversations are packed, each attending to itself",
        ),
        mapped(
            '--sft-tokenizer-prompt-format', 'str', 'data.sft.prompt_format', derived=True,
            note="with --tokenizer-type SFTTokenizer absent: Megatron-LM's nemotron-h-aligned; with other "
            "tokenizers absent: the tokenizer's own chat template",
        ),
    ),
    # fault injector
    *group(
        'fault injector',
        refused('--fault-injector-ranks', 'str', G_FAULT_INJECTOR),
        refused('--fault-injector-num-ranks', 'int', G_FAULT_INJECTOR),
        refused('--fault-injector-fault-types', 'str', G_FAULT_INJECTOR),
        refused('--fault-injector-fault-probabilities', 'str', G_FAULT_INJECTOR),
        refused('--fault-injector-fault-delay', 'float', G_FAULT_INJECTOR),
        refused('--fault-injector-delay-start-iteration', 'int', G_FAULT_INJECTOR),
        refused('--fault-injector-mtti-seconds', 'float', G_FAULT_INJECTOR),
        refused('--fault-injector-offset-seconds', 'float', G_FAULT_INJECTOR),
        refused('--fault-injector-seed', 'int', G_FAULT_INJECTOR),
    ),
    # modelopt-generic
    *group(
        'modelopt-generic',
        notice(
            '--export-model-type', 'str', 'pretrain_gpt builds a GPTModel',
            choices=('GPTModel', 'HybridModel', 'MambaModel'), only=('GPTModel',),
            refuse='hybrid/Mamba models: python -m megatron_ext.train model.arch=hybrid',
        ),
        refused('--export-legacy-megatron', 'on', G_MODELOPT_GENERIC),
        refused('--export-te-mcore-model', 'on', G_MODELOPT_GENERIC),
        refused('--export-default-te-spec', 'on', G_MODELOPT_GENERIC),
        notice(
            '--export-force-local-attention', 'on',
            "the layers here use megatron-core's local attention unless Transformer Engine runs",
        ),
        refused(
            '--export-kv-cache-quant', 'str', G_MODELOPT_GENERIC,
            choices=('none', 'fp8', 'fp8_affine', 'nvfp4', 'nvfp4_affine', 'nvfp4_rotate'),
        ),
        refused(
            '--export-real-quant-cfg', 'str', G_MODELOPT_GENERIC,
            choices=('fp8_real_quant', 'fp8_blockwise_real_quant', 'None'),
        ),
        refused('--export-quant-cfg', 'str', G_MODELOPT_GENERIC),
        refused('--export-kd-teacher-load', 'str', G_MODELOPT_GENERIC),
        refused('--export-kd-teacher-model-config', 'str', G_MODELOPT_GENERIC),
        refused(
            '--export-kd-teacher-ckpt-format', 'str', G_MODELOPT_GENERIC,
            choices=('torch', 'torch_dist', 'torch_dcp'),
        ),
        refused('--export-kd-cfg', 'str', G_MODELOPT_GENERIC),
        refused('--finetune-hf-dataset', 'str', 'a Hugging Face hub dataset is downloaded at run time: give local JSONL conversations with --sft --data-path'),
        refused('--finetune-data-split', 'str', G_MODELOPT_GENERIC),
        refused('--finetune-data-files', 'str+', G_MODELOPT_GENERIC),
        refused('--qad-train-target', 'str', G_MODELOPT_GENERIC, choices=('base', 'mtp', 'both')),
        refused('--freeze-base-for-mtp', 'on', G_MODELOPT_GENERIC),
        refused('--export-qk-l2-norm', 'on', G_MODELOPT_GENERIC),
        refused('--export-moe-apply-probs-on-input', 'on', G_MODELOPT_GENERIC),
        refused('--export-offline-model', 'on', G_MODELOPT_GENERIC),
        refused('--modelopt-enabled', 'on', G_MODELOPT_GENERIC),
        notice(
            '--enable-gpt-oss', 'on',
            "read by ModelOpt's model builder only (--modelopt-enabled, or a ModelOpt checkpoint), where it sets "
            "gpt-oss's YaRN; without ModelOpt Megatron-LM builds the model from the other flags, as here",
        ),
    ),
)

# Flags beyond Megatron-LM's current parser.
OWN_FLAGS: tuple[Flag, ...] = group(
    "megatron_ext",
    mapped("--nproc", "int", "launcher.nproc", note="local workers when not under torchrun/srun"),
    mapped(
        "--virtual-pipeline-model-parallel-size", "int", "parallel.vpp",
        note="older Megatron-LM's name of --num-virtual-stages-per-pipeline-rank",
    ),
)
