"""Length distributions and the batch sampler: truncation and rejection are counted and logged,
histograms sample inside their bins, and the lognormal fits reproduce the paper's anchors."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from megatron_ext.dpp.planning.lengths import COMMONCRAWL, GITHUB, Histogram, get_distribution, limit_lengths, sample_batch

# name -> (lengths, max_seq_len, overflow, expected kept, truncated, rejected)
LIMIT_CASES = {
    "nothing too long": ([5, 10, 3], 10, "truncate", (5, 10, 3), 0, 0),
    "truncate two": ([5, 12, 30], 10, "truncate", (5, 10, 10), 2, 0),
    "reject two": ([5, 12, 30], 10, "reject", (5,), 0, 2),
}


@pytest.mark.parametrize("name", LIMIT_CASES)
def test_limit_lengths_counts_and_logs(name, caplog):
    lengths, cap, overflow, kept, trunc, rej = LIMIT_CASES[name]
    with caplog.at_level(logging.INFO, logger="megatron_ext.dpp.planning.lengths"):
        out = limit_lengths(lengths, cap, overflow)
    assert (out.lengths, out.truncated, out.rejected) == (kept, trunc, rej)
    assert (f"{trunc + rej} of {len(lengths)}" in caplog.text) == bool(trunc + rej)


@pytest.mark.parametrize("bad,msg", [("clip", "overflow must be"), ("truncate-zero", "positive")])
def test_limit_lengths_bad_input(bad, msg):
    with pytest.raises(ValueError, match=msg):
        limit_lengths([0] if bad == "truncate-zero" else [1], 4, "truncate" if bad == "truncate-zero" else bad)


def test_rejecting_sampler_keeps_the_batch_full():
    out = sample_batch(GITHUB, 200, 4096, np.random.default_rng(0), overflow="reject")
    assert len(out.lengths) == 200 and max(out.lengths) <= 4096 and out.rejected > 0


# The reference's anchors for the fits: share of sequences <= 2K (paper Fig. 1b) and <= 16K.
@pytest.mark.parametrize("dist,le_2k,le_16k", [(GITHUB, 0.592, 0.949), (COMMONCRAWL, 0.699, 0.974)])
def test_lognormal_fits_match_the_anchors(dist, le_2k, le_16k):
    x = dist.sample(200_000, np.random.default_rng(1))
    assert np.mean(x <= 2048) == pytest.approx(le_2k, abs=0.01)
    assert np.mean(x <= 16384) == pytest.approx(le_16k, abs=0.01)


@pytest.mark.parametrize("name", ["python_stdlib", "site_packages"])
def test_frozen_histograms_sample_inside_their_bins(name):
    h = get_distribution(name)
    assert isinstance(h, Histogram) and sum(h.counts) > 1000
    x = h.sample(50_000, np.random.default_rng(2))
    assert x.min() >= h.edges[0] and x.max() < h.edges[-1]
    got = np.histogram(x, bins=h.edges)[0] / len(x)
    want = np.asarray(h.counts) / sum(h.counts)
    assert np.abs(got - want).max() < 0.01


def test_unknown_distribution_names_the_known_ones():
    with pytest.raises(ValueError, match="github"):
        get_distribution("wikipedia")


def test_rejecting_sampler_refuses_a_limit_that_almost_nothing_fits():
    with pytest.raises(ValueError, match="max_seq_len=2"):
        sample_batch(GITHUB, 8, 2, np.random.default_rng(0), overflow="reject")
