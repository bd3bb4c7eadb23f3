"""Typed configuration tree of a training run.

Every section is a dataclass registered in Hydra's ConfigStore (see `store.py`), so YAML presets
and command-line overrides (`parallel.tp=2`, `model=llama_tiny`) are type-checked by OmegaConf.
Field comments say what a field means; the rules that tie fields together live in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """A decoder in megatron-core's GPTModel space, optionally with MoE MLPs.

    The defaults are a LLaMA-style model (RMSNorm, SwiGLU, RoPE, GQA, no biases, no dropout),
    the family of this project's presets. Megatron-LM's own defaults are GPT-3's (LayerNorm,
    GeLU with a 4h MLP, learned absolute positions, biases, dropout 0.1); the Megatron-LM entry
    point (`config/mlm_args.py`) sets those when its flags leave them out.
    """

    # The preset's name (config/store.py); a label in logs and messages: the fields below define the model.
    name: str = "llama_tiny"
    num_layers: int = 4  # Transformer layers of the decoder (for arch=hybrid: the hybrid_pattern's symbols).
    hidden_size: int = 128  # Width of the residual stream (the embedding dimension).
    ffn_hidden_size: int = 352  # Intermediate width of a dense MLP (a gated MLP's fc1 computes two of this width).
    num_attention_heads: int = 4  # Query heads per attention layer.
    # Key/value heads for grouped-query attention; None means one per attention head (MHA).
    num_query_groups: Optional[int] = None
    seq_length: int = 128  # Tokens per training sample (the context length trained at).
    # None: taken from the tokenizer. The embedding is padded to a multiple of
    # `make_vocab_size_divisible_by * tp` so every TP rank holds an equal slice.
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128  # Padding multiple of the embedding's rows (see vocab_size).
    tie_embeddings: bool = True  # Output layer shares the input embedding's weights (false: its own matrix).
    rotary_base: float = 10000.0  # RoPE's base (theta): the wavelength scale of its rotation frequencies.
    norm_epsilon: float = 1e-5  # Epsilon added to the variance in every LayerNorm / RMSNorm.
    # Channels per attention head; None: hidden_size // num_attention_heads. Set when the two
    # are decoupled (e.g. a submodel sliced from an elastic parent keeps the parent's head size).
    head_dim: Optional[int] = None
    init_method_std: float = 0.02  # Standard deviation of the normal initialisation of the weights.
    # LayerNorm | RMSNorm
    normalization: str = "RMSNorm"
    # swiglu (gated SiLU) | gelu | squared_relu | quick_geglu (gated x*sigmoid(1.702x), gpt-oss)
    activation: str = "swiglu"
    # Gated activations (gpt-oss): added to the linear half of the GLU, and the bound both halves
    # are clamped to (the gate from above only). Megatron-LM's --glu-linear-offset and
    # --activation-func-clamp-value; None: no clamp.
    glu_linear_offset: float = 0.0
    # The clamp bound described above (Megatron-LM's --activation-func-clamp-value); None: no clamp.
    activation_func_clamp_value: Optional[float] = None
    # rope | yarn | learned_absolute | none
    position_embedding_type: str = "rope"
    # Fraction of each head's channels that RoPE rotates.
    rotary_percent: float = 1.0
    # RoPE frequency scaling: None, or llama3 (Llama 3.1's bands, `rope_scaling_factor`).
    rope_scaling: Optional[str] = None
    # What rope_scaling=llama3 divides the low frequencies by (Megatron-LM's --rope-scaling-factor).
    rope_scaling_factor: float = 8.0
    # YaRN (position_embedding_type=yarn, also MLA's): how far RoPE is stretched, the context
    # length trained before the stretch, the band of frequencies blended between interpolation
    # and extrapolation (beta_fast / beta_slow rotations), and the attention scale
    # mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim). Megatron-LM's
    # --rotary-scaling-factor, --yarn-original-max-position-embeddings, --yarn-beta-fast,
    # --yarn-beta-slow, --mscale and --mscale-all-dim, with their defaults.
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096  # YaRN: context length trained before the stretch.
    yarn_beta_fast: float = 32.0  # YaRN: rotations above which a frequency is extrapolated.
    yarn_beta_slow: float = 1.0  # YaRN: rotations below which a frequency is interpolated.
    yarn_mscale: float = 1.0  # YaRN: m in the attention scale's numerator 0.1 * m * ln(factor) + 1.
    yarn_mscale_all_dim: float = 0.0  # YaRN: m of the scale's denominator (0: the denominator is 1).
    # Rows of the learned position table (learned_absolute) and the context length a
    # Hugging Face export declares; None: seq_length.
    max_position_embeddings: Optional[int] = None
    add_bias_linear: bool = False  # Biases on every linear layer (attention and MLP); false: none (LLaMA).
    # Bias on the QKV projection alone (Qwen2); add_bias_linear implies it.
    add_qkv_bias: bool = False
    # RMS/LayerNorm on each head's queries and keys (Qwen3, OLMo 2).
    qk_layernorm: bool = False
    hidden_dropout: float = 0.0  # Dropout probability after attention and the MLP, before the residual add (0: none).
    attention_dropout: float = 0.0  # Dropout probability on the attention weights (0: none).
    # Sliding-window attention (Megatron-LM's --window-size "L,R"): a query at position i sees
    # keys i-L .. i+R (R is 0 in a causal decoder); None: full attention. With
    # window_attn_skip_freq N every N-th layer (1-based) keeps full attention (gpt-oss: N=2);
    # None: every layer is windowed.
    window_size: Optional[list[int]] = None
    # Every N-th layer keeps full attention (see window_size); None: every layer is windowed.
    window_attn_skip_freq: Optional[int] = None
    # vanilla | off-by-one (a zero logit added to every softmax denominator) | learnable (one
    # learned logit, an attention sink, per head: gpt-oss). Megatron-LM's --softmax-type.
    softmax_type: str = "vanilla"
    # Megatron-LM's --attention-backend: auto | flash | fused | unfused | local. With Transformer
    # Engine's layers it picks TE's kernel, as in Megatron-LM. On megatron's local layers (every
    # CPU run) auto, flash and fused compute attention with torch's scaled_dot_product_attention
    # wherever it means the same (models/sdpa.py); unfused and local keep megatron's
    # DotProductAttention math.
    attention_backend: str = "auto"
    # Multi-token prediction (DeepSeek-V3): this many extra layers after the decoder, the k-th
    # predicting the token k+1 places ahead. Their mean loss times mtp_loss_scaling_factor joins
    # the training objective; the reported loss stays the next-token one, as in Megatron-LM.
    # None: no MTP.
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1  # Weight of the MTP layers' mean loss in the objective (see mtp_num_layers).
    # Multi-latent attention (DeepSeek-V2/V3): low-rank compressed queries and keys/values.
    multi_latent_attention: bool = False
    # None: queries are not compressed.
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512  # MLA: rank of the compressed keys / values.
    qk_head_dim: int = 128  # MLA: query / key channels per head without RoPE.
    qk_pos_emb_head_dim: int = 64  # MLA: query / key channels per head that carry RoPE.
    v_head_dim: int = 128  # MLA: value channels per head.
    # Mixture of experts: None means dense MLPs in every layer.
    num_experts: Optional[int] = None
    moe_router_topk: int = 2  # Experts each token is routed to.
    moe_ffn_hidden_size: Optional[int] = None  # Intermediate width of each expert's MLP; None: ffn_hidden_size.
    moe_aux_loss_coeff: float = 0.0  # Weight of the load-balancing loss (moe_router_load_balancing_type); 0: none.
    # ST-MoE's router z-loss (gpt-oss, Megatron-LM's --moe-z-loss-coeff): the squared
    # log-sum-exp of each token's router logits, times this; None: none.
    moe_z_loss_coeff: Optional[float] = None
    # aux_loss | seq_aux_loss | sinkhorn | none (megatron's moe_router_load_balancing_type)
    moe_router_load_balancing_type: str = "aux_loss"
    # Softmax over all experts' logits before the top-k (false: over the top-k chosen).
    moe_router_pre_softmax: bool = False
    # softmax | sigmoid
    moe_router_score_function: str = "softmax"
    # DeepSeek-V3's aux-loss-free balancing: a per-expert bias updated from the routed counts.
    moe_router_enable_expert_bias: bool = False
    # Group-limited routing: experts in `num_groups` groups, tokens routed within the best
    # `group_topk` groups. None: not grouped.
    moe_router_num_groups: Optional[int] = None
    # Groups each token may route within (see moe_router_num_groups); None: not grouped.
    moe_router_group_topk: Optional[int] = None
    # Factor on the top-k routing weights (with moe_router_pre_softmax; DeepSeek-V3); None: no scaling.
    moe_router_topk_scaling_factor: Optional[float] = None
    # Width of the shared expert that every token passes through; None: no shared expert.
    moe_shared_expert_intermediate_size: Optional[int] = None
    # MoE in every N-th layer (1: every layer), or megatron's pattern string "([0]+[1]*3)*8".
    moe_layer_freq: str = "1"
    # All local experts in one grouped GEMM (Transformer Engine); without TE, one GEMM per expert.
    moe_grouped_gemm: bool = False
    # allgather | alltoall (megatron's moe_token_dispatcher_type), both on CPU and CUDA; flex
    # (DeepEP / HybridEP kernels, `moe_flex_dispatcher_backend`) where they are installed on
    # CUDA, else alltoall: the same routing and math.
    moe_token_dispatcher: str = "allgather"
    moe_flex_dispatcher_backend: str = "deepep"  # Kernels of the flex dispatcher: deepep | hybridep.
    # megatron's benchmark mode: random router logits, so tokens spread evenly over the experts.
    moe_router_force_load_balancing: bool = False
    # Weights to start from instead of random ones: a .gguf file, a Hugging Face folder, a
    # megatron_ext checkpoint folder, or `pkg:<module>/<file>` inside an installed package. The
    # fields above must describe the same architecture (checked when the weights are read).
    pretrained: Optional[str] = None
    # fp32 | bf16 | fp16. CPU runs are fp32.
    precision: str = "fp32"
    # Draw each weight from its own seeded generator, so that every TP/PP/EP layout starts from
    # the identical model (models/init.py; layout comparisons and tests rely on it). None: on for
    # CPU runs, off on CUDA (megatron initialises on the GPU, as Megatron-LM does).
    layout_independent_init: Optional[bool] = None
    # Layer implementation: auto (Transformer Engine when installed and on CUDA) | local | te.
    # For arch=hybrid, auto uses megatron's MambaMixer kernels when mamba_ssm is installed on
    # CUDA, local always the pure-PyTorch mixer.
    spec: str = "auto"
    # gpt: the LLaMA-style decoder above. hybrid: megatron's MambaModel with `hybrid_pattern`.
    arch: str = "gpt"
    # Hybrid layers, one symbol each (megatron's hybrid_override_pattern): M Mamba2,
    # * attention, - MLP, E MoE (needs num_experts). Its length must equal num_layers.
    hybrid_pattern: Optional[str] = None
    # Mamba2 mixer sizes (hybrid): heads of mamba_head_dim channels in mamba_num_groups groups
    # that share B/C of size mamba_state_dim. None heads: 2 * hidden_size / mamba_head_dim.
    mamba_num_heads: Optional[int] = None
    mamba_head_dim: int = 64  # Channels per Mamba2 head.
    mamba_num_groups: int = 8  # Groups of Mamba2 heads sharing B / C.
    mamba_state_dim: int = 128  # Size of the SSM state (of B / C) per group.
    # Tokens per chunk of the chunked SSD scan.
    mamba_chunk_size: int = 64


@dataclass
class ParallelConfig:
    """How the world is cut. world = tp * pp * dp * cp; ep divides dp * cp (megatron's rule)."""

    tp: int = 1  # Tensor-parallel size: ranks that split each layer's weight matrices.
    pp: int = 1  # Pipeline-parallel size: stages the layers are cut into.
    # None: whatever is left of the world after tp * pp * cp.
    dp: Optional[int] = None
    ep: int = 1  # Expert-parallel size: ranks the MoE experts are spread over.
    cp: int = 1  # Context-parallel size: ranks that split each sequence.
    # Virtual pipeline stages per rank (interleaved 1F1B); None disables interleaving.
    vpp: Optional[int] = None
    # Uneven pipeline stages (megatron's num_layers_in_first/last_pipeline_stage): transformer
    # layers on the first / last stage, e.g. fewer where the embedding or the loss already costs
    # time. None: that stage gets an even share; the other stages split the rest evenly.
    first_stage_layers: Optional[int] = None
    # Transformer layers on the last pipeline stage (see first_stage_layers); None: an even share.
    last_stage_layers: Optional[int] = None
    # Megatron's sequence parallelism: norms and dropout on each TP rank's slice of the tokens.
    sequence_parallel: bool = False
    # Shard the optimizer state and fp32 main params over the DP ranks (ZeRO-1, megatron's).
    use_distributed_optimizer: bool = True
    # Start each gradient bucket's DP all-reduce during the backward pass instead of after it.
    overlap_grad_reduce: bool = False


@dataclass
class SFTConfig:
    """Supervised fine-tuning data: conversations, the loss on the assistant's tokens
    (megatron_ext/data/sft/)."""

    # JSONL / JSON / Parquet files of chat records, or folders of them ({"messages": [...]} or
    # {"prompt": ..., "completion": ...}); must be given.
    path: list[str] = MISSING
    # How conversations become text: null, the tokenizer's own chat template; or a named
    # format: chatml | llama3 | nemotron-h-aligned | nemotron-nano-v2.
    prompt_format: Optional[str] = None
    # Several whole conversations per sample, each attending to itself only, positions
    # restarting; false: one conversation per sample, padded (models with Mamba layers).
    pack: bool = True
    # A conversation longer than seq_length + 1 tokens: truncate | skip | error. Either way the
    # run logs how many; a truncated one left with no assistant token is skipped.
    overlong: str = "truncate"


@dataclass
class DataConfig:
    # Megatron indexed-dataset prefixes (without .bin/.idx), optionally weighted like megatron's
    # --data-path ("0.7 a 0.3 b"). Empty: the default corpus, built on first use and cached.
    data_path: list[str] = field(default_factory=list)
    # Which text the default corpus is made of: "stdlib" (the Python standard library's sources
    # and docs, present on every machine) or a path to a text file / directory of text files.
    corpus: str = "stdlib"
    # "auto": the pretrained model's own tokenizer when model.pretrained is set, else "byte".
    # "byte": 256 byte symbols + specials, no training needed. Or a path to a Hugging Face
    # tokenizer.json (its special tokens read from its folder as transformers reads them), a
    # SentencePiece .model, a folder holding either, or a GGUF file whose vocabulary defines the
    # BPE tokenizer.
    tokenizer: str = "auto"
    split: str = "969,30,1"  # Train, validation and test weights of the documents (Megatron-LM's --split).
    # Where the default corpus, tokenized datasets and their index files are cached.
    cache_dir: str = "~/.cache/megatron_ext"
    # Megatron's mock dataset (random tokens of the model's vocabulary), no files read.
    mock: bool = False
    num_workers: int = 0  # DataLoader worker processes per rank (0: load in the training process).
    # Supervised fine-tuning on conversations (`data=sft data.sft.path=...`); None: pre-training
    # on data.data_path, the corpus or mock data.
    sft: Optional[SFTConfig] = None


@dataclass
class OptimConfig:
    optimizer: str = "adam"  # adam | sgd (megatron-core's).
    lr: float = 3e-3  # Peak learning rate, reached after the warmup.
    min_lr: float = 3e-4  # Learning rate at the end of the decay (and after it).
    weight_decay: float = 0.01  # Decoupled weight decay (L2 for sgd); biases and norms are not decayed.
    adam_beta1: float = 0.9  # Adam's first-moment decay.
    adam_beta2: float = 0.95  # Adam's second-moment decay.
    adam_eps: float = 1e-8  # Adam's epsilon, added to the denominator.
    clip_grad: float = 1.0  # Global gradient-norm clip (0: none).
    # None: 5% of train.iters.
    lr_warmup_iters: Optional[int] = None
    # None: train.iters.
    lr_decay_iters: Optional[int] = None
    lr_decay_style: str = "cosine"  # constant | linear | cosine | inverse-square-root: the decay from lr to min_lr.
    # Megatron-LM's sample-based schedule: warmup and decay counted in samples rather than
    # iterations (exclusive with lr_warmup_iters / lr_decay_iters).
    lr_warmup_samples: Optional[int] = None
    lr_decay_samples: Optional[int] = None  # Samples of the decay (see lr_warmup_samples); None: iteration-based.
    # The lr warmup starts from (Megatron-LM's --lr-warmup-init).
    lr_warmup_init: float = 0.0
    # Megatron-LM's --decoupled-lr / --decoupled-min-lr: the embedding and output layer's own
    # peak and final lr (megatron-core gives them their own parameter group); None: lr / min_lr.
    decoupled_lr: Optional[float] = None
    # The embedding and output layer's final lr (see decoupled_lr); None: min_lr.
    decoupled_min_lr: Optional[float] = None


@dataclass
class TrainConfig:
    iters: int = 200  # Optimizer steps of the run (unless train_samples is set).
    # Megatron-LM's --train-samples: train for this many samples instead of `iters`
    # (iterations = train_samples / global_batch_size).
    train_samples: Optional[int] = None
    micro_batch_size: int = 4  # Samples per micro-batch on each data-parallel rank.
    # None: micro_batch_size * dp (one micro-batch per data-parallel rank per step).
    global_batch_size: Optional[int] = 16
    # A global batch that grows with the samples consumed (training/batch_schedule.py); the
    # micro-batches per step follow it, and the lr schedule then counts samples. At most one:
    # - Megatron-LM's --rampup-batch-size [start, increment, ramp samples] (megatron-core 0.16's
    #   ramp): from `start`, `increment` more every (global_batch_size - start) / increment-th
    #   share of the ramp samples, then global_batch_size. Sample-based runs only.
    # - Megatron-LM's --step-batch-size-schedule "THRESHOLD:BATCH ...": the batch of the last
    #   entry whose threshold (tokens, K/M/B/T suffixes) the tokens consumed have reached; the
    #   first threshold is 0. global_batch_size, when set, must be the last entry's batch.
    rampup_batch_size: Optional[list[int]] = None
    step_batch_size_schedule: Optional[str] = None  # The token-threshold schedule described above; None: none.
    seed: int = 1234  # Seed of the weights' initialisation, the data order and dropout.
    eval_interval: int = 50  # Validate every N iterations (0: never).
    # Global batches per validation (and of the test set at the end); 0: no validation and no
    # test (Megatron-LM's --eval-iters 0).
    eval_iters: int = 4
    # Stop after this many iterations of this invocation (for tests and preemption drills).
    exit_interval: Optional[int] = None
    # Megatron-LM's --check-for-nan-in-loss-and-grad: a step whose gradient norm or loss is not
    # finite is not applied, and nan_policy decides what follows (fp16's loss scaler skips such
    # steps itself).
    check_for_nan: bool = True
    # stop: nothing more is saved, one line, exit 1 | rollback: reload the newest checkpoint, skip
    # the batches since it, multiply the lr by rollback_lr_scale and go on (at most max_rollbacks times).
    nan_policy: str = "stop"
    # A loss above spike_factor x the mean of the last spike_window losses is treated as a NaN
    # (Megatron-LM's --check-for-spiky-loss); None: off.
    spike_factor: Optional[float] = None
    spike_window: int = 20  # Steps whose mean loss a spike is measured against.
    rollback_lr_scale: float = 0.5  # The lr's (and min lr's) factor at each rollback.
    max_rollbacks: int = 3  # Rollbacks of one run before it stops as under nan_policy=stop.
    # Megatron-LM's --skip-train: no training step; the weights set up (checkpoint.load's, else
    # the initial ones) are evaluated on `eval_iters` batches of the validation and test sets
    # (whatever eval_interval), and the run ends writing no checkpoint and no TensorBoard or W&B
    # scalars. The optimizer state loads as checkpoint.load_optim says (pretrain_gpt's
    # --skip-train turns it off, as Megatron-LM does).
    skip_train: bool = False
    # Megatron-LM's --manual-gc: no automatic garbage collection while training, so that no
    # rank stops at a moment of its own (a full collection of a worker's objects takes tenths
    # of a second) while the others wait in a collective; instead a full one on every rank at
    # the same steps: every `manual_gc_interval` steps (0: never) and before and after each
    # evaluation (unless `manual_gc_eval` is false).
    manual_gc: bool = False
    manual_gc_interval: int = 0  # Full collection every N steps with manual_gc (0: never).
    manual_gc_eval: bool = True  # With manual_gc, also collect before and after each evaluation.
    # Megatron-LM's --test-mode, megatron-core's real-time test: with model.qk_layernorm, each
    # attention layer's forward all-gathers its QK-norms' weights and biases over the data- and
    # tensor-parallel ranks and stops the run where a replica differs (silent memory or network
    # corruption). No effect without qk_layernorm or with multi-latent attention.
    test_mode: bool = False


@dataclass
class CheckpointConfig:
    # Directory to save to (megatron layout: iter_0000100/ + latest_checkpointed_iteration.txt).
    save: Optional[str] = None
    # Directory to resume from; it must hold a checkpoint, except when it is also `save` (the
    # resume-if-present idiom: a first run finds nothing yet and starts from scratch) or with
    # `load_optional`.
    load: Optional[str] = None
    # Resume from this iteration of `load` instead of the latest (megatron's --ckpt-step).
    step: Optional[int] = None
    # Save every N iterations; None saves only at the end.
    interval: Optional[int] = None
    # Keep this many most recent checkpoints; None keeps all.
    keep_last: Optional[int] = 2
    # A `load` directory without a checkpoint starts from scratch instead of being an error
    # (implied when load == save).
    load_optional: bool = False
    # Write checkpoints in the background (dist_checkpointing's async save); training goes on.
    async_save: bool = False
    # What a resume restores besides the weights (Megatron-LM's --no-load-optim / --no-load-rng):
    # without the optimizer, its moments and the lr schedule start fresh, with fp32 main
    # params copied from the loaded weights; without the RNG, the streams keep this run's seed.
    load_optim: bool = True
    load_rng: bool = True  # Restore the RNG streams on resume (see load_optim).
    # What a save writes besides the weights (Megatron-LM's --no-save-optim / --no-save-rng):
    # without the optimizer, neither its state nor the lr schedule, so resuming the checkpoint
    # needs load_optim=false (or finetune); without the RNG, a resume keeps its own seeding.
    save_optim: bool = True
    save_rng: bool = True  # Write the RNG streams into the checkpoint (see save_optim).
    # Megatron-LM's --finetune: only the weights are loaded; the iteration, the data position,
    # the lr schedule, the optimizer and the RNG start fresh.
    finetune: bool = False


@dataclass
class LoggingConfig:
    log_interval: int = 10  # Write a log line every N iterations.
    progress_bar: bool = True  # A tqdm progress bar (false: log lines only).
    tensorboard_dir: Optional[str] = None  # Write TensorBoard scalars here; None: no TensorBoard.
    wandb_project: Optional[str] = None  # Log to this Weights & Biases project (the wandb extra); None: no wandb.
    # Megatron-LM's logging switches, to the log line and TensorBoard.
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False  # The count of zero gradient entries, each step.
    log_throughput: bool = False  # TFLOP/s per rank, from the model's analytic operation count.
    log_timers_to_tensorboard: bool = False  # Seconds of each phase of a step, to TensorBoard.
    log_memory_to_tensorboard: bool = False  # Memory statistics, to TensorBoard and the log line.
    log_validation_ppl_to_tensorboard: bool = False  # Validation perplexity beside the loss, to TensorBoard.


@dataclass
class LauncherConfig:
    # Local worker processes to start when not already under torchrun/srun (1 = this process).
    nproc: int = 1
    master_addr: str = "127.0.0.1"  # Address of rank 0's rendezvous for local workers.
    # 0: pick a free port.
    master_port: int = 0
    # auto (cuda if available) | cpu | cuda
    device: str = "auto"
    # Times the local workers are restarted after one fails (torchrun's --max-restarts). A
    # restarted job resumes from `checkpoint.load`.
    max_restarts: int = 0
    # After a pre-emption signal (SIGTERM, SIGINT, SIGUSR1), the seconds the job has to agree
    # on a step, save and exit before it is aborted (the last complete checkpoint stays).
    preempt_timeout_s: float = 120.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    # Names of registered plugins to switch on (see megatron_ext.plugin). Each registered plugin
    # with a config class also gets its own top-level section (`reshard.schedule=...`), added by
    # `store.config_schema()`.
    plugins: list[str] = field(default_factory=list)
