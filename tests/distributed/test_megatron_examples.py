"""Megatron-LM's own example launch commands through `python -m megatron_ext.pretrain_gpt`.

Each case is the flag list of one script under Megatron-LM's examples/ (its default branch:
mock data where the script defaults to it, no W&B, no profiler wrapper), or the MODEL_ARGS of
one of its functional test cases, written out here with the sizes shrunk (layers, hidden,
heads, experts, seq, iterations or samples, batches, the vocabulary of NullTokenizer, parallel
sizes to at most two ranks except a test case's TP=2 x PP=2, and the save/eval/log intervals
to the shrunk iteration count) and the data, tokenizer and output paths pointed at
local files; every other flag is as the script has it. Each case trains, saves, resumes from
its checkpoint with more iterations, and exits 0 both times.

The modelopt cases are the model flags of conf/<model>.sh with the parallel flags that
conf/arguments.sh defaults to (as finetune.sh passes them), plus a pretraining data, schedule
and checkpoint set (pretrain_gpt has no --finetune-hf-dataset).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORDS = (
    "the quick brown fox jumps over the lazy dog while five boxing wizards jump quickly and "
    "a wizard's job is to vex chumps quickly in fog; pack my box with five dozen liquor jugs"
).split()
DOCUMENTS = 15_000


@pytest.fixture(scope="module")
def local_files(tmp_path_factory) -> dict[str, str]:
    """A BPE tokenizer.json (and its vocab.json / merges.txt), an indexed dataset made with it,
    and a data cache shared by the cases."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_ext.data import build_tokenizer
    from megatron_ext.data.preprocess import build_indexed_dataset

    root = tmp_path_factory.mktemp("megatron_examples")
    # Enough documents that mixtral's split 99990,8,2 leaves its valid split one.
    documents = [" ".join(WORDS[(7 * i) % len(WORDS):] + WORDS[: (7 * i) % len(WORDS)])
                 for i in range(DOCUMENTS)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(documents, trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    tok_dir = root / "tokenizer"
    tok_dir.mkdir()
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    tokenizer.model.save(str(tok_dir))  # vocab.json, merges.txt (GPT-2's --vocab-file/--merge-file)
    data = build_indexed_dataset(
        documents, build_tokenizer(str(tok_dir / "tokenizer.json")), str(root / "data" / "text_document")
    )
    chat = root / "chat.jsonl"  # conversations for --sft: a question and its answer from the words
    chat.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"Say words {i} to {i + 5}."},
                                 {"role": "assistant", "content": " ".join(WORDS[i % 30: i % 30 + 6])}]}) + "\n"
        for i in range(200)
    ))
    return {
        "tok": str(tok_dir / "tokenizer.json"), "tok_dir": str(tok_dir), "chat": str(chat),
        "vocab": str(tok_dir / "vocab.json"), "merges": str(tok_dir / "merges.txt"),
        "data": data, "cache": str(root / "cache"),
    }


@dataclass(frozen=True)
class Example:
    name: str
    # Megatron-LM's script the flags come from.
    source: str
    # The flags, with {data} {tok} {tok_dir} {vocab} {merges} {cache} {ckpt} {tb} paths and
    # {iters} / {samples} (train_samples = iterations * global batch) filled in per run.
    flags: str
    nproc: int = 1
    global_batch: int = 4
    # The global batch of each step of the resumed run (iterations 3 and 4), where a batch-size
    # schedule sets it; empty: not checked.
    resumed_batches: tuple[int, ...] = ()
    # What megatron_ext still lacks for this command line to run; empty: it runs. A case with
    # needs is a strict xfail, so it fails as soon as it passes and its needs must be cleared.
    needs: str = ""


GPT3_175B = Example(
    "gpt3_175b", "examples/gpt3/train_gpt3_175b_distributed.sh",
    """
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
    --max-position-embeddings 64 --attention-backend auto
    --micro-batch-size 1 --global-batch-size 6
    --step-batch-size-schedule "0:1 0.128K:2 0.256K:3 0.384K:4 0.512K:5 0.64K:6"
    --train-iters {iters} --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
    --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters {iters}
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    --data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
    --log-interval 1 --save-interval 2 --eval-interval 2 --save {ckpt} --load {ckpt}
    --eval-iters 1 --tensorboard-dir {tb}
    """,
    nproc=2,
    # thresholds 2, 4, 6, 8, 10 samples of 64 tokens: batches 1, 1, 2, 3
    resumed_batches=(2, 3),
)

