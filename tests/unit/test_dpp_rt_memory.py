"""The activation meter counts what autograd saves exactly: by storage, without parameters,
until backward frees it; the K/V prefix cache counts once with what attention saves."""

from __future__ import annotations

import torch

from megatron_ext.dpp.attention import PrefixKVCache
from megatron_ext.dpp.memory import ActivationMeter


def test_saved_storages_count_once_and_parameters_not_at_all():
    w = torch.nn.Parameter(torch.randn(8, 8))
    meter = ActivationMeter([torch.nn.ParameterList([w])])
    x = torch.randn(16, 8, requires_grad=True)
    with meter.track(chunk=3):
        h = x @ w  # saves x (counted) and w (a parameter: not counted)
        # mul saves h and a scalar; pow saves a view of h (the same storage: counted once)
        y = (h * h[:4].sum()).sum() + (h[8:] ** 2).sum()
    expected = x.untyped_storage().nbytes() + h.untyped_storage().nbytes() + 4
    assert meter.live_bytes == meter.peak_bytes == expected
    assert meter.by_chunk == {3: expected}
    y.backward()
    del y, h
    assert meter.live_bytes == 0 and meter.peak_bytes == expected


def test_cached_kv_shares_storage_with_saved_tensors():
    meter = ActivationMeter([])
    cache = PrefixKVCache()
    cache.hold = meter.hold
    k, v = torch.randn(5, 1, 2, 4, requires_grad=True), torch.randn(5, 1, 2, 4, requires_grad=True)
    with meter.track(chunk=0):
        out = (k * v).sum()  # saves k and v
        cache.put((0, 1), 0, k, v)
    assert meter.live_bytes == 2 * 5 * 2 * 4 * 4
    out.backward()
    del out
    assert meter.live_bytes == 2 * 5 * 2 * 4 * 4  # still held by the cache
    cache.done((0, 1), 0)
    assert meter.live_bytes == 0
