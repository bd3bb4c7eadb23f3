"""Live reshard of a running job: the loss curve continues as if the layout had never changed,
also when workers join from standby or leave, and a reshard that fails part-way (an exception,
also while workers join; a killed worker) loses no state.

Every layout computes the same per-token loss from the same weights and batches, so a run that
switches layouts mid-way must follow the uninterrupted run (fp32 reduction order aside). That
needs every parameter, Adam moment and the step moved exactly, and the scheduler, counters and
data position carried over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.train import run_from_overrides

pytestmark = pytest.mark.distributed

ITERS = 8
COMMON = [
    "experiment=none",
    f"train.iters={ITERS}",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "launcher.nproc=4",
    "plugins=[reshard]",
]
LOSS_ATOL = 2e-4


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return f"data.cache_dir={tmp_path_factory.mktemp('cache')}"


@pytest.fixture(scope="module")
def uninterrupted(cache) -> list[float]:
    return run_from_overrides([*COMMON, cache, "parallel.tp=2", "parallel.pp=2"])["losses"]


def test_scheduled_reshards_follow_the_uninterrupted_run(uninterrupted, cache, tmp_path):
    # The second move also enters context parallelism (each rank then holds half of each sequence).
    schedule = "[{step: 3, layout: {tp: 1, pp: 2, dp: 2}}, {step: 6, layout: {tp: 2, pp: 1, cp: 2, dp: 1}}]"
    summary = run_from_overrides(
        [*COMMON, cache, "parallel.tp=2", "parallel.pp=2", f"reshard.schedule={schedule}",
         "reshard.memory_budget_mb=0.05", f"checkpoint.save={tmp_path}"]
    )
    assert summary["losses"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)
    # The final checkpoint is written in the last layout and resumes there.
    resumed = run_from_overrides(
        [*COMMON[:-1], cache, "parallel.tp=2", "parallel.cp=2", f"checkpoint.load={tmp_path}",
         f"train.iters={ITERS + 1}"]
    )
    assert len(resumed["losses"]) == 1


@pytest.mark.parametrize("prebuild", [True, False], ids=["built_ahead", "built_at_the_switch"])
def test_workers_join_from_standby_and_leave_again(uninterrupted, cache, tmp_path, prebuild):
    # 2 of the 4 workers train at first; all 4 from step 3 (in another layout); 2 from step 6.
    # Built ahead: the new world and the joining workers' trainers, a step before the move (the
    # learning rate decays every step: the joining trainers' scheduler must be the job's then).
    schedule = "[{step: 3, layout: {tp: 2, pp: 2, dp: 1}}, {step: 6, layout: {tp: 1, pp: 1, dp: 2}}]"
    reports = tmp_path / "moves.jsonl"
    summary = run_from_overrides(
        [*COMMON, cache, "parallel.dp=2", f"reshard.schedule={schedule}", f"reshard.report_file={reports}",
         f"reshard.prebuild={str(prebuild).lower()}", "reshard.prepare_steps_ahead=1"]
    )
    moves = [n for n in summary["notes"] if "reshard" in n]
    assert "tp1·pp1·dp2·+2 standby -> tp2·pp2·dp1:" in moves[0]
    assert "tp2·pp2·dp1 -> tp1·pp1·dp2·+2 standby:" in moves[1]
    assert summary["losses"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)
    recorded = [json.loads(line) for line in reports.read_text().splitlines()]
    assert [(r["step"], r["source"], r["target"], r["built_ahead"]) for r in recorded] == [
        (3, "tp1·pp1·dp2·+2 standby", "tp2·pp2·dp1", prebuild),
        (6, "tp2·pp2·dp1", "tp1·pp1·dp2·+2 standby", prebuild),
    ]
    for r in recorded:  # where each stall went, in the order of a pool move
        assert list(r["stall_parts"]) == ["prepare", "agree", "leave", "switch", "transfer", "finish"]
        assert sum(r["stall_parts"].values()) == pytest.approx(r["stall_seconds"])


# --- faults: a reshard that fails part-way loses nothing ---------------------------------------

FAULTS = Path(__file__).parents[1] / "faults" / "_faults.py"
SWITCH_AT_5 = "reshard.schedule=[{step: 5, layout: {tp: 1, pp: 2, dp: 2}}]"


def run_with_fault(tmp_path, *overrides: str) -> dict:
    """A run of COMMON with the `fault` plugin first, in a child process (it registers the
    plugin before the config is composed)."""
    return run_script(FAULTS, tmp_path, "plugins=[fault,reshard]", *overrides)


def run_script(script: Path, tmp_path, plugins: str, *overrides: str, common: tuple = tuple(COMMON[:-1])) -> dict:
    """A run of `common` with `plugins` through `script`, which registers a test plugin and
    writes the run's summary."""
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(script), str(out), *common, plugins, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(FAULTS.parents[2])}
    # A killed worker's job runs twice (the launcher restarts it): allow for a busy machine.
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_exception_mid_transfer_rolls_back_and_training_goes_on(uninterrupted, cache, tmp_path):
    # Asked for through the request file (polled, agreed on by every rank, renamed when taken).
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"layout": {"tp": 1, "pp": 1}}))  # dp derived: 4
    summary = run_with_fault(
        tmp_path, cache, "parallel.tp=2", "parallel.pp=2", f"reshard.request_file={request}",
        "fault.kind=raise",
    )
    assert not request.exists() and (tmp_path / "request.json.done").exists()
    accepted, failed = [n for n in summary["notes"] if "reshard" in n]
    assert "reshard request to {'tp': 1, 'pp': 1} accepted" in accepted
    assert "rank 1: RuntimeError: injected fault" in failed and "rolled back to tp2" in failed
    # Back in the old layout from the untouched old state: the very same losses.
    assert summary["losses"] == uninterrupted