_LLAMA3_MODEL = """
    --use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224
    --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16
    --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope
    --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
    --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
    --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
"""
_LLAMA3_FP8 = "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather"
_LLAMA3_MOCK_DATA = """
    --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --data-cache-path {cache}
    --tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files --num-workers 1
"""

LLAMA3_8B_FP8 = Example(
    "llama3_8b_fp8", "examples/llama/train_llama3_8b_h100_fp8.sh",
    _LLAMA3_MODEL + """
    --micro-batch-size 1 --global-batch-size 4 --train-samples {samples}
    --lr-decay-samples {samples} --lr-warmup-samples 4 --lr 0.00015 --min-lr 0.00001
    --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
    --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    """ + _LLAMA3_FP8 + """
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
    """ + _LLAMA3_MOCK_DATA + """
    --log-interval 1 --eval-iters 1 --eval-interval 2 --save-interval 2 --log-throughput
    --profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
    --distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} --tensorboard-dir {tb}
    """,
)

LLAMA3_8B_FSDP_FP8 = Example(
    "llama3_8b_fsdp_fp8", "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
    _LLAMA3_MODEL + """
    --micro-batch-size 1 --global-batch-size 4 --train-samples {samples}
    --lr-decay-samples {samples} --lr-warmup-samples 4 --lr 0.00015 --min-lr 0.00001
    --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion
    --no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
    --no-gradient-accumulation-fusion --calculate-per-token-loss --init-model-with-meta-device
    --ckpt-format fsdp_dtensor --use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    """ + _LLAMA3_FP8 + """
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
    """ + _LLAMA3_MOCK_DATA + """
    --log-interval 1 --eval-iters 1 --eval-interval 2 --save-interval 2 --log-throughput
    --logging-level 20 --distributed-timeout-minutes 60 --save {ckpt} --load {ckpt}
    --tensorboard-dir {tb}
    """,
    nproc=2,
)

MIXTRAL_8X7B = Example(
    "mixtral_8x7b", "examples/mixtral/train_mixtral_8x7b_distributed.sh",
    """
    --use-mcore-models --disable-bias-linear --seq-length 64 --max-position-embeddings 128
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4
    --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0
    --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2
    --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
    --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --overlap-param-gather --overlap-grad-reduce
    --tokenizer-type Llama2Tokenizer --tokenizer-model {tok_dir} --data-path {data}
    --split 99990,8,2
    --micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters {iters}
    --lr-decay-iters {iters} --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
    --lr-warmup-iters 1 --clip-grad 1.0 --bf16
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --expert-model-parallel-size 2 --use-distributed-optimizer --sequence-parallel
    --log-interval 1 --save-interval 2 --eval-interval 2 --eval-iters 1 --save {ckpt}
    --load {ckpt} --tensorboard-dir {tb} --no-load-optim --no-load-rng
    """,
    nproc=2,
)

DEEPSEEK_V3 = Example(
    "deepseek_v3", "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
    """
    --distributed-timeout-minutes 60 --tensor-model-parallel-size 1
    --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --context-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --use-mcore-models
    --sequence-parallel --use-flash-attn --disable-bias-linear --micro-batch-size 1
    --global-batch-size 4 --train-samples {samples} --exit-duration-in-mins 220
    --no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10
    --recompute-granularity selective --recompute-modules mlp moe mla_up_proj layernorm
    --transformer-impl transformer_engine --seq-length 64 --data-cache-path {cache}
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tok} --data-path {data}
    --split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --kv-channels 16 --max-position-embeddings 64 --position-embedding-type rope
    --rotary-base 10000 --make-vocab-size-divisible-by 64 --normalization RMSNorm
    --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention
    --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1
    --qk-layernorm --lr-decay-samples {samples} --lr-warmup-samples 4 --lr-warmup-init 3.9e-7
    --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
    --num-experts 4 --moe-layer-freq [0]*1+[1]*1 --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32 --moe-router-load-balancing-type seq_aux_loss
    --moe-router-topk 2 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep
    --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
    --moe-router-group-topk 2 --moe-router-num-groups 2 --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
    --moe-router-force-load-balancing --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16
    --qk-pos-emb-head-dim 8 --v-head-dim 16 --rotary-scaling-factor 40 --mscale 1.0
    --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 1
    --eval-interval 2 --auto-detect-ckpt-format --load {ckpt} --save {ckpt} --save-interval 2
    --dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard
    --log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
    --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40
    --tensorboard-dir {tb} --bf16 --enable-experimental
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
    --no-gradient-accumulation-fusion --use-distributed-optimizer --calculate-per-token-loss
    --init-model-with-meta-device --ckpt-format fsdp_dtensor --fsdp-double-buffer --use-nccl-ub
    --megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16
    """,
    nproc=2,
)

