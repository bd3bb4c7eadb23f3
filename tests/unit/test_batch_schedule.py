"""The global batch of each step under Megatron-LM's --rampup-batch-size and
--step-batch-size-schedule: hand-worked tables of Megatron-LM's rules (the batch at a number of
consumed samples, the iterations a sample-based run trains), megatron-core's own configured
micro-batch calculator for the ramp, and the rules' refusals, each naming the flag typed."""

from __future__ import annotations

import shlex

import pytest

from megatron_ext.config.batch_sizes import parse_step_schedule, rampup_problems, step_schedule_problems
from megatron_ext.config.schema import TrainConfig
from megatron_ext.pretrain_gpt import main
from megatron_ext.training.batch_schedule import BatchSchedule

# name -> (schedule, seq_length, consumed samples -> global batch), worked by hand: thresholds
# are tokens, floor-divided by the sequence length.
STEP_CASES = {
    # Megatron-LM's gpt3 175B example: 2.4B tokens / 2048 = 1171875 samples, 4.8B: 2343750.
    "gpt3_175b": ("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048,
                  {0: 16, 1171874: 16, 1171875: 320, 2343749: 320, 2343750: 624, 5859375: 1536, 10**9: 1536}),
    "commas_and_lower_case": ("0:4,0.5k:8", 100, {0: 4, 4: 4, 5: 8, 100: 8}),
    "unsorted": ("256:4 0:2", 64, {0: 2, 3: 2, 4: 4}),
    # 100 tokens of 64 are one sample (floor).
    "floor": ("0:2 100:6", 64, {0: 2, 1: 6}),
    "batch_suffix": ("0:1K", 8, {0: 1000, 10**6: 1000}),
}

# name -> (start, increment, ramp samples, global batch, consumed samples -> global batch):
# (gbs - start) / increment increments, one per ramp_samples / increments samples (floored
# quotient), the full batch once the consumed samples pass the ramp.
RAMP_CASES = {
    # 2 increments of 6 samples each
    "two_steps": (2, 2, 12, 6, {0: 2, 5: 2, 6: 4, 11: 4, 12: 6, 13: 6, 1000: 6}),
    # Megatron-LM's gpt3 example (r0.16): 95 increments of 5859375 / 95 = 61677.6 samples
    "gpt3_175b_r016": (16, 16, 5859375, 1536, {0: 16, 61677: 16, 61678: 32, 123355: 32, 123356: 48, 5859375: 1536}),
    "one_step": (4, 4, 10, 8, {0: 4, 9: 4, 10: 8, 11: 8}),
}


@pytest.mark.parametrize("text, seq, expected", STEP_CASES.values(), ids=STEP_CASES.keys())
def test_step_schedule_batches(text, seq, expected):
    batches = BatchSchedule.of(TrainConfig(global_batch_size=None, step_batch_size_schedule=text), seq, 1)
    assert {consumed: batches.at(consumed) for consumed in expected} == expected


@pytest.mark.parametrize("start, increment, ramp, gbs, expected", RAMP_CASES.values(), ids=RAMP_CASES.keys())
def test_rampup_batches(start, increment, ramp, gbs, expected):
    batches = BatchSchedule.of(TrainConfig(global_batch_size=gbs, rampup_batch_size=[start, increment, ramp]), 64, gbs)
    assert {consumed: batches.at(consumed) for consumed in expected} == expected