@pytest.mark.slow  # the suite's time; the rollback itself runs in the default suite (mid-transfer)
def test_exception_while_workers_join_rolls_back_and_training_goes_on(uninterrupted, cache, tmp_path):
    # 2 of the 4 workers train; at step 3 all 4 should (another world), but joining rank 3 fails
    # mid-transfer: the 2 go back to their old world and state, the 2 others back to standby.
    summary = run_with_fault(
        tmp_path, cache, "parallel.dp=2", "reshard.schedule=[{step: 3, layout: {dp: 4}}]",
        "fault.kind=raise", "fault.rank=3",
    )
    failed = [n for n in summary["notes"] if "reshard" in n]
    assert len(failed) == 1 and "rank 3: RuntimeError: injected fault" in failed[0], failed
    assert "rolled back to tp1·pp1·dp2·+2 standby" in failed[0]
    assert summary["losses"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)


# --- request files: nothing in one stops the job or meets a restart again -------------------------

REQUEST_WRITER = Path(__file__).with_name("_request_writer.py")
# What the request file holds before each step (one request per step), and the log's words for
# it: five that cannot be taken (renamed aside), then a valid one, which must still apply exactly.
POISONED_REQUESTS = [
    ("\x00\x9f{garbage", "is not valid JSON"),
    ('{"Layout": {"tp": 1}}', "unknown key(s) ['Layout']"),
    ('{"layout": null}', "'layout' is null"),
    ('{"layout": {"tp": "one"}}', 'layout.tp must be a positive integer, got "one"'),
    ('{"layout": {"tp": 2, "pp": 2}}', None),  # the layout it runs: already there
]


