"""The local layers' context parallelism: which tokens a rank holds, against megatron's own split."""

from __future__ import annotations

import pytest
import torch
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_ext.models.context_parallel import _global_order, chunk_positions


class _Group:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp, seq", [(2, 8), (2, 64), (3, 12), (4, 32)])
def test_chunk_positions_match_megatrons_batch_split(monkeypatch, cp, seq):
    import megatron.core.utils as mcore_utils

    monkeypatch.setattr(mcore_utils, "get_pg_size", lambda g: g.size())
    monkeypatch.setattr(mcore_utils, "get_pg_rank", lambda g: g.rank())
    held = []
    for rank in range(cp):
        batch = get_batch_on_this_cp_rank({"tokens": torch.arange(seq)[None]}, cp_group=_Group(cp, rank))
        assert torch.equal(batch["tokens"][0], chunk_positions(seq, cp, rank))
        held.append(batch["tokens"][0])
    # The gather's reorder puts every rank's tokens back in sequence order.
    assert torch.equal(torch.cat(held)[_global_order(cp, seq // (2 * cp))], torch.arange(seq))
