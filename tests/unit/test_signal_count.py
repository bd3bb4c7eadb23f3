"""The rule that tells a second pre-emption request from the first one delivered again (by the
process group and a launcher that forwards it): signals within SAME_REQUEST_S of the first are
that one request."""

from __future__ import annotations

import signal

import pytest

from megatron_ext.platform import signals
from megatron_ext.platform.signals import SAME_REQUEST_S, SignalCount

# name: (arrival times of the signals after the first, whether the last is a second request)
CASES = {
    "the first": ([], False),
    "the same request forwarded": ([0.001], False),
    "three paths at once": ([0.0, 0.002], False),
    "just inside the window": ([SAME_REQUEST_S * 0.99], False),
    "a second Ctrl-C": ([SAME_REQUEST_S + 0.5], True),
    "a forward, then a second one": ([0.001, SAME_REQUEST_S * 2], True),
}


@pytest.mark.parametrize("later, second", CASES.values(), ids=CASES.keys())
def test_second_request(monkeypatch, later, second):
    clock = [100.0]
    monkeypatch.setattr(signals.time, "monotonic", lambda: clock[0])
    count = SignalCount()
    answers = [count.is_second_request(signal.SIGTERM)]
    for t in later:
        clock[0] = 100.0 + t
        answers.append(count.is_second_request(signal.SIGINT))
    assert answers[:-1] == [False] * (len(answers) - 1)
    assert answers[-1] is second
    assert count.first == signal.SIGTERM
