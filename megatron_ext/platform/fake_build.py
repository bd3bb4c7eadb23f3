"""Building torch modules without memory or peers: fake tensors and fake process groups.

Both are torch internals (checked with the torch of `versions.CHECKED["fake_build"]`):
`FakeTensorMode` (torch._subclasses) makes tensors that carry shape, stride and storage offset
but no memory, and `FakeProcessGroup` (torch's no-op backend, a C++ class) answers `rank()` and
`size()` for any position without a peer.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["FakeTensorMode", "fake_group", "fake_tensor_mode"]


def fake_group(rank: int, size: int) -> dist.ProcessGroup:
    """torch's no-op group, answering rank() and size() as a group of `size` ranks would to its
    `rank`-th member."""
    return FakeProcessGroup._create_internal(rank, size)


def fake_tensor_mode() -> FakeTensorMode:
    """A fake-tensor mode that real tensors may meet (they are read as fakes)."""
    return FakeTensorMode(allow_non_fake_inputs=True)
