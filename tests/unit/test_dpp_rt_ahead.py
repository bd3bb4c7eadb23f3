"""The dpp plugin's stream of planned batches, one process: planning the next batch in a
background thread gives the plans that planning at each step gives; a planner failure there is
raised at the next step; a run resumed from the plugin's checkpoint state sees the batches of
an uninterrupted run; and each step's token count is the real one (brute force)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from _dpp_cases import TOY
from megatron_ext.dpp.plugin import DppConfig, DppPlugin, StepPlanner

SEED = 7
MAX_SEQ_LEN = 256
# Lognormal document lengths (tokens), some over MAX_SEQ_LEN + 1, one too short to train on.
DOC_LENGTHS = [1] + np.minimum(np.maximum(2, np.rint(np.random.default_rng(5).lognormal(4.0, 1.2, 29))), 600).astype(int).tolist()
# ~1.9 MiB: the planner must recompute some layers of some batches (TOY cost model).
BUDGET_MB = 2e6 / 2**20


@pytest.fixture
def dataset(tmp_path) -> IndexedDataset:
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(1000))
    rng = np.random.default_rng(0)
    for n in DOC_LENGTHS:
        builder.add_document(rng.integers(0, 1000, n), [n])
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def config(**overrides) -> DppConfig:
    fields = dict(max_seq_len=MAX_SEQ_LEN, docs_per_batch=7, memory_budget_mb=BUDGET_MB, too_long="truncate")
    return DppConfig(**{**fields, **overrides})


def stream(dataset, cfg: DppConfig, state: dict | None = None, planner: StepPlanner | None = None):
    plugin = DppPlugin(cfg)
    if state is not None:
        plugin.load_state_dict(state)
    plugin._stream = plugin.plan_stream(dataset, SEED, planner or StepPlanner(cfg, TOY.num_layers, 1, TOY))
    return plugin


def take(plugin: DppPlugin, n: int) -> list[tuple]:
    """n planned batches as comparable values: plan, documents, position after, real tokens."""
    out = []
    for planned in (next(plugin._stream) for _ in range(n)):
        docs = tuple(tuple(d.tolist()) for d in planned.documents)
        out.append((planned.plan, docs, plugin._stream.position, plugin._stream.tokens))
    return out


def test_plans_made_ahead_equal_plans_made_at_each_step(one_rank_world, dataset):
    ahead = stream(dataset, config(plan_ahead=True))
    at_step = stream(dataset, config(plan_ahead=False))
    # 6 batches of 7 cross the end of the 30-document epoch; the budget makes the ILP recompute.
    got, want = take(ahead, 6), take(at_step, 6)
    assert got == want
    assert any(op.recompute for plan, *_ in got for g in plan.groups for op in g.ops[0])
    # The next plan is made while the caller is busy, not when it asks.
    deadline = time.monotonic() + 20
    while not ahead._stream.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead._stream.ready() and not at_step._stream.ready()


class _BrokenSolver(StepPlanner):
    """A planner whose solver breaks on the third batch (stands in for a planner bug)."""

    calls = 0

    def _plan(self, lengths):
        self.calls += 1
        if self.calls == 3:
            return super()._plan([])  # the real planner on bad input raises inside
        return super()._plan(lengths)


class _UnreadableAfter:
    """A dataset that fails to read documents after the first `n` reads (a lost file)."""

    def __init__(self, dataset, n: int) -> None:
        self.dataset, self.left = dataset, n

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        self.left -= 1
        if self.left < 0:
            raise OSError("input/output error")
        return self.dataset[i]


@pytest.mark.parametrize("plan_ahead", [True, False])
@pytest.mark.parametrize("where", ["solver", "reader"])
def test_a_planner_failure_is_raised_at_the_next_step(one_rank_world, dataset, plan_ahead, where):
    cfg = config(plan_ahead=plan_ahead)
    if where == "solver":
        plugin = stream(dataset, cfg, planner=_BrokenSolver(cfg, TOY.num_layers, 1, TOY))
        message = r"planner failed on data-parallel replica 0:(.|\n)*ValueError: dpp: a batch needs at least one sequence"
    else:
        plugin = stream(_UnreadableAfter(dataset, 16), cfg)
        message = "failed while preparing global batch 3: OSError" if plan_ahead else "input/output error"
    take(plugin, 2)
    with pytest.raises((RuntimeError, OSError), match=message):
        next(plugin._stream)


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_a_resumed_run_sees_the_batches_of_an_uninterrupted_run(one_rank_world, dataset, plan_ahead):
    cfg = config(plan_ahead=plan_ahead)
    uninterrupted = take(stream(dataset, cfg), 7)
    first = stream(dataset, cfg)
    take(first, 3)  # the 4th batch is being planned ahead: the state must not count it
    state = first.state_dict()
    assert state["stream"]["counts"] == uninterrupted[2][2].counts.__dict__
    resumed = stream(dataset, cfg, state=_through_a_checkpoint(state))
    assert resumed.state_dict() == state  # a save before the resumed run's first step keeps it
    assert take(resumed, 4) == uninterrupted[3:]


def _through_a_checkpoint(state: dict) -> dict:
    """What the trainer's common state gives back: torch.save / torch.load of plain values."""
    import io

    buffer = io.BytesIO()
    torch.save({"plugins": {"dpp": state}}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)["plugins"]["dpp"]


def test_a_checkpoint_of_another_dataset_or_seed_is_refused(one_rank_world, dataset, tmp_path):
    first = stream(dataset, config())
    take(first, 2)
    state = first.state_dict()
    state["stream"]["documents"] += 1
    with pytest.raises(ValueError, match="31 documents in the order of seed 7; this run reads 30"):
        stream(dataset, config(), state=state)


def brute_force_tokens(batches: int, docs_per_batch: int, too_long: str) -> list[int]:
    """Trained positions per global batch, from the document lengths and the seeded epoch
    orders alone."""
    lengths, epoch = [], 0
    while len(lengths) < batches * docs_per_batch:
        for i in np.random.default_rng(SEED + epoch).permutation(len(DOC_LENGTHS)):
            positions = DOC_LENGTHS[i] - 1
            if positions >= 1 and (positions <= MAX_SEQ_LEN or too_long == "truncate"):
                lengths.append(min(positions, MAX_SEQ_LEN))
        epoch += 1
    return [sum(lengths[b * docs_per_batch : (b + 1) * docs_per_batch]) for b in range(batches)]


@pytest.mark.parametrize("too_long", ["truncate", "reject"])
def test_step_tokens_are_the_real_document_tokens(one_rank_world, dataset, too_long):
    from types import SimpleNamespace

    plugin = stream(dataset, config(too_long=too_long, memory_budget_mb=1e3))
    notes: list[str] = []
    trainer = SimpleNamespace(cfg=SimpleNamespace(logging=SimpleNamespace(log_interval=1)), note=notes.append)
    want = brute_force_tokens(6, 7, too_long)
    got = []
    for step in range(1, 7):
        plugin.on_step_begin(trainer, step)
        planned = next(plugin._stream)
        assert sum(planned.plan.seq_lengths) == want[step - 1]  # one replica: its share is the batch
        metrics: dict = {}
        plugin.on_step_end(trainer, step, metrics)
        got.append(metrics["tokens"])
    assert got == want
    assert plugin.tokens_total == sum(want)
