"""Building torch modules without memory or peers: meta tensors and fake process groups.

`on_meta` puts every tensor made inside on the meta device (shape, stride and storage offset, no
memory), also those given a device by name. `FakeProcessGroup` (torch's no-op backend, a C++
class and a torch internal, checked with the torch of `versions.CHECKED["fake_build"]`) answers
`rank()` and `size()` for any position without a peer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.overrides import TorchFunctionMode


def fake_group(rank: int, size: int) -> dist.ProcessGroup:
    """torch's no-op group, answering rank() and size() as a group of `size` ranks would to its
    `rank`-th member."""
    return FakeProcessGroup._create_internal(rank, size)


class _DeviceToMeta(TorchFunctionMode):
    """Sends every tensor asked for on a named device (megatron's and DDP's
    `device=torch.cuda.current_device()`) to the meta device instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is not None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Every tensor created inside is on the meta device: those given no device (torch's
    default device) and those given one. Anything that would read a value fails loudly. (Faster
    than FakeTensorMode for megatron's many views into DDP's buffers: torch's C++ meta kernels
    run them, where fake tensors dispatch each through Python, six times slower on a 70B stage.)"""
    with torch.device("meta"), _DeviceToMeta():
        yield
