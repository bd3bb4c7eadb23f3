"""Packed LoRA training on two data-parallel gloo ranks gives every adapter the update it gets on
one rank with the same global batches: each rank trains half of each job's micro-batches and
the adapter gradients are summed over the ranks (the frozen base has none). Jobs differ in
accumulation, batch, rank, targets, dropout, clipping and schedule; three jobs pass through two
slots. A second DP=2 run caps a pass's tokens, so ranks split their steps into passes (and
still reduce once a step): it too must give the DP=1 update. A third does so on conversations
of varying lengths (data/sft's, one a sample, each micro-batch padded to its longest), so the
two ranks' micro-batches of a step differ in length: they must still split the step alike.

fp64 models; the two runs group the same samples into different GEMMs and sum the gradients in
another order, so they agree to rounding, not bitwise. A rank that trains the wrong half, a
missing or doubled reduction, or a wrong normalisation is off by O(1).

Its worker runs in the two-rank launch it shares with test_lora_concurrent (_lora_two_ranks.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_lora_packed import max_diff, train  # noqa: E402

from megatron_ext.data.sft.dataset import Conversations  # noqa: E402
from megatron_ext.lora.job import LoraJob  # noqa: E402
from megatron_ext.lora.runtime.batching import ConversationData, SyntheticData  # noqa: E402

JOBS = [
    LoraJob("a", rank=4, lr=1e-2, weight_decay=0.1, steps=3, micro_batch_size=1, global_batch_size=2, seq_length=16, dropout=0.1),
    LoraJob("b", rank=8, lr=3e-2, steps=2, micro_batch_size=2, global_batch_size=4, seq_length=12, seed=5,
            target_modules=("linear_qkv", "linear_fc2"), clip_grad=0.05),
    LoraJob("c", rank=2, lr=2e-2, steps=2, micro_batch_size=1, global_batch_size=4, seq_length=16, seed=9,
            lr_decay_style="cosine", lr_warmup_steps=1),
]
REL_TOL = 1e-9


def conversations(job: LoraJob, vocab: int) -> ConversationData:
    """24 conversations of 4 to 17 random tokens, the second half of each the assistant's; 20 to
    train on, 4 to validate on."""
    generator = numpy.random.default_rng(0)
    lengths = generator.integers(4, 18, size=24)
    assistant = numpy.concatenate([numpy.arange(n) >= n // 2 for n in lengths])
    data = Conversations(generator.integers(0, vocab, size=int(lengths.sum())), assistant,
                         numpy.concatenate([[0], numpy.cumsum(lengths)]), [f"random:{i}" for i in range(24)])
    return ConversationData(job, data, [list(range(20))], [1.0], list(range(20, 24)), pad=0)


# name -> the DP=2 run's cap on a pass's tokens and its data: per rank a, b, c hold at most 16,
# 24, 16 tokens, so a and b train in passes of their own, a and c in one.
CAPS = {"uncapped": (None, SyntheticData), "capped": (32, SyntheticData), "capped-conversations": (32, conversations)}


def worker(out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.models.convert.world import model_parallel_world

    with model_parallel_world(tp=1):
        assert parallel_state.get_data_parallel_world_size() == 2
        for name, (cap, data) in CAPS.items():
            weights, results, before, after = train(JOBS, capacity=2, dtype=torch.float64, data=data, max_pass_tokens=cap)
            assert all(torch.equal(before[k], after[k]) for k in before)
            if dist.get_rank() == 0:
                torch.save({"weights": weights, "results": results}, Path(out) / f"dp2-{name}.pt")


if __name__ == "__main__":
    worker(*sys.argv[1:])


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CAPS))
def test_dp2_equals_dp1_for_every_adapter(one_rank_world, tmp_path_factory, name):
    from _lora_two_ranks import outputs  # the launch test_lora_concurrent shares: one startup for both

    dp2 = torch.load(outputs(tmp_path_factory) / "dp" / f"dp2-{name}.pt", weights_only=False)
    dp1, results, _, _ = train(JOBS, capacity=2, dtype=torch.float64, data=CAPS[name][1])
    for job in JOBS:
        one, two = results[job.name], dp2["results"][job.name]
        assert one.status == two.status == "done" and one.steps == two.steps == job.steps
        assert one.tokens == two.tokens
        torch.testing.assert_close(two.losses, one.losses, rtol=REL_TOL, atol=0)
        torch.testing.assert_close(two.eval_losses, one.eval_losses, rtol=REL_TOL, atol=0)
        scale = max(w.abs().max().item() for pair in dp1[job.name].values() for w in pair)
        assert scale > 1e-3, job.name
        assert max_diff(dp2["weights"][job.name], dp1[job.name]) <= REL_TOL * scale, job.name