@pytest.mark.parametrize("mbs, dp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("start, increment, ramp, gbs, expected", RAMP_CASES.values(), ids=RAMP_CASES.keys())
def test_rampup_equals_megatron_calculator(start, increment, ramp, gbs, expected, mbs, dp):
    """megatron-core's calculator configured as a run would configure it (its micro-batches
    times micro batch times dp) gives the schedule's batch at every consumed sample count."""
    from megatron.core import num_microbatches_calculator as calc

    if start % (mbs * dp) or increment % (mbs * dp):
        pytest.skip("the ramp's batches are not whole micro-batches per replica")
    batches = BatchSchedule.of(TrainConfig(global_batch_size=gbs, rampup_batch_size=[start, increment, ramp]), 64, gbs)
    calc.destroy_num_microbatches_calculator()  # megatron's global: set by any earlier trainer in this process
    calc.init_num_microbatches_calculator(0, [start, increment, ramp], gbs, mbs, dp)
    try:
        for consumed in sorted({*expected, *range(0, ramp + 2 * gbs, max(1, ramp // 50))}):
            calc.update_num_microbatches(consumed, consistency_check=True)
            assert calc.get_num_microbatches() * mbs * dp == batches.at(consumed), consumed
    finally:
        calc.destroy_num_microbatches_calculator()


# name -> (train config fields, seq_length, train samples, iterations), counted by hand as
# Megatron-LM's update_train_iters counts them.
ITERS_CASES = {
    "constant_drops_partial_batch": (dict(global_batch_size=4), 64, 10, 2),
    # batches 2 2 4 4 -> 12 samples: the last step passes the 10
    "step_schedule_passes_the_samples": (dict(global_batch_size=None, step_batch_size_schedule="0:2 256:4"), 64, 10, 4),
    "step_schedule_exact": (dict(global_batch_size=None, step_batch_size_schedule="0:2 256:4"), 64, 12, 4),
    # ramp steps 2 2 2 4 4 (14 samples consumed > 12), then (40 - 14) // 6 = 4
    "ramp_then_constant": (dict(global_batch_size=6, rampup_batch_size=[2, 2, 12]), 64, 40, 9),
    # the ramp loop stops once 6 > 5 samples: 3 steps
    "ramp_longer_than_run": (dict(global_batch_size=6, rampup_batch_size=[2, 2, 12]), 64, 5, 3),
}


@pytest.mark.parametrize("fields, seq, samples, iters", ITERS_CASES.values(), ids=ITERS_CASES.keys())
def test_train_iters(fields, seq, samples, iters):
    train = TrainConfig(**fields)
    batches = BatchSchedule.of(train, seq, train.global_batch_size or 1)
    assert batches.train_iters(samples) == iters
    # the samples of those iterations: the sum of their batches
    consumed = 0
    for _ in range(iters):
        consumed += batches.at(consumed)
    assert batches.samples(iters) == consumed


# name -> (schedule, seq_length, what the problem says)
BAD_STEP_SCHEDULES = {
    "no_colon": ("0:2 256", 64, 'entry "256" is not THRESHOLD:BATCH_SIZE'),
    "not_a_number": ("0:2 x:4", 64, 'entry "x:4": THRESHOLD and BATCH_SIZE are numbers'),
    "empty": ("  ", 64, "needs at least one"),
    "first_not_zero": ("64:2", 64, "the first threshold must be 0, got 1 samples"),
    # 10 tokens are 0 samples of 64: two entries at 0
    "thresholds_collide_in_samples": ("0:2 10:4", 64, "strictly increasing in samples"),
    "zero_batch": ("0:0", 64, "batch sizes must be positive, got 0"),
    "decreasing": ("0:4 256:2", 64, "batch sizes must not decrease, got 4 then 2"),
}


@pytest.mark.parametrize("text, seq, phrase", BAD_STEP_SCHEDULES.values(), ids=BAD_STEP_SCHEDULES.keys())
def test_bad_step_schedules(text, seq, phrase):
    try:
        problems = step_schedule_problems(parse_step_schedule(text, seq))
    except ValueError as e:
        problems = [str(e)]
    assert any(phrase in p for p in problems), problems


BAD_RAMPS = {
    "zero_increment": ([2, 0, 10], 6, "the increment must be positive, got 0"),
    "zero_samples": ([2, 2, 0], 6, "the ramp-up samples must be positive, got 0"),
    "start_at_global": ([6, 2, 10], 6, "the start batch size (6) must be below the global batch size (6)"),
    "uneven_increments": ([2, 3, 10], 6, "(6 - 2) must be divisible by the increment (3)"),
}


@pytest.mark.parametrize("rampup, gbs, phrase", BAD_RAMPS.values(), ids=BAD_RAMPS.keys())
def test_bad_ramps(rampup, gbs, phrase):
    assert any(phrase in p for p in rampup_problems(rampup, gbs))


MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"
# name -> (command line, the error line)
BAD_COMMAND_LINES = {
    "rampup_with_iterations": (
        "--global-batch-size 6 --rampup-batch-size 2 2 12 --train-iters 10",
        "error: --rampup-batch-size 2 2 12 (train.rampup_batch_size): a ramp needs a sample-based run "
        "(train.train_samples), as in Megatron-LM",
    ),
    "global_batch_not_the_last": (
        '--global-batch-size 8 --step-batch-size-schedule "0:2 256:4" --train-iters 10',
        "error: --step-batch-size-schedule 0:2 256:4 (train.step_batch_size_schedule): train.global_batch_size (8) "
        "must be unset or the schedule's last batch size (4)",
    ),
    "batch_not_whole_micro_batches": (
        '--micro-batch-size 2 --step-batch-size-schedule "0:2 256:3 512:6" --train-iters 10',
        "error: --step-batch-size-schedule 0:2 256:3 512:6 (train.step_batch_size_schedule): its global batch "
        "sizes 3 must be divisible by train.micro_batch_size * dp (2 * 1) = 2",
    ),
    "both_schedules": (
        '--global-batch-size 6 --rampup-batch-size 2 2 12 --step-batch-size-schedule "0:6" --train-samples 40',
        "error: --rampup-batch-size 2 2 12 (train.rampup_batch_size): train.rampup_batch_size and "
        "train.step_batch_size_schedule are exclusive: one batch-size schedule",
    ),
    "rampup_rule": (
        "--global-batch-size 6 --rampup-batch-size 2 3 12 --train-samples 40",
        "error: --rampup-batch-size 2 3 12 (train.rampup_batch_size): the global batch size minus the start "
        "(6 - 2) must be divisible by the increment (3)",
    ),
}


@pytest.mark.parametrize("command, line", BAD_COMMAND_LINES.values(), ids=BAD_COMMAND_LINES.keys())
def test_rule_errors_name_the_flag(command, line, capsys):
    with pytest.raises(SystemExit) as info:
        main(shlex.split(f"{MODEL} {command}"))
    assert info.value.code == 2
    assert line in capsys.readouterr().err.splitlines()


# name -> (plugin config overrides, what its refusal says)
PLUGINS = {
    "lora": ("lora", "lora trains each job at one global batch"),
    "dpp": ("dpp", "dpp plans its own global batches of whole documents"),
    "reshard": ("reshard", "reshard moves runs of one global batch"),
}


@pytest.mark.parametrize("plugin, phrase", PLUGINS.values(), ids=PLUGINS.keys())
@pytest.mark.parametrize("schedule", ["--rampup-batch-size 2 2 12", '--step-batch-size-schedule "0:2 256:4"'])
def test_plugins_that_assume_one_batch_refuse_a_schedule(plugin, phrase, schedule, capsys):
    command = f"{MODEL} --micro-batch-size 1 --global-batch-size 4 --train-samples 40 {schedule} plugin={plugin}"
    with pytest.raises(SystemExit) as info:
        main(shlex.split(command))
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {schedule.split()[0]}") and phrase in line, line