GPT_OSS = Example(
    "gpt_oss", "examples/gptoss/02_train.sh",
    """
    --no-masked-softmax-fusion --transformer-impl transformer_engine --disable-bias-linear
    --untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8
    --group-query-attention --num-query-groups 2 --seq-length 64 --max-position-embeddings 64
    --use-mcore-models --rotary-percent 1.0 --rope-type rope --position-embedding-type rope
    --rotary-base 10000 --no-bias-gelu-fusion --export-force-local-attention
    --no-bias-dropout-fusion --quick-geglu --glu-linear-offset 1.0 --softmax-type learnable
    --window-attn-skip-freq 2 --activation-func-clamp-value 7.0 --window-size 15,0
    --enable-gpt-oss
    --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --overlap-param-gather --overlap-grad-reduce --moe-ffn-hidden-size 128
    --moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 --moe-permute-fusion
    """ + _LLAMA3_MOCK_DATA + """
    --micro-batch-size 1 --global-batch-size 4 --lr 1.0e-5 --train-samples {samples}
    --lr-decay-samples {samples} --lr-decay-style cosine --min-lr 1.0e-6 --weight-decay 0.1
    --lr-warmup-fraction 0.05 --clip-grad 1.0 --bf16 --use-flash-attn
    --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32
    --disable-bf16-reduced-precision-matmul --recompute-activations
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    --expert-model-parallel-size 1 --sequence-parallel --context-parallel-size 1
    --use-distributed-optimizer --fp8-format hybrid --fp8-param-gather
    --fp8-amax-compute-algo max --fp8-amax-history-len 1024
    --log-interval 1 --save-interval 2 --eval-interval 50000000 --eval-iters 0 --save {ckpt}
    --load {ckpt} --tensorboard-dir {tb} --moe-per-layer-logging --no-load-optim --no-load-rng
    --log-throughput
    """,
    nproc=2,
)

# Megatron-LM's functional test of multi-latent attention at TP=2 x PP=2 (its MODEL_ARGS).
GPT3_TP2_PP2_MLA = Example(
    "gpt3_tp2_pp2_mla", "tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp2_mla/model_config.yaml",
    """
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --multi-latent-attention
    --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
    --log-params-norm --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard
    --log-timers-to-tensorboard --tensorboard-dir {tb} --micro-batch-size 1
    --global-batch-size 4 --seq-length 64 --max-position-embeddings 64 --train-iters {iters}
    --timing-log-level 0 --lr-decay-iters 320000 --save {ckpt} --load {ckpt} --data-path {data}
    --vocab-file {vocab} --merge-file {merges} --split 949,50,1 --distributed-backend nccl
    --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
    --lr-warmup-fraction .01 --log-interval 1 --save-interval 2 --eval-interval 2
    --eval-iters 1 --transformer-impl transformer_engine --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2 --sequence-parallel --untie-embeddings-and-output-weights
    --deterministic-mode --no-gradient-accumulation-fusion --attention-softmax-in-fp32
    --use-mcore-models --ckpt-format torch_dist --data-cache-path {cache} --bf16
    --attention-backend unfused --log-memory-to-tensorboard
    """,
    nproc=4,
)

_MODELOPT_LAUNCH = """
    --tensor-model-parallel-size 1 --expert-tensor-parallel-size 1 --expert-model-parallel-size 1
    --pipeline-model-parallel-size 1 --context-parallel-size 1 --cp-comm-type p2p
    --tokenizer-model {tok_dir}
    --data-path {data} --split 99,1,0 --global-batch-size 2 --train-iters {iters} --lr 1e-4
    --eval-iters 1 --eval-interval 2 --log-interval 1 --save {ckpt} --load {ckpt}
"""

# conf/meta-llama/Llama-3.2-1B-Instruct.sh's MODEL_ARGS, shrunk.
_LLAMA32_1B_MODEL = """
    --save-interval 2 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --use-rotary-position-embeddings --no-rope-fusion
    --no-position-embedding --normalization RMSNorm --swiglu --num-layers 2 --hidden-size 64
    --ffn-hidden-size 256 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --seq-length 64 --max-position-embeddings 128 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 1 --use-mcore-models --rotary-percent 1.0
    --rotary-base 500000 --use-rope-scaling
"""

