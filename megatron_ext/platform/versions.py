"""The torch and megatron-core versions each use of their private APIs was checked against.

megatron_ext reaches into torch's and megatron-core's internals only from `platform/`, one module
per use. A private name can change in any release, and then the first sign would be an
AttributeError deep inside a run. So every such module has a row in `CHECKED` with the releases
(major.minor, both ends included) it was checked against, and `import megatron_ext` refuses an
installed torch or megatron-core outside the releases all its rows cover, with one line naming
the package, its version and that range (`require_checked_versions`). The versions are read
from the installed packages' metadata: the check imports neither torch nor megatron.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Optional


@dataclass(frozen=True)
class Checked:
    """The releases of `package` (its distribution name) from `first` to `last` (major.minor,
    both included) that a use of its internals was checked against."""

    package: str
    first: str
    last: str

    def covers(self, version: str) -> bool:
        found = _major_minor(version)
        return found is not None and _major_minor(self.first) <= found <= _major_minor(self.last)

    def describe(self) -> str:
        return self.first if self.first == self.last else f"{self.first} to {self.last}"


TORCH = "torch"
MEGATRON = "megatron-core"

# One row per platform module that uses a private torch or megatron-core API. The torch rows
# from 2.11 on: in each of 2.11.0, 2.12.1, 2.13.0 and 2.14.1, the names a module uses were read
# in torch's sources, and the tests of those modules ran on the CPU (docs/platform.md).
CHECKED: dict[str, Checked] = {
    "checkpoint_storage": Checked(TORCH, "2.6", "2.14"),  # torch.distributed.checkpoint's _StorageInfo
    "torch_worlds": Checked(TORCH, "2.11", "2.14"),  # c10d._World, _update_default_pg, group name registry
    "megatron_parallel_state": Checked(MEGATRON, "0.16", "0.16"),  # parallel_state's module globals
    "module_class_swap": Checked(TORCH, "2.11", "2.14"),  # nn.Module._parameters / _buffers, __getattr__
    "grouped_mm": Checked(TORCH, "2.11", "2.14"),  # torch._grouped_mm
    "fake_build": Checked(TORCH, "2.11", "2.14"),  # FakeProcessGroup._create_internal
    "dynamo_preload": Checked(TORCH, "2.11", "2.14"),  # torch._dynamo, which torch's optimizers import
    "moe_aux_loss_scale": Checked(MEGATRON, "0.16", "0.16"),  # MoEAuxLossAutoScaler's class-level scale
    "blended_dataset_rank": Checked(MEGATRON, "0.16", "0.16"),  # BlendedDataset's unguarded get_rank()
    "distributed_optimizer_internals": Checked(MEGATRON, "0.16", "0.16"),  # DistributedOptimizer's private methods
    "distributed_optimizer_mixed_groups": Checked(MEGATRON, "0.16", "0.16"),  # DistributedOptimizer.__init__
    "mla_rotary_key_grad": Checked(MEGATRON, "0.16", "0.16"),  # MLA's module-level gather, MLASelfAttention.__init__
    "mla_latent_norm_grads": Checked(MEGATRON, "0.16", "0.16"),  # finalize_model_grads' TP reduction of norms
    "grad_norm_check": Checked(MEGATRON, "0.16", "0.16"),  # which method the optimizers' step() takes the norm from
}


class UnsupportedVersion(ImportError):
    """An installed torch or megatron-core outside the releases megatron_ext was checked against."""


def installed_version(package: str) -> Optional[str]:
    """`package`'s installed version, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def supported(package: str) -> Checked:
    """The releases of `package` that every use of its internals was checked against."""
    rows = [c for c in CHECKED.values() if c.package == package]
    first = max((c.first for c in rows), key=_major_minor)
    last = min((c.last for c in rows), key=_major_minor)
    return Checked(package, first, last)


def require_checked_versions() -> None:
    """Raise UnsupportedVersion (one line) for an installed torch or megatron-core outside the
    releases its internals were checked with. A package that is not installed is left to fail
    where it is imported."""
    for package in dict.fromkeys(c.package for c in CHECKED.values()):
        version = installed_version(package)
        checked = supported(package)
        if version is not None and not checked.covers(version):
            raise UnsupportedVersion(
                f"{package} {version} is not supported: megatron_ext's uses of its internals "
                f"(megatron_ext/platform/) were checked with {package} {checked.describe()}"
            )


def _major_minor(version: str) -> Optional[tuple[int, int]]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None
