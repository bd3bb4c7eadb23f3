"""scripts/bench/convert.py's bookkeeping, without converting anything: a conversion's row sums
its passes and sets its bytes against the minimum, each target is judged per pass count, the
training and target layouts are ones the models take, and the plot draws from a report."""

from __future__ import annotations

import pytest

from megatron_ext.config import compose_config
from megatron_ext.config.validate import validate
from tests.unit._bench_scripts import bench_script


@pytest.fixture(scope="module")
def convert():
    # imported by name from its folder, so that a spawned process finds it too
    with bench_script("convert") as module:
        yield module


def a_pass(read: int, written: int, ranks: int = 4) -> dict:
    return {"ranks": ranks, "read_bytes": read, "written_bytes": written, "load_s": 1.0, "save_s": 2.0}


def measured(*passes: dict) -> dict:
    return {"wall_s": 10.0, "passes": list(passes), "peak_rss_bytes": 2**30}


def test_a_row_sums_its_passes_and_divides_by_the_minimum(convert):
    conversion = convert.Conversion(convert.DP, 1, 1, fully_reshardable=False)
    row = convert.record("llama_tiny", conversion, measured(a_pass(300, 200), a_pass(250, 100, ranks=1)), 200, 100)
    assert row["workers"] == [4, 1]
    assert (row["read_bytes"], row["written_bytes"]) == (550, 300)
    assert (row["load_s"], row["save_s"]) == (2.0, 4.0)
    assert (row["read_over_source"], row["written_over_output"]) == (2.75, 3.0)
    assert row["label"] == "dp TP2×PP2 → dp TP1×PP1" and row["role"] is None
    assert convert.record("m", convert.BASELINE, measured(a_pass(1, 1)), 1, 1)["role"] == "baseline"


def test_each_target_is_judged_on_the_conversions_of_its_pass_count(convert):
    one = convert.Conversion(convert.FULLY, 1, 4, fully_reshardable=False)
    two = convert.Conversion(convert.DP, 1, 4, fully_reshardable=False)
    rows = [
        convert.record("small", one, measured(a_pass(120, 100)), 100, 100),  # within 1.25x
        convert.record("large", one, measured(a_pass(130, 100)), 100, 100),  # reads 1.3x
        convert.record("small", two, measured(a_pass(120, 100), a_pass(120, 100)), 100, 100),  # 2.4x, 2x
    ]
    verdicts = convert.judge(rows)
    assert verdicts["read_over_source_1_pass"] == {
        "at_most": 1.25, "met": False, "checked": 2, "missed": ["fully TP2×PP2 → dp TP1×PP4 (large)"]}
    assert verdicts["written_over_output_1_pass"]["met"] is True
    assert verdicts["read_over_source_2_pass"] == {"at_most": 2.5, "met": True, "checked": 1, "missed": []}
    assert set(verdicts) == {f"{key}_{n}_pass" for key in convert.TARGETS for n in (1, 2)}


def test_the_size_on_disk_counts_every_file_below(convert, tmp_path):
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000001" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1\n")
    assert convert.size_on_disk(tmp_path) == 1002


@pytest.mark.parametrize("model", ["llama_tiny", "llama_100m"])
def test_the_models_take_the_training_layout_and_every_target_layout(convert, model, tmp_path):
    validate(compose_config(convert.train_overrides(model, tmp_path / "ckpt")), convert.WORKERS)
    for c in convert.CONVERSIONS:
        validate(compose_config([f"model={model}", f"parallel.tp={c.tp}", f"parallel.pp={c.pp}"]), c.tp * c.pp)


def test_the_plot_draws_every_conversion_of_every_model(convert, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{**convert.record(model, c, measured(*[a_pass(100, 100)] * (1 + (c.source == convert.DP))), 100, 100),
             "wall_over_baseline": 1.0} for model in ("a", "b") for c in convert.CONVERSIONS]
    convert.plot({"models": ["a", "b"], "conversions": rows}, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0