LLAMA32_1B = Example(
    "modelopt_llama32_1b", "examples/post_training/modelopt/conf/meta-llama/Llama-3.2-1B-Instruct.sh",
    _LLAMA32_1B_MODEL + _MODELOPT_LAUNCH,
    global_batch=2,
)

QWEN3_06B = Example(
    "modelopt_qwen3_06b", "examples/post_training/modelopt/conf/Qwen/Qwen3-0.6B.sh",
    """
    --save-interval 2 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --position-embedding-type rope --no-rope-fusion
    --normalization RMSNorm --swiglu --num-layers 2 --hidden-size 64 --ffn-hidden-size 192
    --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 32
    --qk-layernorm --seq-length 64 --max-position-embeddings 640
    --tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 1187
    --use-mcore-models --rotary-percent 1.0 --rotary-base 1000000 --no-bias-swiglu-fusion
    """ + _MODELOPT_LAUNCH,
    global_batch=2,
)

# finetune.sh's training and optimizer flags on Llama-3.2-1B's, its data as --sft conversations
# (finetune.sh reads a hub dataset: --finetune-hf-dataset is refused). Left out: ModelOpt's own
# --export-te-mcore-model (refused with its reason), and --finetune and --auto-detect-ckpt-format,
# which start from the converted base model (the resume below is the test).
LLAMA32_1B_SFT = Example(
    "modelopt_llama32_1b_sft", "examples/post_training/modelopt/finetune.sh",
    _LLAMA32_1B_MODEL + """
    --distributed-timeout-minutes 30
    --no-gradient-accumulation-fusion --reset-position-ids --reset-attention-mask --eod-mask-loss
    --attention-dropout 0.0 --hidden-dropout 0.0 --no-check-for-nan-in-loss-and-grad
    --lr 5.0e-5 --min-lr 1.0e-7 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.0
    --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.010 --use-distributed-optimizer
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --tokenizer-model {tok_dir}
    --sft --sft-tokenizer-prompt-format chatml --data-path {chat} --split 95,5,0
    --global-batch-size 2 --train-iters {iters} --eval-iters 1 --eval-interval 2 --log-interval 1
    --save {ckpt} --load {ckpt} --data-cache-path {cache}
    """,
    global_batch=2,
)

EXAMPLES = [GPT3_175B, LLAMA3_8B_FP8, LLAMA3_8B_FSDP_FP8, MIXTRAL_8X7B, DEEPSEEK_V3, GPT_OSS,
            GPT3_TP2_PP2_MLA, LLAMA32_1B, QWEN3_06B, LLAMA32_1B_SFT]


def _run(example: Example, files: dict[str, str], out: Path, iters: int) -> subprocess.CompletedProcess:
    paths = {**files, "ckpt": str(out / "ckpt"), "tb": str(out / "tb"), "iters": iters,
             "samples": iters * example.global_batch}
    flags = shlex.split(example.flags.format(**paths))
    cmd = [sys.executable, "-m", "megatron_ext.pretrain_gpt", *flags, "--nproc", str(example.nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _saved_iteration(ckpt: Path) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


# One-rank examples outside the default suite as well: its time budget keeps one of each kind.
SLOW_ONE_RANK = {"llama3_8b_fp8", "modelopt_qwen3_06b", "modelopt_llama32_1b_sft"}


def _marks(example: Example) -> list:
    # One-rank cases are in the default suite; the two-rank ones take minutes together.
    marks = [pytest.mark.slow] if example.nproc > 1 or example.name in SLOW_ONE_RANK else []
    if example.needs:
        marks.append(pytest.mark.xfail(strict=True, reason=example.needs))
    return marks


@pytest.mark.parametrize(
    "example", [pytest.param(e, marks=_marks(e)) for e in EXAMPLES], ids=[e.name for e in EXAMPLES]
)
def test_megatron_example_trains_saves_and_resumes(example, local_files, tmp_path):
    first = _run(example, local_files, tmp_path, iters=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _saved_iteration(tmp_path / "ckpt") == 2
    second = _run(example, local_files, tmp_path, iters=4)
    assert second.returncode == 0, second.stderr[-3000:]
    assert _saved_iteration(tmp_path / "ckpt") == 4
    logged = re.findall(r"iter\s+(\d+)/4", second.stdout + second.stderr)
    assert logged and int(logged[0]) == 3, "the second run did not resume at iteration 3"
    if example.resumed_batches:
        batches = re.findall(r"iter\s+\d+/4 .*\| global batch (\d+)", second.stdout)
        assert tuple(map(int, batches)) == example.resumed_batches
