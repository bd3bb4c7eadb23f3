"""Sequence-length distributions for planning and benchmarks, and a global-batch sampler.

Two kinds: lognormal fits of the GitHub and CommonCrawl distributions of the InfiniPipe paper
(fitted to the paper's reported length statistics), and frozen histograms measured
from text on this machine by `scripts/measure_lengths.py` (JSON under `dpp/planning/data/`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)
DATA_DIR = Path(__file__).parent / "data"
Overflow = Literal["truncate", "reject"]
OVERFLOW_POLICIES = ("truncate", "reject")


class LengthDistribution(Protocol):
    name: str

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray: ...


@dataclass(frozen=True)
class LogNormal:
    name: str
    mu: float
    sigma: float

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.maximum(1, np.rint(rng.lognormal(self.mu, self.sigma, n))).astype(np.int64)


@dataclass(frozen=True)
class Histogram:
    """Counts of lengths in bins [edges[i], edges[i+1]); samples log-uniformly inside a bin."""

    name: str
    edges: tuple[int, ...]
    counts: tuple[int, ...]
    source: str = ""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        counts = np.asarray(self.counts, dtype=float)
        bins = rng.choice(len(counts), size=n, p=counts / counts.sum())
        lo, hi = np.asarray(self.edges[:-1], float)[bins], np.asarray(self.edges[1:], float)[bins]
        return np.maximum(1, np.floor(np.exp(rng.uniform(np.log(lo), np.log(hi))))).astype(np.int64)

    @classmethod
    def load(cls, path: str | Path) -> "Histogram":
        d = json.loads(Path(path).read_text())
        return cls(d["name"], tuple(d["edges"]), tuple(d["counts"]), d.get("source", ""))


GITHUB = LogNormal("github", mu=7.280, sigma=1.479)
COMMONCRAWL = LogNormal("commoncrawl", mu=6.858, sigma=1.471)


def get_distribution(name: str) -> LengthDistribution:
    """`github`, `commoncrawl`, or the name of a frozen histogram in `dpp/planning/data/`."""
    fits = {d.name: d for d in (GITHUB, COMMONCRAWL)}
    if name in fits:
        return fits[name]
    path = DATA_DIR / f"lengths_{name}.json"
    if not path.exists():
        known = sorted(fits) + sorted(p.stem.removeprefix("lengths_") for p in DATA_DIR.glob("lengths_*.json"))
        raise ValueError(f"dpp: unknown length distribution {name!r}; known: {known}")
    return Histogram.load(path)


@dataclass(frozen=True)
class BatchLengths:
    lengths: tuple[int, ...]
    truncated: int
    rejected: int


def check_overflow(overflow: str, name: str = "dpp: overflow") -> None:
    """Refuse an overflow policy other than truncate / reject, naming the setting (`name`)."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"{name} must be 'truncate' or 'reject', got {overflow!r}")


def limit_length(n: int, max_seq_len: int, overflow: Overflow) -> int | None:
    """The length a sequence of `n` positions trains at: cut to `max_seq_len` (truncate), or
    None when it is dropped (reject)."""
    if n <= max_seq_len:
        return n
    return max_seq_len if overflow == "truncate" else None


def limit_lengths(lengths: Sequence[int], max_seq_len: int, overflow: Overflow) -> BatchLengths:
    """Cut sequences longer than `max_seq_len` to it, or drop them; counts are logged."""
    check_overflow(overflow)
    if any(n < 1 for n in lengths):
        raise ValueError("dpp: sequence lengths must be positive")
    long = sum(1 for n in lengths if n > max_seq_len)
    kept = tuple(k for k in (limit_length(int(n), max_seq_len, overflow) for n in lengths) if k is not None)
    out = BatchLengths(kept, truncated=long if overflow == "truncate" else 0, rejected=long if overflow == "reject" else 0)
    if long:
        log.info("dpp: %d of %d sequences longer than max_seq_len=%d %s", long, len(lengths), max_seq_len,
                 "truncated" if overflow == "truncate" else "rejected")
    return out


def sample_batch(
    dist: LengthDistribution,
    batch_size: int,
    max_seq_len: int,
    rng: np.random.Generator,
    overflow: Overflow = "truncate",
) -> BatchLengths:
    """A global batch of `batch_size` sequence lengths; with `reject`, rejected draws are
    replaced by new ones, so the batch stays full."""
    out = limit_lengths(dist.sample(batch_size, rng).tolist(), max_seq_len, overflow)
    rejected = out.rejected
    lengths = list(out.lengths)
    while len(lengths) < batch_size:
        if rejected > 100 * batch_size:  # (almost) nothing fits: never ends otherwise
            raise ValueError(
                f"dpp: {rejected} drawn lengths were over max_seq_len={max_seq_len} and only "
                f"{len(lengths)} of {batch_size} fit; raise max_seq_len or truncate"
            )
        more = limit_lengths(dist.sample(batch_size - len(lengths), rng).tolist(), max_seq_len, overflow)
        lengths += more.lengths
        rejected += more.rejected
    return BatchLengths(tuple(lengths), out.truncated, rejected)