def test_poisoned_request_files_are_refused_renamed_and_a_valid_one_still_applies(cache, tmp_path):
    # 12 steps: the valid request (step 6) is planned in the background for as many steps as a
    # busy machine needs; the reference is the uninterrupted run of as many steps.
    common = [o for o in COMMON[:-1] if not o.startswith("train.iters=")] + ["train.iters=12"]
    uninterrupted = run_from_overrides([*common, cache, "parallel.tp=2", "parallel.pp=2"])["losses"]
    request, cases = tmp_path / "request.json", tmp_path / "cases.json"
    texts = [text for text, _ in POISONED_REQUESTS] + ['{"layout": {"tp": 1, "pp": 2}}']
    cases.write_text(json.dumps(texts))
    summary = run_script(
        REQUEST_WRITER, tmp_path, "plugins=[requests,reshard]", cache, "parallel.tp=2", "parallel.pp=2",
        f"reshard.request_file={request}", f"requests.file={request}", f"requests.cases={cases}", common=tuple(common),
    )
    notes = [n for n in summary["notes"] if "reshard" in n]
    rejected = [f"{request}.rejected"] + [f"{request}.rejected.{k}" for k in (1, 2, 3)]
    for step, ((text, problem), note) in enumerate(zip(POISONED_REQUESTS, notes), start=1):
        if problem is None:
            assert note == f"step {step}: reshard request for {{'tp': 2, 'pp': 2}} in {request}: already there, no move"
            continue
        name = rejected[step - 1]
        assert note.startswith(f"step {step}: reshard request refused: {request}: ") and problem in note, note
        assert note.endswith(f"; renamed to {name}") and (tmp_path / name).read_bytes() == text.encode("latin-1")
    assert "step 6: reshard request to {'tp': 1, 'pp': 2} accepted" in notes[5]
    assert len([n for n in notes[6:] if "reshard tp2·pp2·dp1 -> tp1·pp2·dp2" in n]) == 1, notes
    assert not request.exists() and sorted(p.name for p in tmp_path.glob("request.json.*")) == sorted(
        [Path(n).name for n in rejected] + ["request.json.done"]
    )
    assert summary["losses"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)


BUILD_AHEAD_FAULTS = [
    # TP2×PP2 -> TP1×PP2×DP2: rank 1's optimizer of the new layout, in the background thread
    # (ranks reach the build at different times: each plans its own part of the move first).
    pytest.param(["parallel.tp=2", "parallel.pp=2", SWITCH_AT_5, "fault.kind=raise_ahead", "fault.rank=1"],
                 (5, "tp1·pp2·dp2"), id="same_workers"),
    # 2 -> 4 workers: standby rank 3's trainer, while it builds it ahead of joining.
    pytest.param(["parallel.dp=2", "reshard.schedule=[{step: 3, layout: {dp: 4}}]", "fault.kind=raise_in_setup",
                  "fault.rank=3"], (3, "tp1·pp1·dp4"), id="joining_worker"),
]


@pytest.mark.parametrize("overrides, expected", BUILD_AHEAD_FAULTS)
def test_a_rank_failing_to_build_ahead_makes_the_move_build_at_the_switch(uninterrupted, cache, tmp_path, overrides, expected):
    # Every rank drops what it built (the failure frees the failed build's groups at once, so
    # nobody waits out a timeout), and the move builds the new layout at the switch instead.
    step, target = expected
    reports = tmp_path / "moves.jsonl"
    summary = run_with_fault(tmp_path, cache, *overrides, f"reshard.report_file={reports}")
    (move,) = [json.loads(line) for line in reports.read_text().splitlines()]
    assert (move["step"], move["target"], move["built_ahead"]) == (step, target, False)
    assert summary["losses"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)


@pytest.mark.slow  # the job runs twice: outside the default suite (python -m pytest -m slow)
def test_worker_killed_mid_transfer_restarts_from_the_last_checkpoint(uninterrupted, cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    summary = run_with_fault(
        tmp_path, cache, "parallel.tp=2", "parallel.pp=2", SWITCH_AT_5, "fault.kind=kill",
        "launcher.max_restarts=1", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
        "checkpoint.interval=2",
    )
    assert any("restart 1 of the job" in n and "iteration 4" in n for n in summary["notes"])
    assert any("reshard tp2" in n for n in summary["notes"])  # done again, this time through
    assert summary["losses"] == pytest.approx(uninterrupted[4:], abs=LOSS_ATOL)
